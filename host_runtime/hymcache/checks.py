"""The Master's argument checks, settings and limits, for ``Master`` (master.py, which re-exports them) and
``NativeMaster`` (native_master.py) alike: the common family (``common.checks``, EINVAL in its one wording:
field, value, allowed range), in a module without master.py's server side (ZeroMQ, keys, RPC), so the replay's
NativeMaster starts without importing it."""

from __future__ import annotations

import errno
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

from common.checks import Checks
from driver.errors import ChmError

from .messages import KEY_BYTES, MAX_REQUEST_ID, DeviceInfo

MAX_NODE = (1 << 16) - 1
MAX_DEVICE = (1 << 8) - 1
MAX_LENGTH = (1 << 32) - 1
MAX_BATCH = 1 << 16                 # keys per call: bounds one call's work and message
MAX_TIMEOUT_S = 86_400.0            # leases and put timeouts: far below the u4 ms range
MAX_ENDPOINT = 1024                 # characters of a node's endpoint
Placement = Literal["round_robin", "load_aware"]  # node chosen per put_start: in turn, or the least used
PLACEMENTS = get_args(Placement)

check = Checks(lambda message: ChmError(errno.EINVAL, message))

Seconds = Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)]
Fraction = Annotated[float, Meta(gt=0.0, le=1.0)]


class MasterSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a Master decides (Master's and NativeMaster's keyword options), each with its range."""

    lease_s: Seconds = 10.0              # read lease granted by a lookup
    lease_max_s: Seconds = 30.0          # a lease is never renewed past this long after its first grant
    put_timeout_s: Seconds = 30.0        # a put_start without put_end is revoked after this long
    high_watermark: Fraction = 0.90      # evict when a device's used fraction passes this ...
    low_watermark: Fraction = 0.85       # ... down to this
    placement: Placement = "round_robin"
    snapshot_every: Annotated[int, Meta(ge=1, le=1 << 40)] = 100_000  # records between snapshots

    def __post_init__(self) -> None:
        if self.lease_max_s < self.lease_s:
            raise check.fail("lease_max_s", _as_given(self.lease_max_s), f"a number >= lease_s {self.lease_s:g}")
        if self.low_watermark > self.high_watermark:
            raise check.fail("low_watermark", _as_given(self.low_watermark),
                             f"a number <= high_watermark {self.high_watermark:g}")


def _as_given(value: float) -> float | int:
    """A converted option as its caller likely wrote it (10, not 10.0) for an error to quote."""
    return int(value) if value.is_integer() else value


SETTINGS = tuple(MasterSettings.__struct_fields__)


def set_options(master, **options) -> None:
    """Master's keyword options (``SETTINGS``), checked (EINVAL naming the option), as ``master``'s attributes;
    NativeMaster's too."""
    settings = check.convert(options, MasterSettings)
    for name in SETTINGS:
        setattr(master, name, getattr(settings, name))


# ---------------------------------------------------------------- per call

def _check_list(values, field: str) -> list:
    return check.items(field, values, 0, MAX_BATCH)


def _check_versions(versions, n: int) -> list:
    """put_end / put_revoke's optional ``versions``: one per key (WriteLoc.version), or None for all."""
    if versions is None:
        return [None] * n
    versions = _check_per_key(versions, "versions", n)
    return [check.int(f"versions[{i}]", v, 0, (1 << 32) - 1) for i, v in enumerate(versions)]


def _check_per_key(values, field: str, n: int) -> list:
    """One item per key: ``sizes``, ``checksums``, ``versions``."""
    values = _check_list(values, field)
    if len(values) != n:
        raise check.error(f"{field} has {len(values)} items for {n} keys")
    return values


def _check_keys(keys, field: str = "keys") -> list[bytes]:
    keys = _check_list(keys, field)
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:  # the common case, in C loops
        return keys
    return [check.blob(f"{field}[{i}]", key, KEY_BYTES) for i, key in enumerate(keys)]


def _check_request_id(request_id, optional: bool = False) -> str | None:
    """A request's id: a str of 1 to MAX_REQUEST_ID characters (``optional``: or None)."""
    if optional and request_id is None:
        return None
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_REQUEST_ID:
        raise check.fail("request_id", request_id, f"{'none or ' if optional else ''}a str of 1 to {MAX_REQUEST_ID} "
                                                    "characters")
    return request_id


def check_registration(node, endpoint, devices) -> tuple[int, list[DeviceInfo]]:
    """``register_node``'s arguments checked (EINVAL naming the field): the node and its devices as DeviceInfo."""
    node = check.int("node", node, 0, MAX_NODE)
    check.text("endpoint", endpoint, 0, MAX_ENDPOINT)
    devices = check.convert(check.items("devices", devices, 1, MAX_BATCH), list[DeviceInfo], "devices")
    seen = set()
    for i, d in enumerate(devices):
        check.int(f"devices[{i}].device", d.device, 0, MAX_DEVICE)
        check.int(f"devices[{i}].capacity_bytes", d.capacity_bytes, 1, (1 << 63) - 1)
        check.int(f"devices[{i}].epoch", d.epoch, 0, (1 << 64) - 1)
        if d.device in seen:
            raise check.error(f"devices[{i}].device {d.device} appears twice")
        seen.add(d.device)
    return node, devices
