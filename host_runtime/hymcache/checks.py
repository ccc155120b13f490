"""The Master's argument checks and limits (EINVAL naming the field), for ``Master`` (master.py, which
re-exports them) and ``NativeMaster`` (native_master.py) alike: a module without master.py's server side
(ZeroMQ, keys, RPC), so the replay's NativeMaster starts without importing it."""

from __future__ import annotations

import errno
import reprlib

import msgspec
import numpy as np

from driver.errors import ChmError

from .messages import KEY_BYTES, DeviceInfo, to

MAX_NODE = (1 << 16) - 1
MAX_DEVICE = (1 << 8) - 1
MAX_LENGTH = (1 << 32) - 1
MAX_BATCH = 1 << 16                 # keys per call: bounds one call's work and message
MAX_TIMEOUT_S = 86_400.0            # leases and put timeouts: far below the u4 ms range
PLACEMENTS = ("round_robin", "load_aware")


# ---------------------------------------------------------------- validation

def _check_int(value, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ChmError(errno.EINVAL, f"{field} {value!r} must be an int in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ChmError(errno.EINVAL, f"{field} {value} out of range [{lo}, {hi}]")
    return int(value)


def _check_list(values, field: str) -> list:
    if not isinstance(values, (list, tuple)):
        raise ChmError(errno.EINVAL, f"{field} must be a list of at most {MAX_BATCH} items, got "
                                     f"{type(values).__name__} {reprlib.repr(values)}")
    if len(values) > MAX_BATCH:
        raise ChmError(errno.EINVAL, f"{field}: {len(values)} items; at most {MAX_BATCH} per call")
    return list(values)


def _check_versions(versions, n: int) -> list:
    """put_end / put_revoke's optional ``versions``: one per key (WriteLoc.version), or None for all."""
    if versions is None:
        return [None] * n
    versions = _check_list(versions, "versions")
    if len(versions) != n:
        raise ChmError(errno.EINVAL, f"versions has {len(versions)} items for {n} keys")
    return [_check_int(v, f"versions[{i}]", 0, (1 << 32) - 1) for i, v in enumerate(versions)]


def _check_keys(keys, field: str = "keys") -> list[bytes]:
    keys = _check_list(keys, field)
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:  # the common case, in C loops
        return keys
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            if not isinstance(key, (bytearray, memoryview)):
                raise ChmError(errno.EINVAL, f"{field}[{i}] must be {KEY_BYTES} bytes, got {type(key).__name__}")
            keys[i] = key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ChmError(errno.EINVAL, f"{field}[{i}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")
    return keys


def _check_seconds(value, field: str, lo_exclusive: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo_exclusive < value <= MAX_TIMEOUT_S:
        raise ChmError(errno.EINVAL, f"{field} {value!r} must be a number in ({lo_exclusive}, {MAX_TIMEOUT_S}]")
    return float(value)


def set_options(master, lease_s, lease_max_s, put_timeout_s, high_watermark, low_watermark, placement,
                snapshot_every) -> None:
    """Master's keyword options, checked (EINVAL naming the option), as ``master``'s attributes; NativeMaster's too."""
    master.lease_s = _check_seconds(lease_s, "lease_s")
    master.lease_max_s = _check_seconds(lease_max_s, "lease_max_s")
    if master.lease_max_s < master.lease_s:
        raise ChmError(errno.EINVAL, f"lease_max_s {lease_max_s} must be >= lease_s {lease_s}")
    master.put_timeout_s = _check_seconds(put_timeout_s, "put_timeout_s")
    for name, value in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ChmError(errno.EINVAL, f"{name} {value!r} must be in (0, 1]")
    if not low_watermark <= high_watermark:
        raise ChmError(errno.EINVAL, f"low_watermark {low_watermark} must be <= high_watermark {high_watermark}")
    if placement not in PLACEMENTS:
        raise ChmError(errno.EINVAL, f"placement {placement!r} must be one of {', '.join(PLACEMENTS)}")
    master.snapshot_every = _check_int(snapshot_every, "snapshot_every", 1, 1 << 40)
    master.high_watermark, master.low_watermark = float(high_watermark), float(low_watermark)
    master.placement = placement


def check_registration(node, endpoint, devices) -> tuple[int, list[DeviceInfo]]:
    """``register_node``'s arguments checked (EINVAL naming the field): the node and its devices as DeviceInfo."""
    node = _check_int(node, "node", 0, MAX_NODE)
    if not isinstance(endpoint, str) or len(endpoint) > 1024:
        raise ChmError(errno.EINVAL, f"endpoint {endpoint!r} must be a string of at most 1024 characters")
    devices = _check_list(devices, "devices")
    try:
        devices = to(list[DeviceInfo], devices)
    except msgspec.ValidationError as exc:
        raise ChmError(errno.EINVAL, f"devices: {exc}") from None
    if not devices:
        raise ChmError(errno.EINVAL, f"node {node}: devices is empty; a node needs at least one device")
    seen = set()
    for i, d in enumerate(devices):
        _check_int(d.device, f"devices[{i}].device", 0, MAX_DEVICE)
        _check_int(d.capacity_bytes, f"devices[{i}].capacity_bytes", 1, (1 << 63) - 1)
        _check_int(d.epoch, f"devices[{i}].epoch", 0, (1 << 64) - 1)
        if d.device in seen:
            raise ChmError(errno.EINVAL, f"devices[{i}].device {d.device} appears twice")
        seen.add(d.device)
    return node, devices
