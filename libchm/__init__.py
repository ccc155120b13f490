"""libchm from Python: the out-of-process device, same API as the in-process one.

    from libchm import Device, ChmError, WriteBufferFull     # out of process
    # from emulator import Device, ChmError, WriteBufferFull  # in process
    with Device.open("chm0") as dev:
        dev.write(0, b"hello")
        assert dev.read(0, 5) == b"hello"

A ``Device`` owns one ``chm_dev`` (one queue pair). Like the C handle it is
for one thread at a time; open one per thread.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from driver.errors import ChmError, WriteBufferFull
from driver.native import load_or_build

__all__ = ["Device", "ChmError", "WriteBufferFull"]


def _build() -> None:
    from . import ffi_build  # imported only to build: `python -m libchm.ffi_build` runs it as a script

    ffi_build.build()


_mod = load_or_build(f"{__name__}._chm", _build, Path(__file__).with_name("ffi_build.lock"))
ffi, lib = _mod.ffi, _mod.lib
STATS_JSON_BYTES = 1 << 16


def _raise(ret: int, what: str):
    err = -ret
    message = f"{what}: {ffi.string(lib.chm_strerror(ret)).decode()}"
    if err == errno.EAGAIN:
        raise WriteBufferFull(message)
    raise ChmError(err, message)


def _check_int(name: str, value, positive: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ChmError(errno.EINVAL, f"{name} {value!r} must be an integer")
    if value < 0 or (positive and value == 0):
        raise ChmError(errno.ERANGE if name == "address" else errno.EINVAL,
                       f"{name} {value!r} must be {'> 0' if positive else '>= 0'}")
    return value


class Device:
    def __init__(self, node: str | os.PathLike | None = None, staging_bytes: int = 0, queue_entries: int = 0):
        """Attach to the device served at ``node`` (``chm0``, a path, or None for $CHM_DEVICE)."""
        opts = ffi.new("struct chm_open_opts *", {"size": ffi.sizeof("struct chm_open_opts"),
                                                   "staging_bytes": staging_bytes, "queue_entries": queue_entries})
        out = ffi.new("chm_dev **")
        self.node = None if node is None else os.fspath(node)
        ret = lib.chm_open_opts(ffi.NULL if node is None else self.node.encode(), opts, out)
        if ret < 0:
            _raise(ret, f"cannot open device {self.node or os.environ.get('CHM_DEVICE', 'chm0')!r}")
        self._dev = out[0]
        size = ffi.new("size_t *")
        self._staging = ffi.buffer(lib.chm_buffer(self._dev, size), size[0])
        self._info = ffi.new("struct chm_info *")

    @classmethod
    def open(cls, node: str | os.PathLike | None = None, **kwargs) -> "Device":
        return cls(node, **kwargs)

    # ---- plumbing --------------------------------------------------------------
    @property
    def dev(self):
        if self._dev is None:
            raise ChmError(errno.ENODEV, "device is closed")
        return self._dev

    @property
    def last_latency_ns(self) -> int:
        """Modelled device latency of the last call."""
        return lib.chm_last_latency_ns(self.dev)

    def buffer(self) -> memoryview:
        """The staging buffer shared with the device: ``read_into``/``write`` from a slice of it copy nothing extra."""
        return memoryview(self._staging)

    # ---- the API (emulator.Device's) -------------------------------------------
    def write(self, addr: int, data) -> int:
        """Write bytes-like ``data`` at ``addr``; returns the byte count.

        Raises WriteBufferFull (EAGAIN) with nothing written when refused."""
        _check_int("address", addr)
        try:
            src = ffi.from_buffer(data)
        except TypeError:
            raise ChmError(errno.EINVAL, f"data must be bytes-like, not {type(data).__name__}") from None
        if len(src) == 0:
            raise ChmError(errno.EINVAL, "length 0 must be a positive integer")
        ret = lib.chm_write(self.dev, addr, src, len(src))
        if ret < 0:
            _raise(ret, f"write of {len(src)} bytes at {addr}")
        return ret

    def read(self, addr: int, length: int) -> bytes:
        out = bytearray(_check_int("length", length, positive=True))
        self.read_into(addr, out)
        return bytes(out)

    def read_into(self, addr: int, buf) -> int:
        """Read ``len(buf)`` bytes at ``addr`` into a writable buffer (a slice of ``buffer()``: zero-copy)."""
        _check_int("address", addr)
        dst = ffi.from_buffer(buf, require_writable=True)
        if len(dst) == 0:
            raise ChmError(errno.EINVAL, "length 0 must be a positive integer")
        ret = lib.chm_read(self.dev, addr, dst, len(dst))
        if ret < 0:
            _raise(ret, f"read of {len(dst)} bytes at {addr}")
        return ret

    def prefetch(self, addr: int, size: int) -> int:
        _check_int("address", addr)
        _check_int("size", size, positive=True)
        ret = lib.chm_prefetch_object(self.dev, addr, size)
        if ret < 0:
            _raise(ret, f"prefetch of {size} bytes at {addr}")
        return ret

    def wait(self, req: int, timeout_ms: float | None = None) -> None:
        """Until prefetch ``req`` is staged; ``timeout_ms`` bounds it (whole ms, modelled time)."""
        if timeout_ms is not None and (not isinstance(timeout_ms, (int, float)) or isinstance(timeout_ms, bool)
                                       or timeout_ms < 0 or timeout_ms > 2**31 - 1):
            raise ChmError(errno.EINVAL, f"timeout_ms {timeout_ms!r} must be None or a number in [0, {2**31 - 1}]")
        _check_int("prefetch handle", req)
        ret = lib.chm_prefetch_wait(self.dev, req, -1 if timeout_ms is None else int(timeout_ms))
        if ret < 0:
            _raise(ret, f"wait for prefetch handle {req}")

    def release(self, req: int) -> None:
        _check_int("prefetch handle", req)
        ret = lib.chm_prefetch_release(self.dev, req)
        if ret < 0:
            _raise(ret, f"release of prefetch handle {req}")

    def flush(self) -> None:
        ret = lib.chm_flush(self.dev)
        if ret < 0:
            _raise(ret, "flush")

    def stats(self) -> dict:
        """Every counter the device keeps (as ``emulator.Device.stats``), this handle's ``clock_ns`` and ``clients``."""
        buf = ffi.new("char[]", STATS_JSON_BYTES)
        ret = lib.chm_stats_json(self.dev, buf, STATS_JSON_BYTES)
        if ret < 0:
            _raise(ret, "stats")
        return json.loads(ffi.string(buf, ret))

    def info(self) -> dict:
        ret = lib.chm_get_info(self.dev, self._info)
        if ret < 0:
            _raise(ret, "info")
        i = self._info
        return {
            "capacity_bytes": i.capacity_bytes,
            "dram_bytes": i.dram_bytes,
            "page_size": i.page_size,
            "ssd_count": i.ssd_count,
            "policy": ffi.string(i.policy).decode(),
            "write_buffer_bytes": i.write_buffer_bytes,
            "prefetch_window_bytes": i.prefetch_window_bytes,
            "profile": ffi.string(i.profile).decode(),
            "prefetch_max_handles": i.prefetch_max_handles,
            "staging_bytes": i.staging_bytes,
            "clients": i.clients,
            "server_pid": i.server_pid,
        }

    def close(self) -> None:
        dev, self._dev = getattr(self, "_dev", None), None
        if dev is not None:
            self._staging = None
            lib.chm_close(dev)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the module may be gone already
            pass
