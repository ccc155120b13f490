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
import math
import operator
import os
import resource
from pathlib import Path

from common.checks import Checks
from driver.errors import ChmError, WriteBufferFull
from driver.native import load_or_build
from driver.wire import lib as wire

__all__ = ["Device", "ChmError", "WriteBufferFull"]


def _build() -> None:
    from . import ffi_build  # imported only to build: `python -m libchm.ffi_build` runs it as a script

    ffi_build.build()


_mod = load_or_build(f"{__name__}._chm", _build, Path(__file__).with_name("ffi_build.lock"))
ffi, lib = _mod.ffi, _mod.lib
STATS_JSON_BYTES = 1 << 16
DEVICE_EXPLAINS = frozenset((errno.EBUSY, errno.ENOSPC, errno.EIO))  # errors whose device message is fetched
PREFETCH_EXPLAINS = DEVICE_EXPLAINS | {errno.EINVAL}  # a prefetch's EINVAL: which limit the device applied
HANDLE_MAX = 2**63 - 1         # chm_req is an int64_t
TIMEOUT_MS_MAX = 2**31 - 1     # chm_prefetch_wait takes an int


def _in_a_mapping(ret: int, address: int) -> None:
    """The -EFAULT of a chm_map_* call, raised with what it means."""
    if ret == -errno.EFAULT:
        raise ChmError(errno.EFAULT, f"address {address:#x} lies in no mapping of this device")


def _raise(ret: int, what: str, written: int = 0):
    err = -ret
    message = f"{what}: {ffi.string(lib.chm_strerror(ret)).decode()}"
    if err == errno.EAGAIN:
        raise WriteBufferFull(message, written)
    raise ChmError(err, message)


_EINVAL = Checks(lambda message: ChmError(errno.EINVAL, message))
_ERANGE = Checks(lambda message: ChmError(errno.ERANGE, message))  # an integer past the device's capacity


def _integer(name: str, value) -> int:
    """``value`` as an int (operator.index: no floats, no bools), else EINVAL naming it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise _EINVAL.fail(name, value, f"an integer, not a {type(value).__name__}")


def _in_range(name: str, value, low: int, high: int, err: int = errno.EINVAL) -> int:
    checks = _ERANGE if err == errno.ERANGE else _EINVAL
    return checks.int(name, _integer(name, value), low, high)  # not an integer at all: EINVAL whatever ``err``


def _real(name: str, value) -> float:
    """``value`` as a float (any real number but a bool), else EINVAL naming it."""
    return _EINVAL.number(name, value)


def _buffer(name: str, obj, writable: bool = False):
    """``obj``'s bytes as a cffi char[] (no copy), else EINVAL naming ``name``: what a buffer must be and why
    this one is not (a type without the buffer protocol, read-only, not C-contiguous, released)."""
    need = "a writable C-contiguous bytes-like object" if writable else "a C-contiguous bytes-like object"
    try:
        return ffi.from_buffer(obj, require_writable=writable)
    except (TypeError, BufferError, ValueError) as exc:  # cffi: no buffer; read-only or strided; numpy, released
        why = type(obj).__name__
        try:
            with memoryview(obj) as view:
                if writable and view.readonly:
                    why = f"a read-only {why} of {view.nbytes} bytes"
                elif not view.c_contiguous:
                    why = f"a non-contiguous {why} (shape {view.shape}, strides {view.strides})"
                else:
                    why = f"{why} ({exc})"
        except (TypeError, ValueError):  # no buffer at all, or a released view
            why = f"{why} ({exc})" if not isinstance(exc, TypeError) else why
        raise ChmError(errno.EINVAL, f"{name} must be {need}, not {why}") from None


def _fd_limit() -> str:
    """This process's open-file limit and use, for an EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = f"{len(os.listdir('/proc/self/fd')) - 1} fds open, "  # less the one listdir held
    except OSError:
        used = ""
    return f"{used}RLIMIT_NOFILE soft limit {soft}, hard limit {hard}"


def _open_opts(staging_bytes, queue_entries, prefetch_share):
    """The chm_open_opts of Device(): every field checked here first, named in the error."""
    staging = _integer("staging_bytes", staging_bytes)
    if staging != 0 and not 1 <= staging <= wire.CHM_MAX_STAGING_BYTES:
        raise ChmError(errno.EINVAL, f"staging_bytes {staging} is outside the allowed range: 0 (the default) "
                                     f"or [1, {wire.CHM_MAX_STAGING_BYTES}]")
    entries = _integer("queue_entries", queue_entries)
    if entries != 0 and not (wire.CHM_MIN_ENTRIES <= entries <= wire.CHM_MAX_ENTRIES and entries & (entries - 1) == 0):
        raise ChmError(errno.EINVAL, f"queue_entries {entries} is outside the allowed range: 0 (the default) or a "
                                     f"power of two in [{wire.CHM_MIN_ENTRIES}, {wire.CHM_MAX_ENTRIES}]")
    share = 0.0
    if prefetch_share is not None:
        share = _real("prefetch_share", prefetch_share)
        if not 0 < share <= 1:  # NaN fails too
            raise ChmError(errno.EINVAL, f"prefetch_share {prefetch_share!r} is outside the allowed range: "
                                         "None (the device default) or (0, 1]")
    return ffi.new("struct chm_open_opts *", {"size": ffi.sizeof("struct chm_open_opts"), "staging_bytes": staging,
                                              "queue_entries": entries, "prefetch_share": share})


class Device:
    def __init__(self, node: str | os.PathLike | None = None, staging_bytes: int = 0, queue_entries: int = 0,
                 prefetch_share: float | None = None):
        """Attach to the device served at ``node`` (``chm0``, a path, or None for $CHM_DEVICE).

        ``staging_bytes`` (0: 16 MiB or $CHM_STAGING_BYTES) and ``queue_entries`` (0: 64) size this
        handle's queue pair; ``prefetch_share`` is its share of the device's prefetch window, in (0, 1]
        (None: the device's ``policy.prefetch_client_share``)."""
        self._dev = None
        self._maps: dict[int, tuple[int, int]] = {}  # base address -> (device address, length) of each mmap()
        opts = _open_opts(staging_bytes, queue_entries, prefetch_share)
        self.node, path = None, ffi.NULL
        if node is not None:
            try:
                path = os.fsencode(node)
                self.node = os.fsdecode(path)
            except (TypeError, UnicodeError):
                raise ChmError(errno.EINVAL, f"node {node!r} must be a device name, a path or None") from None
            if b"\0" in path:
                raise ChmError(errno.EINVAL, f"node {node!r} must not contain a NUL byte")
        out = ffi.new("chm_dev **")
        ret = lib.chm_open_opts(path, opts, out)
        if ret < 0:
            name = self.node or os.environ.get("CHM_DEVICE", "chm0")
            shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
            what = f"cannot open device {shown}"
            if ret == -errno.EINVAL:  # the options were checked above: the node name or the environment
                what += (f" (the node's path with '.sock' must fit a UNIX socket address of {lib.SUN_PATH_BYTES} "
                         f"bytes; or $CHM_STAGING_BYTES={os.environ.get('CHM_STAGING_BYTES')!r}"
                         f" / $CHM_SPIN_US={os.environ.get('CHM_SPIN_US')!r} outside their ranges)")
            elif ret == -errno.EMFILE:
                what += f" ({_fd_limit()})"
            _raise(ret, what)
        self._dev = out[0]
        self._info = ffi.new("struct chm_info *")
        self._completions = ffi.new("struct chm_completion[]", wire.CHM_MAX_ENTRIES)  # reap's, allocated once
        self._last_latency_ns = 0
        self._prefetch_limit = None
        info = self.info()
        self._capacity, self._staging_bytes = info["capacity_bytes"], info["staging_bytes"]
        self._page_size, self._window_bytes = max(1, info["page_size"]), info["prefetch_window_bytes"]
        # The most pages one prefetch of this handle may span, and its share: fixed at attach, and only the
        # device knows its default share (policy.prefetch_client_share), so asked once, here.
        window_pages = -(-self._window_bytes // self._page_size)  # the device rounds the window up to pages
        share = self.stats().get("prefetch", {})
        self._prefetch_limit = min(window_pages, share.get("pages_limit", window_pages))
        self._share_ppm = share.get("share_ppm", wire.CHM_PPM)
        # Views of the staging buffer (buffer()) hold a reference to its mapping: close() detaches
        # from the device at once, the mapping goes with the last view, so no view ever faults.
        size = ffi.new("size_t *")
        mapping = lib.chm_mapping_get(self._dev)
        base = ffi.cast("char *", lib.chm_buffer(self._dev, size))
        base = ffi.gc(base, lambda _base, mapping=mapping, put=lib.chm_mapping_put: put(mapping))
        self._staging = ffi.buffer(base, size[0])

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
        """Modelled device latency of the last call (of all its commands, for a split write)."""
        self.dev  # ENODEV once closed
        return self._last_latency_ns

    def _finish(self, ret: int, what: str, explains: frozenset = DEVICE_EXPLAINS) -> int:
        """After one libchm call: keep its latency, raise its error."""
        self._last_latency_ns = lib.chm_last_latency_ns(self._dev)
        if ret < 0:
            _raise(ret, what + self._device_says(-ret, explains))
        return ret

    def _device_says(self, err: int, explains: frozenset = DEVICE_EXPLAINS) -> str:
        """The device's own message for an error the wire carries only as an errno: which limit (EBUSY),
        which file (ENOSPC, EIO). One more round trip, on these rare errors only."""
        if err not in explains or self._dev is None:
            return ""
        buf = ffi.new("char[]", STATS_JSON_BYTES)
        ret = lib.chm_stats_json(self._dev, buf, STATS_JSON_BYTES)
        message = json.loads(ffi.string(buf, ret)).get("last_error") if ret > 0 else None
        return f" (device: {message})" if message else ""

    def buffer(self) -> memoryview:
        """The staging buffer shared with the device: ``read_into``/``write`` from a slice of it copy nothing extra.

        A view stays valid after close() (and after this object is gone), but is then detached:
        bytes stored in it reach nothing. ChmError(ENODEV) once closed."""
        self.dev  # ENODEV once closed
        return memoryview(self._staging)

    def _address(self, addr) -> int:
        return _in_range("address", addr, 0, self._capacity - 1, errno.ERANGE)

    def _length(self, name: str, length, addr: int) -> int:
        """A byte count at ``addr``: EINVAL if not positive, ERANGE past the device's end."""
        n = _integer(name, length)
        if n < 1:
            raise ChmError(errno.EINVAL, f"{name} {n} must be a positive integer")
        if n > self._capacity - addr:
            raise ChmError(errno.ERANGE, f"{name} {n} at address {addr} is outside the allowed range "
                                         f"[1, {self._capacity - addr}] (device capacity {self._capacity})")
        return n

    # ---- the API (emulator.Device's) -------------------------------------------
    def write(self, addr: int, data) -> int:
        """Write bytes-like ``data`` at ``addr``; returns its length.

        Raises WriteBufferFull (EAGAIN) when refused. One command is admitted whole or not at all;
        data larger than the staging buffer goes as several, and if one is refused the ones before
        it stay written: ``exc.written`` counts their bytes (0: nothing written)."""
        addr = self._address(addr)
        src = _buffer("data", data)
        total = self._length("data length", len(src), addr)
        dev = self.dev
        # Split here, one command per staging-buffer load (libchm would split the same way, but a
        # refused part would come back as a short count without its errno).
        done = latency = 0
        while done < total:
            part = min(total - done, self._staging_bytes)
            ret = lib.chm_write(dev, addr + done, src + done, part)
            latency += lib.chm_last_latency_ns(dev)
            self._last_latency_ns = latency
            if ret < 0:
                what = f"write of {total} bytes at {addr}"
                if done:
                    what += f" (the first {done} bytes written)"
                _raise(ret, what + self._device_says(-ret), done)
            done += part
        return total

    def read(self, addr: int, length: int) -> bytes:
        """``length`` bytes at ``addr``."""
        addr = self._address(addr)
        out = bytearray(self._length("length", length, addr))  # checked first: never a huge allocation
        self.read_into(addr, out)
        return bytes(out)

    def read_into(self, addr: int, buf) -> int:
        """Read ``len(buf)`` bytes at ``addr`` into a writable buffer (a slice of ``buffer()``: zero-copy)."""
        addr = self._address(addr)
        dst = _buffer("buf", buf, writable=True)
        n = self._length("buffer length", len(dst), addr)
        return self._finish(lib.chm_read(self.dev, addr, dst, n), f"read of {n} bytes at {addr}")

    def submit_read(self, addr: int, buf, user_data: int = 0) -> None:
        """Queue a read of ``len(buf)`` bytes at ``addr`` into ``buf``, a slice of ``buffer()``: the device
        copies while the caller goes on. Its completion comes from ``reap`` (in submission order); while any
        is in flight the synchronous calls fail with EBUSY. EFAULT: ``buf`` is not inside ``buffer()``."""
        addr = self._address(addr)
        user_data = _in_range("user_data", user_data, 0, 2**64 - 1)
        dst = _buffer("buf (a writable slice of buffer())", buf, writable=True)
        n = self._length("buffer length", len(dst), addr)
        self._finish(lib.chm_submit_read(self.dev, addr, dst, n, user_data), f"submit of a read of {n} bytes at {addr}")

    def reap(self, min_wait: int = 1, max_completions: int = 64) -> list[tuple[int, int, int]]:
        """Completions of submitted commands, oldest first: ``(user_data, bytes moved or -errno, modelled
        latency ns)``; waits until at least ``min_wait`` are there (EINVAL if more than are in flight)."""
        max_completions = _in_range("max_completions", max_completions, 1, wire.CHM_MAX_ENTRIES)
        min_wait = _in_range("min_wait", min_wait, 0, max_completions)
        out = self._completions
        n = self._finish(lib.chm_reap(self.dev, out, max_completions, min_wait), f"reap waiting for {min_wait} completions (no more than are in flight)")
        return [(out[i].user_data, out[i].res, out[i].latency_ns) for i in range(n)]

    def prefetch(self, addr: int, size: int) -> int:
        """Stage ``size`` bytes at ``addr``; the handle for ``wait``/``poll``/``release``. EBUSY while the window (or
        this handle's share of it) is full; EINVAL, naming the limit, for an object that can never fit: more pages
        than ``info()["prefetch_limit_pages"]``."""
        addr = self._address(addr)
        size = self._length("size", size, addr)
        page, limit = self._page_size, self._prefetch_limit
        pages = (addr + size - 1) // page - addr // page + 1
        if pages > limit:  # the device would refuse it too (EINVAL), but could not say why in an errno
            raise ChmError(errno.EINVAL, f"size {size} at address {addr} spans {pages} pages of {page} bytes: it can "
                                         f"never fit this handle's prefetch limit of {limit} pages ({limit * page} "
                                         f"bytes: its share of {self._share_ppm} ppm of the device's prefetch window "
                                         f"of {self._window_bytes} bytes, policy.prefetch_window_bytes)")
        return self._finish(lib.chm_prefetch_object(self.dev, addr, size), f"prefetch of {size} bytes at {addr}",
                            PREFETCH_EXPLAINS)

    def wait(self, req: int, timeout_ms: float | None = None) -> None:
        """Until prefetch ``req`` is staged; ``timeout_ms`` bounds it (modelled time, rounded up to whole ms)."""
        req = _in_range("prefetch handle", req, 1, HANDLE_MAX)
        timeout = -1
        if timeout_ms is not None:
            t = _real("timeout_ms", timeout_ms)
            if not 0 <= t <= TIMEOUT_MS_MAX:  # NaN fails too
                raise ChmError(errno.EINVAL, f"timeout_ms {timeout_ms!r} is outside the allowed range: "
                                             f"None (no bound) or [0, {TIMEOUT_MS_MAX}]")
            timeout = math.ceil(t)
        self._finish(lib.chm_prefetch_wait(self.dev, req, timeout), f"wait for prefetch handle {req}")

    def poll(self, req: int) -> bool:
        """Is prefetch ``req`` staged, its SSD reads landed? Never waits for them (``wait`` would): True once it
        is (answered as a ``wait`` without a bound), False while its reads are in flight."""
        req = _in_range("prefetch handle", req, 1, HANDLE_MAX)
        ret = lib.chm_prefetch_poll(self.dev, req)
        if ret == -errno.EAGAIN:
            self._last_latency_ns = lib.chm_last_latency_ns(self._dev)
            return False
        self._finish(ret, f"poll of prefetch handle {req}")
        return True

    def release(self, req: int) -> None:
        req = _in_range("prefetch handle", req, 1, HANDLE_MAX)
        self._finish(lib.chm_prefetch_release(self.dev, req), f"release of prefetch handle {req}")

    def flush(self) -> None:
        self._finish(lib.chm_flush(self.dev), "flush")

    def stats(self) -> dict:
        """Every counter the device keeps (as ``emulator.Device.stats``), this handle's ``clock_ns`` and ``clients``."""
        buf = ffi.new("char[]", STATS_JSON_BYTES)
        ret = self._finish(lib.chm_stats_json(self.dev, buf, STATS_JSON_BYTES), "stats")
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
            "device_epoch": i.device_epoch,
            "prefetch_limit_pages": self._prefetch_limit,  # the most pages one prefetch of this handle may span
        }

    # ---- the device as memory (docs/mmap.md) -------------------------------------
    def mmap(self, addr: int = 0, length: int | None = None, strict: bool = False,
             inline: bool = False) -> memoryview:
        """Map ``length`` device bytes at ``addr`` (default: the whole capacity) into this process: a writable
        memoryview whose loads and stores reach the device (numpy.frombuffer, torch.frombuffer wrap it with no
        copy). ``strict``: CHM_MAP_STRICT (one page mapped at a time: every page visit is a device access).
        ``inline``: CHM_MAP_INLINE (faults served in the faulting thread, by a SIGBUS handler: cheaper; a
        syscall given a page not mapped yet then fails with EFAULT, chm_mmap(3)).
        EOPNOTSUPP names what the kernel or the device lacks. The view is withdrawn by ``munmap`` or ``close``:
        an access after that is SIGBUS, never a stale byte; its addresses stay reserved for the process."""
        addr = self._address(addr)
        length = self._capacity - addr if length is None else self._length("length", length, addr)
        page = self._page_size
        for name, value in (("addr", addr), ("length", length)):
            if value % page:
                raise ChmError(errno.EINVAL, f"{name} {value} must be a multiple of the device's page_size {page}")
        for name, value in (("strict", strict), ("inline", inline)):
            if not isinstance(value, bool):
                raise ChmError(errno.EINVAL, f"{name} must be True or False, not {value!r}")
        out = ffi.new("void **")
        flags = (lib.CHM_MAP_STRICT if strict else 0) | (lib.CHM_MAP_INLINE if inline else 0)
        ret = lib.chm_mmap_range(self.dev, addr, length, out, flags)
        if ret == -errno.EOPNOTSUPP:
            why = lib.chm_mmap_unsupported()
            if why != ffi.NULL:
                why = ffi.string(why).decode()
            elif inline:
                why = "the device moves no bytes, or CHM_MAP_INLINE lacks the kernel's UFFD_FEATURE_SIGBUS or x86-64"
            else:
                why = "the device moves no bytes (emulation.data is off): there is nothing to map"
            raise ChmError(errno.EOPNOTSUPP, f"mmap of {length} bytes at {addr}: {why}")
        if ret < 0:
            _raise(ret, f"mmap of {length} bytes at {addr}")
        view = memoryview(ffi.buffer(ffi.cast("char *", out[0]), length))
        self._maps[int(ffi.cast("uintptr_t", out[0]))] = (addr, length)
        return view

    def _map_base(self, view: memoryview) -> int:
        base = int(ffi.cast("uintptr_t", ffi.from_buffer(view)))
        if base not in self._maps:
            raise ChmError(errno.EINVAL, "not a view returned by this device's mmap()")
        return base

    def munmap(self, view: memoryview) -> None:
        """Withdraw a mapping from ``mmap``: every later access through any view of it is SIGBUS."""
        base = self._map_base(view)
        del self._maps[base]
        ret = lib.chm_map_revoke(self.dev, ffi.cast("void *", base))
        if ret < 0:
            _raise(ret, "munmap")

    def map_error(self, address: int) -> int:
        """Why an access at ``address`` (an int, e.g. ``ctypes.addressof``, ``tensor.data_ptr()``) of a mapping
        gets SIGBUS: a -errno, or 0."""
        ret = lib.chm_map_error(self.dev, ffi.cast("void *", _integer("address", address)))
        _in_a_mapping(ret, address)
        return ret

    def map_populate(self, address: int, size: int) -> None:
        """Fault [address, address+size) of a mapping in now, as reads (chm_map_populate): a page that cannot
        be served raises ChmError with its errno here, where a load of it would be SIGBUS."""
        address, size = _integer("address", address), _integer("size", size)
        ret = lib.chm_map_populate(self.dev, ffi.cast("void *", address), size)
        _in_a_mapping(ret, address)
        if ret < 0:
            _raise(ret, f"map_populate of {size} bytes at {address:#x}")

    def prefetch_ptr(self, address: int, size: int) -> int:
        """``prefetch`` of the device bytes that [address, address+size) of a mapping shows (``address`` an
        int inside a view from ``mmap``); wait, poll and release its handle as for ``prefetch``."""
        address, size = _integer("address", address), _integer("size", size)
        return self._finish(lib.chm_prefetch_ptr(self.dev, ffi.cast("void *", address), size),
                            f"prefetch of {size} bytes at mapped address {address:#x}", PREFETCH_EXPLAINS)

    def close(self) -> None:
        """Detach from the device. Views from buffer() stay readable and writable, detached; views from
        mmap() are withdrawn (SIGBUS on access)."""
        dev, self._dev = getattr(self, "_dev", None), None
        if dev is not None:
            for base in getattr(self, "_maps", {}):
                lib.chm_map_revoke(dev, ffi.cast("void *", base))
            self._maps = {}
            self._staging = None  # our reference to the mapping; views keep theirs
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
