"""The wire, as Python sees it: the cffi module built from ``chm_wire.h``,
plus where a node name lives on disk.

Everything about the layout comes from the header through ``ffi``/``lib``;
this module adds only naming rules of the control path.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from pathlib import Path

from . import wire_build
from .native import load_or_build

SHM_DIR = Path("/dev/shm")
DEFAULT_NODE = "chm0"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SUN_PATH_MAX = 107  # sockaddr_un.sun_path less its NUL


_mod = load_or_build(wire_build.MODULE, wire_build.build, Path(wire_build.__file__).with_suffix(".lock"))
ffi, lib = _mod.ffi, _mod.lib
# The device's statistics (chm_stats.h): counters the controller keeps, gauges of its state now.
STATS_COUNTERS = wire_build.stats_fields("COUNTERS")
STATS_GAUGES = wire_build.stats_fields("GAUGES")
STATS_MAP = wire_build.stats_fields("MAP")  # chm_mmap's, kept by the device server
STATS_FIELDS = STATS_COUNTERS + STATS_GAUGES + STATS_MAP  # the wire's order (CHM_STATS_FIELDS)


class NodeError(OSError):
    """A device node name or path that cannot be used (errno says why)."""


def node_path(node: str | os.PathLike) -> Path:
    """``chm0`` -> ``/dev/shm/chm0``; a path with a slash is used as given.

    The control socket is the same path plus ``.sock`` (libchm derives it the same way)."""
    text = os.fspath(node)
    if "/" in text:
        path = Path(text)
    elif _NAME.fullmatch(text):
        path = SHM_DIR / text
    else:
        raise NodeError(errno.EINVAL, f"device node name {text!r} must match {_NAME.pattern} "
                                      f"(or be a path containing '/')")
    if len(str(socket_path(path))) > SUN_PATH_MAX:
        raise NodeError(errno.ENAMETOOLONG, f"device node path {str(path)!r} is too long: its socket path "
                                            f"must fit {SUN_PATH_MAX} bytes")
    return path


def socket_path(path: Path) -> Path:
    return path.with_name(path.name + ".sock")


def read_node(node: str | os.PathLike) -> dict:
    """What a device node says about its device (no attach): raises NodeError(ENODEV) if none is served there."""
    import mmap

    path = node_path(node)
    size = ffi.sizeof("struct chm_node")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NodeError(errno.ENODEV, f"no device node at {path}") from None
    try:
        if os.fstat(fd).st_size < size:
            raise NodeError(errno.ENODEV, f"{path} is not a device node (too small)")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            buf = bytes(m)
        # The server holds an exclusive flock for as long as it serves the node.
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            live = False
        except BlockingIOError:
            live = True
    finally:
        os.close(fd)
    n = ffi.cast("struct chm_node *", ffi.from_buffer(buf))
    if n.magic != lib.CHM_WIRE_MAGIC or not live:
        raise NodeError(errno.ENODEV, f"{path}: no live device (node {'stale' if n.magic else 'not ready'})")
    if n.version != lib.CHM_WIRE_VERSION:
        raise NodeError(errno.EPROTO, f"{path}: wire version {n.version}, this driver speaks {lib.CHM_WIRE_VERSION}")
    return {
        "node": str(path),
        "server_pid": n.server_pid,
        "clients": n.clients,
        "clients_total": n.clients_total,
        "capacity_bytes": n.capacity_bytes,
        "dram_bytes": n.dram_bytes,
        "page_size": n.page_size,
        "ssd_count": n.ssd_count,
        "policy": ffi.string(n.policy).decode(),
        "write_buffer_bytes": n.write_buffer_bytes,
        "prefetch_window_bytes": n.prefetch_window_bytes,
        "prefetch_max_handles": n.prefetch_max_handles,
        "profile": ffi.string(n.profile).decode(),
        "data": bool(n.data),
        "pacing": bool(n.pacing),
    }
