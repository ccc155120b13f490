"""The KV Manager: one per storage node, in front of the node's `chm serve` devices.

It takes prefetch hints (a request's keys in the order the worker will consume them), resolves
them against the Master itself (batches of 32, in order: the paper's remote-hit matching in the
Manager) and stages the blocks stored on this node with ``chm_prefetch_object`` in that order,
at most a window of blocks per request at once: min(``window_bytes`` worth of blocks, the
hits), never fewer than 2 (double buffering). A device that answers EBUSY (its prefetch window or
handles are full) leaves the block queued; it is issued again at the next progress (a release, a
hint, the server's tick), never failed. A worker gets a ``ReadToken`` per staged block
(``acquire``), reads it (libchm directly on the same machine, ``read`` over ZeroMQ from another
one) and gives it back (``release``), which moves the window on. Served, the Manager never waits on a
device: an acquire (or read) whose block is still staging is held by the server, which polls the device
(``chm_prefetch_poll``) and answers once the block is staged, so one request's staging delays no other call.

A hint may carry the descriptors of the Lookup's own Master lookup: those blocks start staging at once,
and the Manager's lookup stays the authority (only blocks it confirms are handed out). Served over
ZeroMQ, such a hint is answered as soon as staging starts and confirmed right after (the server's tick)
or at the request's first block call, whichever comes first, so the Lookup waits for one Master round
trip, not two.

A request's prefetches are cancelled (handles released) on ``finish``, when nothing touched it
for ``request_timeout_s`` on the injected clock, and when its worker disconnects: the served
Manager watches its ROUTER socket's monitor for DISCONNECTED events and maps each caller's ZeroMQ
routing id to the socket fd its messages came in on (``zmq.SRCFD``). A request remembers every
connection that used it (the worker's Lookup hints on one, its reads come on another) and is
cancelled when the last of them closes. A worker whose process dies has its TCP/IPC connections
closed by the kernel, so its requests go at once; the timeout is the backstop for a worker that
hangs with a connection open.

A device that goes away (ENODEV: its ``chm serve`` died) loses its libchm handle and the blocks staged
through it (they fail: the worker recomputes). The Manager reopens it at its next use and on the
server's tick (at most every ``REOPEN_INTERVAL_S`` per device; the tick also notices a device restarted
under an idle Manager: its node shows another server pid or node file). Back with another epoch (``--format``), its
old blocks are stale: the node is registered with the Master again, which drops them.

State is guarded by one lock: the served Manager (its RpcServer thread) and in-process callers
(other threads) may share one KVManager. libchm handles are one thread's at a time, which the lock
also guarantees.
"""

from __future__ import annotations

import errno
import os
import signal
import statistics
import threading
import time
from collections import OrderedDict
from typing import Callable

import msgspec
import zmq
import zmq.utils.monitor

import libchm
from driver.errors import ChmError
from host_runtime.hymcache.clock import Clock, WallClock
from host_runtime.hymcache import auth
from host_runtime.hymcache.messages import KEY_BYTES, MAX_REQUEST_ID, BlockLoc, DeviceInfo, ReadToken, to
from host_runtime.hymcache.window import MIN_WINDOW_BLOCKS, WINDOW_BYTES, window_blocks
from host_runtime.hymcache.rpc import (ANSWERS_PER_PASS, MAX_BLOCK_BYTES, Payload, RemoteError, RpcClient, RpcServer,
                                       RpcTimeout, TypedClient, call_of)

LOOKUP_BATCH = 32              # keys per Master lookup, as the worker's Lookup
REQUEST_TIMEOUT_S = 30.0
MAX_HINT_KEYS = 1 << 16        # 65536 blocks: far past any context (bounds one call's work)
WAIT_STEP_S = 0.002            # how often a blocked acquire looks again (a poll interval, not a deadline)
LOOK_STEP_S = 200e-6           # ... at a block whose SSD reads are in flight (the served Manager's held calls too)
REOPEN_INTERVAL_S = 1.0        # per device: reopen a gone one / look whether a live one was restarted

MANAGER_METHODS = ("hint", "acquire", "read", "write", "release", "finish", "touch", "progress", "stats", "devices",
                   "lease")
# Served with keys, who may call what (auth.py): a worker's load and store; stats for admin and monitor.
MANAGER_ROLES = {**{m: {"worker"} for m in ("hint", "acquire", "read", "write", "release", "finish", "touch",
                                             "lease")},
                 "progress": {"worker", "admin"}, "devices": {"worker", "admin", "monitor"},
                 "stats": {"admin", "monitor"}}


def _check_request_id(request_id) -> str:
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_REQUEST_ID:
        raise ChmError(errno.EINVAL, f"request_id {request_id!r} must be a str of 1 to {MAX_REQUEST_ID} characters")
    return request_id


def _check_key(key, name: str = "key") -> bytes:
    if isinstance(key, memoryview):
        key = key.tobytes()
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        shown = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ChmError(errno.EINVAL, f"{name} must be {KEY_BYTES} bytes, got {shown}")
    return bytes(key)


def _check_keys(keys) -> list[bytes]:
    if not isinstance(keys, (list, tuple)) or not 1 <= len(keys) <= MAX_HINT_KEYS:
        shown = f"{len(keys)} keys" if isinstance(keys, (list, tuple)) else type(keys).__name__
        raise ChmError(errno.EINVAL, f"keys must be a list of 1 to {MAX_HINT_KEYS} keys, got {shown}")
    return [_check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ChmError(errno.EINVAL, f"{name} {value!r} is outside the allowed range: an integer in [{low}, {high}]")
    return value


def _check_seconds(name: str, value, allow_zero: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0) and value < float("inf")
    if not ok:  # NaN fails too
        raise ChmError(errno.EINVAL, f"{name} {value!r} is outside the allowed range: seconds in "
                                     f"{'[0' if allow_zero else '(0'}, inf)")
    return float(value)


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


class KVManager:
    """The KV Manager of storage node ``node``: its devices are the ``chm serve`` nodes ``device_nodes``.

    ``master`` is a Master (in process) or a MasterClient; ``clock`` times request timeouts and
    acquire deadlines. ``window_bytes`` bounds each request's staged blocks (min 2 blocks).
    """

    def __init__(self, node: int, device_nodes: list[str], master, clock: Clock, *, window_bytes: int = WINDOW_BYTES,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, endpoint: str = "", batch: int = LOOKUP_BATCH,
                 log: Callable[[str], None] | None = None, open_device: Callable[[str], libchm.Device] = libchm.Device):
        self.node = _check_int("node", node, 0, 2**31 - 1)
        if (not isinstance(device_nodes, (list, tuple)) or not device_nodes
                or not all(isinstance(d, str) and d for d in device_nodes)):
            raise ChmError(errno.EINVAL, f"device_nodes {device_nodes!r} must be a non-empty list of chm serve "
                                         "node names or paths")
        self.window_bytes = _check_int("window_bytes", window_bytes, 1, 1 << 40)
        self.request_timeout_s = _check_seconds("request_timeout_s", request_timeout_s, allow_zero=False)
        self.batch = _check_int("batch", batch, 1, LOOKUP_BATCH)
        if not isinstance(endpoint, str):
            raise ChmError(errno.EINVAL, f"endpoint {endpoint!r} must be a str (a ZeroMQ address, or '' in process)")
        for method in ("lookup", "register_node"):
            if not callable(getattr(master, method, None)):
                raise ChmError(errno.EINVAL, f"master {master!r} has no {method}(): pass a Master or a MasterClient")
        self.master, self.clock, self.endpoint = master, clock, endpoint
        self.log = log or (lambda msg: None)
        self._open_device = open_device  # libchm.Device; the serving simulation passes its emulated devices
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._caller = None    # set by the served Manager around each call: who is calling
        self.lease_secret: bytes | None = None  # the node's, from register_node: the served read checks leases
        self._confirmer: _Confirmer | None = None  # confirm_in_background
        self.held_calls = 0    # set by the served Manager: acquires/reads it holds until their block is staged
        # One libchm handle per device, in device order; None while the device is gone (see _gone/_reopen).
        self.handles: list[libchm.Device | None] = []
        self.requests: OrderedDict[str, _Request] = OrderedDict()   # oldest first: issued first
        try:
            for name in device_nodes:
                self.handles.append(open_device(node_path(name)))
        except ChmError:
            self.close()
            raise
        self.infos = [DeviceInfo(device=i, node_path=node_path(name), capacity_bytes=dev.info()["capacity_bytes"],
                                 epoch=dev.info()["device_epoch"])
                      for i, (name, dev) in enumerate(zip(device_nodes, self.handles))]
        # Who served each device when it was opened: another pid or node file means it was restarted.
        self._served_by = [(dev.info()["server_pid"], _node_id(dev.node)) for dev in self.handles]
        self._check_at = [0.0] * len(self.handles)  # clock time of each device's next reopen / restart check
        self._gone_why = [""] * len(self.handles)   # why a gone device is not back (its ENODEV says it)
        self.counters = dict.fromkeys((
            "hints", "hinted_keys", "hint_hits", "hint_other_node", "hint_locs_used", "hint_locs_unconfirmed",
            "confirm_errors", "num_retrieve_requests", "num_hit_tokens",
            "prefetches", "ebusy", "unfit", "releases", "num_load_errors", "finished", "num_timeouts_recompute",
            "cancelled_disconnect", "remote_reads", "remote_read_bytes", "remote_writes", "remote_write_bytes",
            "write_refused", "devices_gone", "devices_reopened", "devices_new_epoch", "leases_refused",
            "reads_refused"), 0)
        self.device_counters = [dict.fromkeys(("prefetches", "prefetch_bytes", "ebusy", "read_bytes",
                                               "written_bytes", "write_refused", "gone", "reopened"), 0)
                                for _ in self.handles]
        self.held_bytes = [0] * len(self.handles)
        self.window_bytes_max = 0
        self.handles_max = 0
        try:
            self.register(endpoint)
        except BaseException:  # the Master unreachable or refusing: detach from the devices again
            self.close()
            raise

    # ---- registration --------------------------------------------------------------
    def register(self, endpoint: str | None = None) -> None:
        """Announce this node and its devices to the Master (again, e.g. once the server knows its port)."""
        with self._lock:
            if endpoint is not None:
                self.endpoint = endpoint
            self._took_secret(self.master.register_node(self.node, self.endpoint, list(self.infos)))

    def _took_secret(self, answer) -> None:
        """The node's lease secret: register_node's answer over ZeroMQ, or an in-process Master's."""
        if isinstance(answer, (bytes, bytearray)) and answer:
            self.lease_secret = bytes(answer)
        elif callable(getattr(self.master, "node_secret", None)):
            self.lease_secret = self.master.node_secret(self.node)

    # ---- devices that go away and come back ----------------------------------------
    def _handle(self, i: int) -> libchm.Device:
        """Device ``i``'s handle, reopened first if it went away; ENODEV while it stays gone."""
        dev = self.handles[i] or self._reopen(i)
        if dev is None:
            raise ChmError(errno.ENODEV, f"device {i} ({self.infos[i].node_path}) is gone ({self._gone_why[i]}); "
                                         f"reopened at most every {REOPEN_INTERVAL_S:g} s")
        return dev

    def _gone(self, i: int, exc: ChmError) -> None:
        """Device ``i`` answered ENODEV: drop its handle; the blocks staged through it go with it (failed)."""
        dev = self.handles[i]
        if dev is None:
            return
        self.handles[i] = None
        self._gone_why[i] = exc.message
        self._check_at[i] = self.clock.now()  # the next use tries at once: it may be back already
        self.counters["devices_gone"] += 1
        self.device_counters[i]["gone"] += 1
        self.log(f"device {i} ({self.infos[i].node_path}) went away ({exc.message}); its staged blocks failed")
        try:
            dev.close()
        except ChmError:
            pass
        lost = ChmError(errno.ENODEV, f"device {i} ({self.infos[i].node_path}) went away while the block was "
                                      f"staged on it ({exc.message})")
        for req in self.requests.values():
            for block in req.blocks[:req.next_issue]:
                if block.loc.device == i and block.state in (ISSUED, STAGED):
                    if block.handle:  # held (an unfit block, handle 0, never was)
                        req.held -= 1
                        self.held_bytes[i] -= block.loc.length
                    block.state, block.handle, block.error = FAILED, 0, lost
                    self.counters["num_load_errors"] += 1
        self._changed.notify_all()

    def _reopen(self, i: int) -> libchm.Device | None:
        """Try to reopen gone device ``i`` (at most every REOPEN_INTERVAL_S); its handle, or None.

        Back with another epoch or capacity, its blocks are stale: the node is registered again (the Master
        drops them). If the Master cannot be told, the device stays gone: serving it would serve stale blocks."""
        now = self.clock.now()
        if now < self._check_at[i]:
            return None
        self._check_at[i] = now + REOPEN_INTERVAL_S
        path = self.infos[i].node_path
        try:
            dev = self._open_device(path)
        except ChmError as exc:
            self._gone_why[i] = exc.message
            return None
        try:
            info = dev.info()
            old = self.infos[i]
            new = DeviceInfo(device=i, node_path=path, capacity_bytes=info["capacity_bytes"],
                             epoch=info["device_epoch"])
            if (new.epoch, new.capacity_bytes) != (old.epoch, old.capacity_bytes):
                infos = list(self.infos)
                infos[i] = new
                self.master.register_node(self.node, self.endpoint, infos)
                self.counters["devices_new_epoch"] += 1
                self.log(f"device {i} ({path}) is back with epoch {new.epoch} (was {old.epoch}): node "
                         f"{self.node} registered again, its old blocks are stale")
            self.infos[i] = new
        except Exception as exc:  # the Master unreachable or refusing: try it all again later
            dev.close()
            self._gone_why[i] = f"back, but registering its new epoch failed: {exc}"
            self.log(f"device {i} ({path}): {self._gone_why[i]}")
            return None
        self.handles[i] = dev
        self._served_by[i] = (info["server_pid"], _node_id(path))
        self._gone_why[i] = ""
        self.counters["devices_reopened"] += 1
        self.device_counters[i]["reopened"] += 1
        self.log(f"device {i} ({path}) reopened")
        return dev

    def _check_devices(self) -> None:
        """The tick's look at each device (at most every REOPEN_INTERVAL_S): reopen a gone one; drop a live
        one whose node shows another server (restarted while nothing here used it), then reopen it."""
        now = self.clock.now()
        for i, dev in enumerate(self.handles):
            if now < self._check_at[i]:
                continue
            if dev is not None:
                self._check_at[i] = now + REOPEN_INTERVAL_S
                try:  # the node's shared page and a stat: no round trip to the device
                    now_by = (dev.info()["server_pid"], _node_id(self.infos[i].node_path))
                except ChmError as exc:
                    self._gone(i, exc)
                else:
                    if now_by == self._served_by[i]:
                        continue
                    self._gone(i, ChmError(errno.ENODEV, f"restarted: served by (pid, node file) {now_by}, "
                                                         f"was {self._served_by[i]}"))
            self._reopen(i)

    def _attached(self, i: int) -> bool:
        return i < len(self.handles) and self.handles[i] is not None  # none at all once closed

    def _device_error(self, i: int, exc: ChmError) -> None:
        """After a failed call on device ``i``: ENODEV means it went away."""
        if exc.errno == errno.ENODEV:
            self._gone(i, exc)

    # ---- hints ---------------------------------------------------------------------
    def hint(self, request_id: str, keys: list[bytes], locs: list | None = None, confirm_later: bool = False) -> int:
        """Stage ``keys``' blocks stored on this node, in this order, a window at a time; how many it will stage
        (a block the device then fails to stage reports its error at ``acquire``).

        ``locs``: the descriptors the Lookup's own Master lookup gave for the first keys (``locs[i]`` is
        ``keys[i]``'s). Those on this node start staging at once, before this Manager's own lookup -- which
        stays the authority: no block is handed out before the Master has confirmed its descriptor here, and
        if the answers differ every unconfirmed staging is released and the Master's answer is staged instead
        (``hint_locs_unconfirmed``). The Manager's Master round trip is then off the load's critical path.

        ``confirm_later`` (with ``locs``): return once the descriptors are staging and confirm them at the next
        ``progress`` or block call, whichever comes first (the served Manager's hint: the Lookup does not wait
        for this Manager's Master round trip). With ``confirm_in_background`` the confirmer's thread confirms
        it instead, and a block call before that answers ETIMEDOUT (the served Manager holds it). The count
        returned is then the descriptors' blocks here; a confirmation that fails cancels the request, so its
        blocks answer ENOENT and the worker recomputes. Without ``locs`` the hint is resolved at the Master
        before it returns."""
        request_id, keys = _check_request_id(request_id), _check_keys(keys)
        locs = self._check_hint_locs(keys, locs)
        with self._lock:
            if request_id in self.requests:
                raise ChmError(errno.EEXIST, f"request_id {request_id!r} already has a hint here; finish() it first")
            req = _Request(request_id, self._caller, self.clock.now())
            self.requests[request_id] = req
            self._take_leases(req, locs)
            locs = [msgspec.structs.replace(loc, lease=b"") if loc.lease else loc for loc in locs]  # as the Master's
            self.counters["hints"] += 1
            self.counters["hinted_keys"] += len(keys)
            if locs:
                try:
                    self._speculate(req, locs)
                except Exception:
                    self._cancel(req)  # nothing of this request stays held
                    raise
            req.confirmation = _Confirmation(keys, any(not block.confirmed for block in req.blocks))
            if not (locs and confirm_later):
                self._confirm(req)
            elif self._confirmer is not None:
                self._confirmer.kick()
            self._changed.notify_all()
            return len(req.blocks)

    def lease(self, request_id: str, locs: list) -> int:
        """The Master's read leases of ``request_id`` on blocks here (``BlockLoc.lease`` of a lookup for that
        request: the Lookup hands over those its hint did not carry); how many are valid. A served ``read`` sends
        a block's bytes only to a request holding a valid lease on the block's version."""
        request_id = _check_request_id(request_id)
        if not isinstance(locs, (list, tuple)) or len(locs) > MAX_HINT_KEYS:
            raise ChmError(errno.EINVAL, f"locs must be a list of at most {MAX_HINT_KEYS} block descriptors")
        try:
            locs = [loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc) for loc in locs]
        except (TypeError, ValueError, msgspec.ValidationError) as exc:
            raise ChmError(errno.EINVAL, f"locs must be a list of block descriptors (BlockLoc): {exc}") from None
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                raise ChmError(errno.ENOENT, f"request_id {request_id!r} has no hint here (never hinted, finished, "
                                             "timed out or its worker disconnected)")
            self._touch(req)
            return self._take_leases(req, locs)

    def _take_leases(self, req: _Request, locs: list[BlockLoc]) -> int:
        """Keep the valid lease tokens among ``locs`` (others' leases, other nodes' and forged ones are not)."""
        taken = 0
        for loc in locs:
            if not loc.lease or self.lease_secret is None or loc.node != self.node:
                continue
            expiry = auth.lease_expiry(self.lease_secret, loc.lease, req.request_id, loc.key, loc.version, self.node)
            if expiry is None:
                self.counters["leases_refused"] += 1
                continue
            req.leases[loc.key] = (loc.version, expiry)
            taken += 1
        return taken

    def _check_lease(self, request_id: str, key: bytes) -> None:
        """EACCES unless ``request_id`` holds an unexpired Master lease on ``key``'s block, at its version."""
        req = self.requests.get(request_id)
        block = req.by_key.get(key) if req is not None else None
        held = req.leases.get(key) if req is not None else None
        why = None
        if self.lease_secret is None:
            why = "this Manager has no lease secret (its Master gave none at register_node)"
        elif held is None:
            why = "it holds no lease on it: pass the Master's (lookup with this request id) in the hint or lease()"
        elif block is not None and held[0] != block.loc.version:
            why = f"its lease is on version {held[0]}, the block stored is version {block.loc.version}"
        elif auth.now_ms() >= held[1]:
            why = f"its lease ended {auth.now_ms() - held[1]} ms ago"
        if why is not None:
            self.counters["reads_refused"] += 1
            raise ChmError(errno.EACCES, f"read of block {key.hex()} refused to request {request_id!r}: {why}")

    def _confirm(self, req: _Request) -> None:
        """Resolve the hint's keys at the Master and stage the hits here; drop what the Master did not confirm."""
        state = req.confirmation
        try:
            while True:
                found = self.master.lookup(self._next_batch(state))
                if self._confirmed_batch(req, state, found):
                    break
        except Exception:
            self._cancel(req)  # the Master unreachable (or a bad answer): nothing of this request stays held
            raise

    def _next_batch(self, state: _Confirmation) -> list[bytes]:
        return state.keys[state.next:state.next + self.batch]

    def _confirmed_batch(self, req: _Request, state: _Confirmation, found: list) -> bool:
        """The Master's answer to the request's next batch: stage its hits here; True once the confirmation is
        complete (then what the Master did not confirm is dropped)."""
        found = [loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc) for loc in found]
        asked = len(self._next_batch(state))
        state.confirmed.extend(found)
        state.next += asked
        self._add_hits(req, found)
        self._issue(req)  # the first blocks go to the device before the next batch is resolved
        if len(found) < asked or state.next >= len(state.keys):  # the stored prefix ends here
            req.confirmation = None
            if state.speculated and not self._as_confirmed(req, state.confirmed):
                self._restart(req, state.confirmed)
            self._changed.notify_all()
            return True
        return False

    def _confirm_failed(self, req: _Request, exc: Exception) -> None:
        """The request's Master lookup failed: cancel it (its blocks answer ENOENT, the worker recomputes)."""
        self.counters["confirm_errors"] += 1
        self.log(f"request {req.request_id}: its hint's Master lookup failed ({type(exc).__name__}: "
                 f"{exc}); cancelled, the worker recomputes")
        self._cancel(req)

    def confirm_in_background(self, master_endpoint: str, timeout_s: float = 10.0, curve_keys: str | None = None) -> None:
        """Confirm hints answered before their Master lookup (``hint(confirm_later=True)``) on a thread of their
        own, every request's lookups in flight at once to ``master_endpoint``, each failing alone after
        ``timeout_s``: a Master that is slow or gone then holds up no call here, and a restarted one answers
        the new requests at once (the served Manager does this)."""
        with self._lock:
            if self._confirmer is None:
                self._confirmer = _Confirmer(self, master_endpoint, _check_seconds("timeout_s", timeout_s, False),
                                             curve_keys)

    def _confirm_pending(self) -> None:
        """Confirm every hint that was answered before its Master lookup (``hint(confirm_later=True)``)."""
        if self._confirmer is not None:
            return  # its thread does
        for req in [r for r in self.requests.values() if r.confirmation is not None]:
            try:
                self._confirm(req)
            except Exception as exc:
                self._confirm_failed(req, exc)

    def _check_hint_locs(self, keys: list[bytes], locs) -> list[BlockLoc]:
        if locs is None:
            return []
        try:
            locs = [loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc) for loc in locs]
        except (TypeError, ValueError, msgspec.ValidationError) as exc:
            raise ChmError(errno.EINVAL, f"locs must be a list of block descriptors (BlockLoc): {exc}") from None
        if len(locs) > len(keys):
            raise ChmError(errno.EINVAL, f"locs has {len(locs)} descriptors for {len(keys)} keys")
        for i, loc in enumerate(locs):
            if loc.key != keys[i]:
                raise ChmError(errno.EINVAL, f"locs[{i}] describes key {loc.key.hex()}, not keys[{i}] "
                                             f"{keys[i].hex()}")
            if min(loc.node, loc.device, loc.offset, loc.length - 1, loc.checksum, loc.version) < 0:  # the rare case
                for field, low in (("node", 0), ("device", 0), ("offset", 0), ("length", 1), ("checksum", 0),
                                   ("version", 0)):
                    _check_int(f"locs[{i}].{field}", getattr(loc, field), low, (1 << 64) - 1)  # MessagePack's uint
        return locs

    def _speculate(self, req: _Request, locs: list[BlockLoc]) -> None:
        """Stage the hint's own descriptors of this node's blocks now, unconfirmed (see ``hint``)."""
        for loc in locs:
            if not self._here(loc) or loc.key in req.by_key:
                continue
            if loc.offset < 0 or loc.length <= 0 or loc.offset + loc.length > self.infos[loc.device].capacity_bytes:
                continue  # no place on that device: only the Master's answer counts
            self._append(req, loc, confirmed=False)
            self.counters["hint_locs_used"] += 1
        self._issue(req)

    def _here(self, loc: BlockLoc) -> bool:
        """The block is on one of this node's devices."""
        return loc.node == self.node and 0 <= loc.device < len(self.handles)

    def _append(self, req: _Request, loc: BlockLoc, confirmed: bool = True) -> None:
        """``loc``'s block is the request's next to stage."""
        if not req.blocks:  # the window in blocks follows the request's block size
            req.window = window_blocks(self.window_bytes, loc.length)
        block = _Block(loc, self.infos[loc.device].epoch, confirmed)
        req.blocks.append(block)
        req.by_key[loc.key] = block

    def _as_confirmed(self, req: _Request, confirmed: list[BlockLoc]) -> bool:
        """``req``'s blocks are exactly this node's part of the Master's answer, in its order, each confirmed."""
        local, seen = [], set()
        for loc in confirmed:
            if self._here(loc) and loc.key not in seen:
                seen.add(loc.key)
                local.append(loc)
        return all(block.confirmed for block in req.blocks) and [block.loc for block in req.blocks] == local

    def _restart(self, req: _Request, confirmed: list[BlockLoc]) -> None:
        """The Master did not confirm every descriptor the hint brought: release each staging of the request
        and stage from the Master's answer alone."""
        self.counters["hint_locs_unconfirmed"] += sum(not block.confirmed for block in req.blocks)
        for block in req.blocks:
            self._drop(req, block)
        req.blocks, req.by_key, req.next_issue, req.held = [], {}, 0, 0
        counted = self.counters["hint_hits"], self.counters["hint_other_node"]
        self._add_hits(req, confirmed)
        self.counters["hint_hits"], self.counters["hint_other_node"] = counted  # counted once, as they came
        self._issue(req)

    def _add_hits(self, req: _Request, found: list) -> None:
        for loc in found:
            loc = loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc)
            self.counters["hint_hits"] += 1
            if not self._here(loc):
                self.counters["hint_other_node"] += 1  # another node's Manager stages it (Lookup hints it too)
                continue
            known = req.by_key.get(loc.key)
            if known is not None:
                if not known.confirmed and known.loc == loc and known.epoch == self.infos[loc.device].epoch:
                    known.confirmed = True  # the hint's descriptor is the Master's: its staging stands
                continue  # (one the Master does not confirm stays unconfirmed: hint() starts over)
            self._append(req, loc)

    # ---- the window ----------------------------------------------------------------
    def _issue(self, req: _Request, busy: set | None = None) -> None:
        """Prefetch ``req``'s next blocks, in order, while its window has room and the device takes them."""
        busy = set() if busy is None else busy
        while req.next_issue < len(req.blocks) and req.held < req.window:
            block = req.blocks[req.next_issue]
            dev_index = block.loc.device
            if dev_index in busy:
                return  # EBUSY on this device in this pass: keep the order, try at the next progress
            try:
                block.handle = self._prefetch(block)
            except ChmError as exc:
                if exc.errno == errno.EBUSY:
                    busy.add(dev_index)
                    self.counters["ebusy"] += 1
                    self.device_counters[dev_index]["ebusy"] += 1
                    return
                if exc.errno == errno.EINVAL and self._never_fits(dev_index, block.loc):
                    # More than one prefetch there may ever hold: served unstaged (a plain DRAM-path read).
                    self.counters["unfit"] += 1
                    block.state, block.handle = STAGED, 0
                else:
                    block.state, block.error = FAILED, exc
                    self.counters["num_load_errors"] += 1
                req.next_issue += 1
                continue
            block.state = ISSUED
            req.next_issue += 1
            req.held += 1
            self.held_bytes[dev_index] += block.loc.length
            self.counters["prefetches"] += 1
            self.device_counters[dev_index]["prefetches"] += 1
            self.device_counters[dev_index]["prefetch_bytes"] += block.loc.length
        self.window_bytes_max = max(self.window_bytes_max, sum(self.held_bytes))
        self.handles_max = max(self.handles_max, sum(r.held for r in self.requests.values()))

    def _prefetch(self, block: _Block) -> int:
        """``block``'s prefetch; on ENODEV once more on a reopened handle (its device may be back already)."""
        i = block.loc.device
        for retry in (False, True):
            dev = self._handle(i)
            if block.epoch != self.infos[i].epoch:
                raise ChmError(errno.ESTALE, f"device {i} ({self.infos[i].node_path}) came back with epoch "
                                             f"{self.infos[i].epoch}, the block was stored under {block.epoch}: "
                                             "it is gone (the Master dropped it)")
            try:
                return dev.prefetch(block.loc.offset, block.loc.length)
            except ChmError as exc:
                self._device_error(i, exc)
                if exc.errno != errno.ENODEV or retry:
                    raise

    def _never_fits(self, i: int, loc: BlockLoc) -> bool:
        """Does ``loc`` span more pages than one prefetch on device ``i`` may ever hold (its window, or this
        handle's share of it)? Decided from the handle's numbers: served and in-process devices alike."""
        info = self.handles[i].info() if self.handles[i] is not None else {}
        page = info.get("page_size")
        if not page:
            return False  # a device that does not say: its EINVAL is a load error
        limit = info.get("prefetch_limit_pages") or -(-info.get("prefetch_window_bytes", 0) // page)
        return (loc.offset + loc.length - 1) // page - loc.offset // page + 1 > limit

    def progress(self) -> None:
        """Reopen gone devices; cancel requests past their timeout; move every window on (oldest request first)."""
        with self._lock:
            self._check_devices()
            self._confirm_pending()
            now = self.clock.now()
            for req in [r for r in self.requests.values() if now - r.touched > self.request_timeout_s]:
                self.log(f"request {req.request_id}: untouched for {now - req.touched:.3g} s, cancelled")
                self.counters["num_timeouts_recompute"] += 1
                self._cancel(req)
            busy: set[int] = set()
            for req in self.requests.values():
                self._issue(req, busy)
            self._changed.notify_all()

    # ---- blocks to workers ---------------------------------------------------------
    def _block(self, request_id: str, key: bytes, to_hand_out: bool = True) -> tuple[_Request, _Block]:
        req = self.requests.get(request_id)
        if req is None:
            raise ChmError(errno.ENOENT, f"request_id {request_id!r} has no hint here (never hinted, finished, "
                                         "timed out or its worker disconnected)")
        if to_hand_out and req.confirmation is not None:  # no block is handed out before the Master confirmed it here
            if self._confirmer is not None:
                raise _Unconfirmed(errno.ETIMEDOUT, f"request {request_id!r}: this Manager's Master lookup of its "
                                                    "hint is in flight")
            self._confirm(req)
        block = req.by_key.get(key)
        if block is None:
            raise ChmError(errno.ENOENT, f"key {key.hex()} is not a hit of request {request_id!r} on node "
                                         f"{self.node} (not stored here, or past the stored prefix)")
        self._touch(req)
        return req, block

    def _touch(self, req: _Request) -> None:
        req.touched = self.clock.now()
        if self._caller is not None:
            req.callers.add(self._caller)

    def acquire(self, request_id: str, key: bytes, timeout_s: float = 10.0, *, look: bool = False) -> ReadToken:
        """A read token once ``key``'s block is staged in device DRAM; ETIMEDOUT past ``timeout_s`` (the clock).

        ``look``: with ``timeout_s`` 0 a block whose SSD reads are in flight answers ETIMEDOUT at once (the served
        Manager looks, and holds the call); without it an issued block is waited for whatever ``timeout_s``.
        A libchm device is never waited on with the lock held: the acquire polls it (``chm_prefetch_poll``) and
        sleeps on the condition between looks, so other threads' calls, the served Manager's among them, go on
        meanwhile."""
        request_id, key = _check_request_id(request_id), _check_key(key)
        timeout_s = _check_seconds("timeout_s", timeout_s)
        with self._lock:
            deadline = self.clock.now() + timeout_s
            while True:
                try:
                    req, block = self._block(request_id, key)
                except _Unconfirmed:
                    if look or self.clock.now() >= deadline:
                        raise
                    self._changed.wait(WAIT_STEP_S)
                    continue
                if block.state == QUEUED:
                    self.progress()
                if block.state == ISSUED:
                    dev = self.handles[block.loc.device]  # ISSUED: its device has a handle
                    try:
                        if look or hasattr(dev, "poll"):  # a libchm device: never wait on it holding the lock
                            staged = dev.poll(block.handle)
                        else:  # the simulation's device (virtual time) answers at once
                            dev.wait(block.handle)
                            staged = True
                    except ChmError as exc:
                        if exc.errno == errno.ENODEV:
                            self._gone(block.loc.device, exc)  # fails this block and the rest staged there
                        else:
                            self._drop(req, block)
                            block.state, block.error = FAILED, exc
                            self.counters["num_load_errors"] += 1
                    else:
                        if staged:
                            block.state = STAGED
                if block.state == STAGED:
                    self.counters["num_hit_tokens"] += 1
                    self.counters["num_retrieve_requests"] += 1
                    loc = block.loc
                    return ReadToken(request_id, key, self.node, loc.device, loc.offset, loc.length, loc.checksum,
                                     block.handle)
                if block.state == FAILED:
                    raise ChmError(block.error.errno, f"block {key.hex()} of request {request_id!r}: "
                                                      f"{block.error.message}")
                if block.state == RELEASED:
                    raise ChmError(errno.ENOENT, f"block {key.hex()} of request {request_id!r} was released")
                # QUEUED: behind this request's window or the device's (EBUSY). Others' releases move it.
                # ISSUED: its SSD reads are in flight; look again soon (the lock is free meanwhile). As a wait on
                # the device would, an in-process acquire waits for them whatever its timeout (which bounds
                # the queueing); a look does not.
                if self.clock.now() >= deadline and (look or block.state != ISSUED):
                    if block.state == ISSUED:
                        why = "staging: its SSD reads are in flight"
                    elif req.held >= req.window:
                        why = f"queued: its window of {req.window} blocks is held: release earlier blocks"
                    else:
                        why = "queued: the device's prefetch window is busy (EBUSY)"
                    raise ChmError(errno.ETIMEDOUT, f"block {key.hex()} of request {request_id!r} not staged "
                                                    f"within {timeout_s:g} s ({why})")
                self._changed.wait(LOOK_STEP_S if block.state == ISSUED else WAIT_STEP_S)

    def read(self, request_id: str, key: bytes, timeout_s: float = 10.0, *, look: bool = False,
             need_lease: bool = False) -> Payload:
        """The remote path: the token's fields and the block's bytes as one zero-copy frame. ``need_lease`` (the
        served read): only to a request holding the Master's lease on the block (``lease``), else EACCES."""
        with self._lock:
            token = self.acquire(request_id, key, timeout_s, look=look)
            if need_lease:
                self._check_lease(request_id, key)
            data = bytearray(token.length)  # a fresh buffer per block: ZeroMQ sends it after we return
            try:
                self._handle(token.device).read_into(token.offset, data)
            except ChmError as exc:
                self._device_error(token.device, exc)
                raise
            self.counters["remote_reads"] += 1
            self.counters["remote_read_bytes"] += token.length
            self.device_counters[token.device]["read_bytes"] += token.length
            return Payload(token, [data])

    def write(self, device: int, offset: int, payload: list | None = None) -> int:
        """The remote write path: one frame's bytes at ``offset`` of ``device`` (from a WriteLoc).
        EAGAIN (write buffer full) and ENOSPC pass through: the worker skips the block."""
        with self._lock:
            device = _check_int("device", device, 0, len(self.handles) - 1)
            offset = _check_int("offset", offset, 0, (1 << 64) - 1)  # past the device's end: its ERANGE
            if not payload or len(payload) != 1:
                raise ChmError(errno.EINVAL, f"payload must be exactly one frame (the block), got "
                                             f"{len(payload or ())}")
            data = payload[0]
            try:
                n = self._handle(device).write(offset, data)
            except ChmError as exc:
                self._device_error(device, exc)
                if exc.errno in (errno.EAGAIN, errno.ENOSPC):
                    self.counters["write_refused"] += 1
                    self.device_counters[device]["write_refused"] += 1
                raise
            self.counters["remote_writes"] += 1
            self.counters["remote_write_bytes"] += n
            self.device_counters[device]["written_bytes"] += n
            return n

    def release(self, request_id: str, key: bytes) -> bool:
        """Give a token back: its handle is released and the window moves on. False if already gone."""
        request_id, key = _check_request_id(request_id), _check_key(key)
        with self._lock:
            if request_id not in self.requests:
                return False  # finished or cancelled already: its handles went with it
            req, block = self._block(request_id, key, to_hand_out=False)
            if block.state in (RELEASED, FAILED) or (block.state == STAGED and block.handle == 0):
                block.state = RELEASED if block.state != FAILED else FAILED
                return False
            if block.state == QUEUED:
                raise ChmError(errno.EINVAL, f"key {key.hex()} of request {request_id!r} was never acquired "
                                             "(still queued)")
            self._drop(req, block)
            self.progress()
            return True

    def release_later(self, request_id: str, key: bytes) -> None:
        """``release`` for a caller that does not need its outcome (over ZeroMQ nobody waits for the answer)."""
        self.release(request_id, key)

    def _drop(self, req: _Request, block: _Block) -> None:
        """Release ``block``'s device handle (the device may be gone: the handle went with it)."""
        if block.state in (ISSUED, STAGED) and block.handle:
            handle, block.state = block.handle, RELEASED  # first: _gone below must not count it again
            req.held -= 1
            self.held_bytes[block.loc.device] -= block.loc.length
            self.counters["releases"] += 1
            try:
                if self._attached(block.loc.device):  # else the handle went with the device
                    self.handles[block.loc.device].release(handle)
            except ChmError as exc:
                self.log(f"release of handle {handle} on device {block.loc.device}: {exc}")
                self._device_error(block.loc.device, exc)
        block.state = RELEASED

    def _cancel(self, req: _Request) -> int:
        held = req.held
        for block in req.blocks:
            if block.state in (ISSUED, STAGED):
                self._drop(req, block)
        self.requests.pop(req.request_id, None)
        self._changed.notify_all()
        return held

    def finish(self, request_id: str) -> int:
        """The request is done: cancel what is left of it; how many handles that released."""
        request_id = _check_request_id(request_id)
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return 0
            self.counters["finished"] += 1
            released = self._cancel(req)
            self.progress()
            return released

    def finish_later(self, request_id: str) -> None:
        """``finish`` for a caller that does not need its outcome."""
        self.finish(request_id)

    def touch(self, request_ids: list[str]) -> int:
        """Keep requests alive (a worker busy between acquires); how many were still here."""
        if not isinstance(request_ids, (list, tuple)):
            raise ChmError(errno.EINVAL, f"request_ids must be a list of request ids, not {type(request_ids).__name__}")
        with self._lock:
            alive = 0
            for rid in request_ids:
                req = self.requests.get(_check_request_id(rid))
                if req is not None:
                    self._touch(req)
                    alive += 1
            return alive

    def caller_gone(self, caller) -> int:
        """A connection closed: cancel the requests no other live connection has used; how many."""
        with self._lock:
            gone = []
            for req in self.requests.values():
                if caller in req.callers:
                    req.callers.discard(caller)
                    if not req.callers:
                        gone.append(req)
            for req in gone:
                self.log(f"request {req.request_id}: its worker disconnected, cancelled")
                self.counters["cancelled_disconnect"] += 1
                self._cancel(req)
            if gone:
                self.progress()
            return len(gone)

    # ---- figures -------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        """This node's devices, as registered with the Master."""
        return list(self.infos)

    def stats(self) -> dict:
        with self._lock:
            per_device = []
            for info, counters, held in zip(self.infos, self.device_counters, self.held_bytes):
                per_device.append({"node": self.node, "device": info.device, "node_path": info.node_path,
                                   "capacity_bytes": info.capacity_bytes, "staged_bytes": held,
                                   "attached": int(self._attached(info.device)), **counters})
            return {**self.counters, "node": self.node, "requests": len(self.requests),
                    "prefetch_window_bytes": sum(self.held_bytes), "prefetch_window_bytes_max": self.window_bytes_max,
                    "handles_held": sum(r.held for r in self.requests.values()), "handles_held_max": self.handles_max,
                    "queued_blocks": sum(len(r.blocks) - r.next_issue for r in self.requests.values()),
                    "window_bytes": self.window_bytes, "held_calls": self.held_calls, "devices": per_device}

    def close(self) -> None:
        confirmer, self._confirmer = self._confirmer, None
        if confirmer is not None:
            confirmer.close()  # outside the lock: its thread takes it
        with self._lock:
            for req in list(self.requests.values()):
                self._cancel(req)
            for dev in self.handles:
                if dev is not None:
                    dev.close()
            self.handles = []

    def __enter__(self) -> "KVManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Unconfirmed(ChmError):
    """A block asked for before this Manager's Master lookup of its request's hint has answered."""


class _Confirmer:
    """The Manager's Master lookups of hints it answered first (``KVManager.confirm_in_background``), on a thread
    with a socket of its own: every request's lookup is in flight at once, and each one that gets no answer
    within ``timeout_s`` fails alone (its request is cancelled), so a Master that hangs or dies holds up
    neither the Manager's calls nor the other requests' confirmations."""

    def __init__(self, manager: KVManager, endpoint: str, timeout_s: float, curve_keys: str | None):
        self.manager, self.endpoint, self.timeout_s, self.curve_keys = manager, endpoint, timeout_s, curve_keys
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hymcache-confirm", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """There is work: a request to confirm (called under the Manager's lock)."""
        os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        self._stopping = True
        self.kick()
        self._thread.join(timeout=30)
        os.close(self._wake)

    def _run(self) -> None:
        client = RpcClient(self.endpoint, self.timeout_s, curve_keys=self.curve_keys)
        poller = zmq.Poller()
        poller.register(client.sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        calls: dict[bytes, tuple[_Request, float]] = {}  # call id -> (its request, when it fails: monotonic s)
        try:
            while not self._stopping:
                try:
                    self._step(client, poller, calls)
                except Exception as exc:  # never let one bad answer end the thread (every hint would then hang)
                    self.manager.log(f"confirmer: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    def _step(self, client: RpcClient, poller, calls: dict) -> None:
        """Send the new requests' lookups, wait for an answer, the next request or the first deadline; apply."""
        self._send_next(client, calls, self._take_new())
        due = min((d for _, d in calls.values()), default=None)
        events = dict(poller.poll(None if due is None else max(0.0, 1000 * (due - time.monotonic())) + 1))
        if self._wake in events:
            try:
                os.eventfd_read(self._wake)
            except BlockingIOError:
                pass
        while (got := client.answer()) is not None:
            call_id, err, result, message = got
            entry = calls.pop(call_id, None)
            if entry is not None:  # else the answer came after its call had failed
                self._send_next(client, calls, self._answered(entry[0], err, result, message))
        now = time.monotonic()
        for call_id in [c for c, (_, due) in calls.items() if due <= now]:
            req, _ = calls.pop(call_id)
            self._failed(req, RpcTimeout(f"lookup to {self.endpoint}: no answer within {self.timeout_s:g} s"))

    def _take_new(self) -> list[tuple[_Request, list[bytes]]]:
        """Requests whose confirmation has not been asked for: (request, first batch) of each."""
        mgr = self.manager
        with mgr._lock:
            out = []
            for req in mgr.requests.values():
                state = req.confirmation
                if state is not None and not state.asked:
                    state.asked = True
                    out.append((req, mgr._next_batch(state)))
            return out

    def _send_next(self, client: RpcClient, calls: dict, work: list[tuple[_Request, list[bytes]]]) -> None:
        for req, batch in work:
            try:
                calls[client.send("lookup", batch)] = (req, time.monotonic() + self.timeout_s)
            except ChmError as exc:
                self._failed(req, exc)

    def _answered(self, req: _Request, err: int, result, message: str) -> list[tuple[_Request, list[bytes]]]:
        """Apply one lookup's answer; the request's next batch to ask for, if any."""
        mgr = self.manager
        with mgr._lock:
            state = req.confirmation
            if mgr.requests.get(req.request_id) is not req or state is None:
                return []  # finished, timed out or cancelled meanwhile
            try:
                if err:
                    raise RemoteError(err, f"lookup at {self.endpoint}: {message}")
                if not mgr._confirmed_batch(req, state, result):
                    return [(req, mgr._next_batch(state))]
            except Exception as exc:
                mgr._confirm_failed(req, exc)
            return []

    def _failed(self, req: _Request, exc: Exception) -> None:
        mgr = self.manager
        with mgr._lock:
            if mgr.requests.get(req.request_id) is req and req.confirmation is not None:
                mgr._confirm_failed(req, exc)


# ---- served over ZeroMQ ---------------------------------------------------------------
class _Served:
    """What the server exposes: the Manager's methods, with the caller's identity set around each call."""

    def __init__(self, manager: KVManager):
        self.manager = manager

    def __getattr__(self, name):
        # A block not staged yet answers ETIMEDOUT at once, without waiting for the device: the server holds
        # the call (``hold_s``, see ManagerServer) and asks again, and the client asks again after that.
        if name == "acquire":
            return lambda request_id, key, hold_s=0.0: self.manager.acquire(request_id, key, 0.0, look=True)
        if name == "read":  # bytes leave the node: only to a request holding the Master's lease
            return lambda request_id, key, hold_s=0.0: self.manager.read(request_id, key, 0.0, look=True,
                                                                         need_lease=True)
        if name == "hint":  # answered once staging starts: the Lookup does not wait for our Master round trip
            return lambda request_id, keys, locs=None: self.manager.hint(request_id, keys, locs, confirm_later=True)
        return getattr(self.manager, name)


HOLD_MAX_S = 1.0        # longest the server holds an acquire or read whose block is not staged yet
MAX_HELD = 64           # calls held at once (a few per worker); past it a call answers ETIMEDOUT at once and its
                        # client asks again, so one pass over the held calls stays short


def _hold_of(frames: list) -> tuple[float, tuple]:
    """How long the caller lets the server hold this call (acquire/read: their third argument), in [0, HOLD_MAX_S];
    and what it asks for (method, request id, key: held calls asking the same look at the device once a pass)."""
    try:
        method, args = call_of(frames)
        hold = args[2] if method in ("acquire", "read") and len(args) > 2 else 0.0
        hold = min(float(hold), HOLD_MAX_S) if isinstance(hold, (int, float)) and hold > 0 else 0.0
        return hold, (method, *args[:2])
    except Exception:  # malformed: answered (EINVAL) as any call
        return 0.0, ()


class ManagerServer(RpcServer):
    """An RpcServer that also notices callers whose connection closed (see the module docstring), and holds an
    acquire or read whose block is still staging: it looks at the device again every LOOK_STEP_S and answers
    once the block is staged, or ETIMEDOUT when the caller's ``hold_s`` has passed. Nothing waits on the device,
    so one request's staging never holds up the others' calls."""

    def __init__(self, manager: KVManager, endpoint: str, *, curve_keys: str | None = None, tick_s: float = 0.02,
                 log: Callable[[str], None] | None = None, insecure: bool = False):
        super().__init__(_Served(manager), MANAGER_METHODS, endpoint, tick=manager.progress, tick_s=tick_s,
                         curve_keys=curve_keys, log=log, max_frame_bytes=MAX_BLOCK_BYTES,  # blocks travel here
                         roles=MANAGER_ROLES, insecure=insecure)
        self.manager = manager
        self.held: list[tuple[list, float, tuple]] = []  # (frames, when to answer ETIMEDOUT, what it asks), oldest first
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.callers_by_fd: dict[int, set[bytes]] = {}
        if not manager.endpoint:  # registered in process so far: now workers can reach it here
            manager.register(self.endpoint)

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self._stop.is_set():
                if self.held:  # no sub-millisecond poll timeout in ZeroMQ: a short sleep between looks
                    time.sleep(LOOK_STEP_S)
                if poller.poll(0 if self.held else int(self.tick_s * 1000)):
                    self._disconnects()
                    for _ in range(ANSWERS_PER_PASS):  # then the held calls' turn, however many more are queued
                        if not self.sock.poll(0):
                            break
                        # Before each message, not once a pass: a connection closed during the pass may have
                        # its fd reused by one whose message is next; its DISCONNECTED event, queued before that
                        # message, must not then cancel the new caller's requests.
                        self._disconnects()
                        frames = self.sock.recv_multipart(copy=False)
                        if len(frames) >= 3:
                            caller = frames[0].bytes
                            self.manager._caller = caller
                            try:
                                fd = frames[1].get(zmq.SRCFD)
                            except zmq.ZMQError:  # a libzmq without it: the request timeout still cancels
                                fd = None
                            if fd is not None:
                                self.callers_by_fd.setdefault(fd, set()).add(caller)
                        try:
                            self._answer(frames)
                        finally:
                            self.manager._caller = None
                if self.held:
                    self._answer_held()
                if self.tick is not None and time.monotonic() >= next_tick:
                    self.tick()
                    next_tick = time.monotonic() + (self.tick_s if self.held else 0.0)
        finally:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)

    def _answer(self, frames: list) -> None:
        if len(frames) < 2:
            return  # no call id to answer to
        reply, result_frames, err = self._run(frames)
        hold, call = _hold_of(frames) if err == errno.ETIMEDOUT and len(self.held) < MAX_HELD else (0.0, ())
        if hold:
            self.held.append((frames, time.monotonic() + hold, call))
            self.manager.held_calls = len(self.held)
        else:
            self._send(frames, reply, result_frames)

    def _answer_held(self) -> None:
        """Ask again for every held call; answer those staged, failed or past their hold. Calls for the same block
        of the same request look at the device once per pass."""
        still, not_yet = [], set()
        for frames, until, call in self.held:
            if call in not_yet and time.monotonic() < until:
                still.append((frames, until, call))
                continue
            self.manager._caller = frames[0].bytes
            try:
                reply, result_frames, err = self._run(frames)
            finally:
                self.manager._caller = None
            if err == errno.ETIMEDOUT and time.monotonic() < until:
                still.append((frames, until, call))
                not_yet.add(call)
            else:
                self._send(frames, reply, result_frames)
        self.held = still
        self.manager.held_calls = len(still)

    def _disconnects(self) -> None:
        while self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for caller in self.callers_by_fd.pop(int(event["value"]), ()):
                    self.manager.caller_gone(caller)


def serve_manager(manager: KVManager, endpoint: str, curve_keys: str | None = None, **kwargs) -> ManagerServer:
    """A server for ``manager`` bound to ``endpoint`` (registered with the Master under the bound address
    unless the Manager was given one to advertise);
    run ``serve_forever()`` in a thread or as the main loop, ``stop()`` to end it."""
    return ManagerServer(manager, endpoint, curve_keys=curve_keys, **kwargs)


FIRST_POLL_S = 50e-6  # ManagerClient's first pause before asking again for a block not staged yet


class ManagerClient(TypedClient):
    """A KV Manager over ZeroMQ, the same methods (one thread at a time, like RpcClient).

    ``acquire``/``read`` poll the server (which never blocks on them) until ``timeout_s`` passes on ``clock``."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, *, curve_keys: str | None = None,
                 clock: Clock | None = None, poll_s: float = 0.001):
        self.rpc = RpcClient(endpoint, timeout_s, curve_keys=curve_keys, max_frame_bytes=MAX_BLOCK_BYTES)
        self.endpoint, self.clock = endpoint, clock or WallClock()
        self.poll_s = _check_seconds("poll_s", poll_s, allow_zero=False)

    def hint(self, request_id: str, keys: list[bytes], locs: list[BlockLoc] | None = None) -> int:
        return self.rpc.call("hint", request_id, list(keys), None if locs is None else list(locs))

    def _poll(self, method: str, request_id: str, key: bytes, timeout_s: float):
        timeout_s = _check_seconds("timeout_s", timeout_s)
        deadline = self.clock.now() + timeout_s
        pause = min(FIRST_POLL_S, self.poll_s)  # a block staged soon is asked for again soon
        while True:
            # the server holds the call until the block is staged, for at most hold_s (well inside our RPC timeout)
            hold_s = min(max(deadline - self.clock.now(), 0.0), self.rpc.timeout_s / 2)
            try:
                return self.rpc.call(method, request_id, key, hold_s, frames=True)
            except RemoteError as exc:
                if exc.errno != errno.ETIMEDOUT or self.clock.now() >= deadline:
                    raise
            if hold_s <= 0:
                time.sleep(pause)
                pause = min(2 * pause, self.poll_s)

    def acquire(self, request_id: str, key: bytes, timeout_s: float = 10.0) -> ReadToken:
        result, _ = self._poll("acquire", request_id, key, timeout_s)
        return to(ReadToken, result)

    def read(self, request_id: str, key: bytes, timeout_s: float = 10.0) -> tuple[ReadToken, memoryview]:
        """The token and the block's bytes (a view of the received frame: no copy)."""
        result, frames = self._poll("read", request_id, key, timeout_s)
        return to(ReadToken, result), frames[0]

    def write(self, device: int, offset: int, data) -> int:
        return self.rpc.call("write", device, offset, payload=[data])

    def lease(self, request_id: str, locs: list[BlockLoc]) -> int:
        return self.rpc.call("lease", request_id, list(locs))

    def release(self, request_id: str, key: bytes) -> bool:
        return self.rpc.call("release", request_id, key)

    def finish(self, request_id: str) -> int:
        return self.rpc.call("finish", request_id)

    def release_later(self, request_id: str, key: bytes) -> None:
        """Sent without waiting for the answer: the load goes on while the Manager releases."""
        self.rpc.post("release", request_id, key)

    def finish_later(self, request_id: str) -> None:
        self.rpc.post("finish", request_id)

    def touch(self, request_ids: list[str]) -> int:
        return self.rpc.call("touch", list(request_ids))

    def progress(self) -> None:
        self.rpc.call("progress")

    def stats(self) -> dict:
        return self.rpc.call("stats")

    def devices(self) -> list[DeviceInfo]:
        return to(list[DeviceInfo], self.rpc.call("devices"))



def run_manager(node: int, device_nodes: list[str], master_endpoint: str, endpoint: str = "tcp://127.0.0.1:0", *,
                window_bytes: int = WINDOW_BYTES, request_timeout_s: float = REQUEST_TIMEOUT_S,
                curve_keys: str | None = None, master_timeout_s: float = 10.0,
                on_ready: Callable[[str], None] | None = None, stop: threading.Event | None = None,
                log: Callable[[str], None] | None = None, key: str | None = None, insecure: bool = False) -> int:
    """`chm hymcache manager`: serve node ``node``'s devices until SIGINT/SIGTERM (or ``stop``); 0 when stopped.

    ``on_ready(endpoint)`` is called once the Manager is registered and bound (the CLI prints it). With
    ``curve_keys`` (a key directory) it calls the Master with key ``key`` (default ``node-NODE``)."""
    from host_runtime.hymcache.master import MasterClient  # the Master's module: imported when a Manager runs

    server_keys, curve_keys = curve_keys, auth.key_file(curve_keys, key or f"node-{node}")
    master = MasterClient(master_endpoint, timeout_s=master_timeout_s, curve_keys=curve_keys)
    manager = KVManager(node, device_nodes, master, WallClock(), window_bytes=window_bytes,
                        request_timeout_s=request_timeout_s, endpoint="", log=log)
    try:
        manager.confirm_in_background(master_endpoint, master_timeout_s, curve_keys)
        server = serve_manager(manager, endpoint, server_keys, log=log, insecure=insecure)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: server.stop())
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), server.stop()), daemon=True).start()
        if on_ready is not None:
            on_ready(server.endpoint)
        server.serve_forever()
    finally:
        manager.close()
        master.close()
    return 0


# ---- the per-block cost of the two read paths (bench_hymcache calls this) ------------------
def measure_block_paths(master, device_node: str, *, block_bytes: int = 16 << 20, repeat: int = 8,
                        manager_endpoint: str | None = None) -> dict:
    """Seconds per block (medians of ``repeat``, the contenders interleaved) for one stored block of
    ``block_bytes``, on the device's machine:

    * ``stage_s``: hint → acquire: the Manager prefetches the block from flash into device DRAM
      (the same for both paths);
    * ``local_s``: a worker on the device's machine reads the staged block with libchm ``read_into``
      its zero-copy staging buffer; ``local_checked_s`` adds the xxh3 checksum;
    * ``zmq_s``: a worker elsewhere gets it through the Manager over ZeroMQ (``read``: one call, the
      block a zero-copy frame); ``zmq_checked_s`` adds the checksum;
    * ``local_total_s`` / ``zmq_total_s``: the whole per-block cycle, hint → acquire → read (checked)
      → release → finish.

    ``master``: a Master in process (or a MasterClient). With ``manager_endpoint`` None a KVManager is
    served from a thread of this process on ``device_node``; else that running Manager is used. The
    block is stored through the Master first (put_start → libchm write → flush → put_end).
    """
    import xxhash

    block_bytes = _check_int("block_bytes", block_bytes, 1, 1 << 30)
    repeat = _check_int("repeat", repeat, 1, 1000)
    key = os.urandom(KEY_BYTES)
    data = os.urandom(block_bytes)
    manager = server = thread = None
    if manager_endpoint is None:
        manager = KVManager(0, [device_node], master, WallClock())
        server = serve_manager(manager, "tcp://127.0.0.1:0")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        manager_endpoint = server.endpoint
    times: dict[str, list[float]] = {name: [] for name in (
        "stage_s", "local_s", "local_checked_s", "zmq_s", "zmq_checked_s", "local_total_s", "zmq_total_s")}
    try:
        loc, = master.put_start(f"bench-put-{key.hex()}", [key], [block_bytes])
        with libchm.Device(node_path(device_node), staging_bytes=max(block_bytes, 1 << 20)) as dev, \
                ManagerClient(manager_endpoint) as client:
            dev.write(loc.offset, data)
            dev.flush()  # on the media, as a block of an earlier turn
            master.put_end([key], [xxhash.xxh3_64_intdigest(data)])
            view = dev.buffer()[:block_bytes]
            for i in range(repeat):
                for path in ("local", "zmq"):
                    rid = f"bench-{key.hex()}-{i}-{path}"
                    leased = master.lookup([key], request_id=rid) if path == "zmq" else []  # as a worker's Lookup
                    t0 = time.perf_counter()
                    client.hint(rid, [key])
                    token = client.acquire(rid, key)
                    t1 = time.perf_counter()
                    if leased:
                        client.lease(rid, leased)  # the bytes over ZeroMQ need the Master's lease
                    for checked in (False, True):
                        t2 = time.perf_counter()
                        if path == "local":
                            dev.read_into(token.offset, view)
                            block = view
                        else:
                            token, block = client.read(rid, key)
                        if checked and xxhash.xxh3_64_intdigest(block) != token.checksum:
                            raise ChmError(errno.EIO, f"{path} read of block {key.hex()}: checksum mismatch")
                        times[f"{path}_checked_s" if checked else f"{path}_s"].append(time.perf_counter() - t2)
                    client.release(rid, key)
                    client.finish(rid)
                    t3 = time.perf_counter()
                    times["stage_s"].append(t1 - t0)
                    # the cycle once: staging, one checked read, release (the unchecked read left out)
                    times[f"{path}_total_s"].append(t3 - t0 - times[f"{path}_s"][-1])
            del view, block
        master.remove([key])
    finally:
        if server is not None:
            server.stop()
            thread.join(timeout=10)
            manager.close()
    out: dict = {name: statistics.median(v) for name, v in times.items()}
    out.update({name[:-2] + "_gbps": block_bytes / out[name] / 1e9 for name in times})
    out["block_bytes"], out["repeat"] = block_bytes, repeat
    return out
