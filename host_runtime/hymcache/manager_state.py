"""The KV Manager's limits, its argument checks and the per-request state its methods share (manager_core.py
and its mixins, the confirmer, the server); lookup.py takes the request checks from here too."""

from __future__ import annotations

import errno
import math
import os

from common.checks import Checks
from driver.errors import ChmError
from host_runtime.hymcache.messages import KEY_BYTES, MAX_REQUEST_ID, BlockLoc
from host_runtime.hymcache.window import MIN_WINDOW_BLOCKS

LOOKUP_BATCH = 32              # keys per Master lookup, as the worker's Lookup
REQUEST_TIMEOUT_S = 30.0
MAX_HINT_KEYS = 1 << 16        # 65536 blocks: far past any context (bounds one call's work)
WAIT_STEP_S = 0.002            # how often a blocked acquire looks again (a poll interval, not a deadline)
LOOK_STEP_S = 200e-6           # ... at a block whose SSD reads are in flight (the served Manager's held calls too)
REOPEN_INTERVAL_S = 1.0        # per device: reopen a gone one / look whether a live one was restarted
MAX_NODE = 2**31 - 1
MAX_WINDOW_BYTES = 1 << 40       # a request's prefetch window, at most (1 TiB)
MAX_U64 = (1 << 64) - 1        # MessagePack's uint: offsets, lengths, checksums, versions

check = Checks(lambda message: ChmError(errno.EINVAL, message))


def _check_request_id(request_id) -> str:
    return check.text("request_id", request_id, 1, MAX_REQUEST_ID)


def _check_key(key, name: str = "key") -> bytes:
    return check.blob(name, key, KEY_BYTES)


def _check_keys(keys) -> list[bytes]:
    keys = check.items("keys", keys, 1, MAX_HINT_KEYS)
    return [_check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]


def _check_seconds(name: str, value, allow_zero: bool = True) -> float:
    """Seconds in [0, inf) (``allow_zero``) or (0, inf); NaN never passes."""
    return check.number(name, value, 0, math.inf, low_open=not allow_zero, high_open=True)


def node_path(device_node: str) -> str:
    """The path a worker on this machine opens with libchm (a bare name lives in /dev/shm, as chm serve puts it)."""
    return device_node if "/" in device_node else os.path.join("/dev/shm", device_node)


def _node_id(path: str) -> tuple[int, int] | None:
    """The node file's identity: a server stopped cleanly removes it, the next one creates another."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# Block states, in the order a block goes through them.
QUEUED, ISSUED, STAGED, RELEASED, FAILED = "queued", "issued", "staged", "released", "failed"


class _Block:
    __slots__ = ("loc", "state", "handle", "error", "epoch", "confirmed")

    def __init__(self, loc: BlockLoc, epoch: int, confirmed: bool = True):
        self.loc, self.state, self.handle, self.error = loc, QUEUED, 0, None
        self.epoch = epoch  # its device's epoch when the Master gave the location: another one makes it stale
        self.confirmed = confirmed  # False: from the hint's descriptors, until this Manager's own lookup agrees


class _Confirmation:
    """A hint's keys, until this Manager's Master lookup has resolved them (a batch at a time)."""
    __slots__ = ("keys", "next", "confirmed", "speculated", "asked")

    def __init__(self, keys: list[bytes], speculated: bool):
        self.keys, self.next, self.speculated = keys, 0, speculated  # speculated: staging from the hint's locs
        self.confirmed: list[BlockLoc] = []  # the Master's answers so far, in order
        self.asked = False  # its lookups are with the confirmer's thread


class _Request:
    __slots__ = ("request_id", "blocks", "by_key", "next_issue", "held", "window", "touched", "callers",
                 "confirmation", "leases")

    def __init__(self, request_id: str, caller, now: float):
        self.request_id, self.touched = request_id, now
        self.confirmation: _Confirmation | None = None  # until this Manager's Master lookup resolved the hint
        self.leases: dict[bytes, tuple[int, int]] = {}  # key -> (version, expiry Unix ms) of a checked lease token
        self.callers = set() if caller is None else {caller}  # connections that used it (over ZeroMQ)
        self.blocks: list[_Block] = []     # this node's hits, in consumption order
        self.by_key: dict[bytes, _Block] = {}
        self.next_issue = 0                # blocks before it are issued (or failed)
        self.held = 0                      # issued or staged, not released: at most `window`
        self.window = MIN_WINDOW_BLOCKS


class _Unconfirmed(ChmError):
    """A block asked for before this Manager's Master lookup of its request's hint has answered."""

