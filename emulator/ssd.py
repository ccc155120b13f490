"""The SSD backend: each emulated SSD is a sparse backing file, read and
written with O_DIRECT through io_uring.

Layout of the device address space over the SSDs (documented in the README):
the space is cut into stripes of ``ssd.stripe_bytes``; stripe ``s`` lives on
SSD ``s % count`` at file offset ``(s // count) * stripe_bytes``. So address
``a`` is at byte ``(a // stripe // count) * stripe + a % stripe`` of file
``ssd{(a // stripe) % count}.img``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import warnings
from pathlib import Path

from driver.native import load_or_build

from .config import IO_ALIGN, Config
from .errors import ChmError


def locate(cfg: Config, addr: int) -> tuple[int, int]:
    """Device address -> (SSD index, byte offset in its backing file)."""
    stripe, count = cfg.ssd.stripe_bytes, cfg.ssd.count
    s = addr // stripe
    return s % count, (s // count) * stripe + addr % stripe


def media_file(media_dir: Path, index: int) -> Path:
    return media_dir / f"ssd{index}.img"


def _load_ring_module():
    from . import uring_build

    return load_or_build(uring_build.MODULE, uring_build.build, Path(uring_build.__file__).with_suffix(".lock"))


class SsdBackend:
    """Real I/O on the media files. Operations are queued, submitted in
    batches and completed asynchronously; callers hold integer tokens.

    A lock file in the media directory keeps two devices off the same media.
    """

    READ, WRITE = 0, 1

    def __init__(self, cfg: Config, media_dir: str | os.PathLike):
        self._mod = _load_ring_module()
        self.ffi, self.lib = self._mod.ffi, self._mod.lib
        self.media_dir = Path(media_dir)
        self.media_dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.media_dir / ".chm.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ChmError(errno.EBUSY, f"media directory {str(self.media_dir)!r} is in use by another device") from None
        self.direct = True
        self.fds: list[int] = []
        try:
            for i in range(cfg.ssd.count):
                self.fds.append(self._open_media(media_file(self.media_dir, i), cfg.ssd.capacity_bytes))
            ring = self.ffi.new("struct chm_ring **")
            ret = self.lib.chm_ring_open(cfg.emulation.io_queue_depth, ring)
            if ret < 0:
                raise ChmError(-ret, f"io_uring_queue_init(depth={cfg.emulation.io_queue_depth}) failed: {os.strerror(-ret)}")
        except BaseException:
            self._close_files()
            raise
        self._ring = ring[0]
        self.depth = cfg.emulation.io_queue_depth
        self._ops = self.ffi.new("struct chm_io[]", self.depth)
        self._done_buf = self.ffi.new("struct chm_done[]", 2 * self.depth)
        self._queued: list[tuple[int, int, int, int, int, int]] = []  # (opcode, fd, len, offset, buf, token)
        self._ops_of: dict[int, tuple[int, int, int, int, int]] = {}  # in-flight token -> op
        self._results: dict[int, int] = {}  # completed token -> bytes
        self._inflight = 0
        self._next_token = 1
        self.bytes_read = self.bytes_written = 0

    def _open_media(self, path: Path, capacity: int) -> int:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise ChmError(exc.errno, f"cannot open media file {str(path)!r}: {exc.strerror}") from None
            # The file system refuses O_DIRECT (e.g. an old tmpfs): fall back, and say so.
            warnings.warn(f"{path}: O_DIRECT not supported here, using buffered I/O", RuntimeWarning, stacklevel=3)
            self.direct = False
            fd = os.open(path, flags & ~getattr(os, "O_DIRECT", 0), 0o600)
        size = os.fstat(fd).st_size
        if size == 0:
            os.ftruncate(fd, capacity)  # sparse: blocks are allocated only when written
        elif size != capacity:
            os.close(fd)
            raise ChmError(errno.EINVAL, f"media file {str(path)!r} is {size} bytes but the profile's "
                           f"ssd.capacity_bytes is {capacity}: wrong profile for this media directory?")
        return fd

    # ---- submission and completion -------------------------------------------
    def submit(self, opcode: int, ssd: int, offset: int, buf_addr: int, length: int) -> int:
        """Queue one aligned transfer between a DRAM address and SSD ``ssd``; return its token."""
        if (offset | buf_addr | length) % IO_ALIGN:
            raise ChmError(errno.EINVAL, f"unaligned media I/O: offset={offset} buf=0x{buf_addr:x} len={length}")
        token = self._next_token
        self._next_token += 1
        self._queued.append((opcode, self.fds[ssd], length, offset, buf_addr, token))
        return token

    def _push(self) -> None:
        """Move queued operations into the ring, as many as the queue depth allows."""
        while self._queued and self._inflight < self.depth:
            n = min(len(self._queued), self.depth - self._inflight)
            for i, (opcode, fd, length, offset, buf, token) in enumerate(self._queued[:n]):
                op = self._ops[i]
                op.opcode, op.fd, op.len, op.offset, op.buf, op.user_data = opcode, fd, length, offset, buf, token
                self._ops_of[token] = (opcode, fd, length, offset, buf)
            queued = self.lib.chm_ring_queue(self._ring, self._ops, n)
            for _, _, _, _, _, token in self._queued[queued:n]:
                del self._ops_of[token]
            del self._queued[:queued]
            self._inflight += queued
            ret = self.lib.chm_ring_submit(self._ring)
            if ret < 0:
                raise ChmError(-ret, f"io_uring_submit failed: {os.strerror(-ret)}")
            if queued < n:
                break

    def _reap(self, wait_nr: int) -> None:
        n = self.lib.chm_ring_reap(self._ring, self._done_buf, 2 * self.depth, wait_nr)
        if n < 0:
            raise ChmError(-n, f"io_uring wait failed: {os.strerror(-n)}")
        for i in range(n):
            token, res = self._done_buf[i].user_data, self._done_buf[i].res
            self._inflight -= 1
            opcode, fd, length, offset, buf = self._ops_of.pop(token)
            if res < 0:
                raise ChmError(errno.EIO, f"media {'write' if opcode else 'read'} of {length} bytes at offset {offset} "
                               f"failed: {os.strerror(-res)}")
            if res < length:  # short transfer: finish the rest synchronously
                res += self._finish_short(opcode, fd, length - res, offset + res, buf + res)
            if opcode == self.WRITE:
                self.bytes_written += res
            else:
                self.bytes_read += res
            self._results[token] = res

    def _finish_short(self, opcode: int, fd: int, length: int, offset: int, buf: int) -> int:
        view = self.ffi.buffer(self.ffi.cast("char *", buf), length)
        done = 0
        while done < length:
            chunk = memoryview(view)[done:]
            n = os.pwritev(fd, [chunk], offset + done) if opcode == self.WRITE else os.preadv(fd, [chunk], offset + done)
            if n <= 0:
                raise ChmError(errno.EIO, f"media transfer stopped short at offset {offset + done}")
            done += n
        return done

    def poll(self) -> None:
        """Submit what is queued and collect what has completed, without blocking."""
        self._push()
        if self._inflight:
            self._reap(0)

    def is_done(self, token: int) -> bool:
        return token in self._results

    def wait(self, token: int) -> int:
        """Block until the operation behind ``token`` is complete; return its byte count."""
        while token not in self._results:
            self._push()
            if token not in self._ops_of and not self._queued and token not in self._results:
                raise ChmError(errno.EINVAL, f"unknown media I/O token {token}")
            self._reap(1)
        return self._results.pop(token)

    def wait_all(self) -> None:
        while self._queued or self._inflight:
            self._push()
            self._reap(1)

    def sync(self) -> None:
        """Make everything written durable on the media files."""
        self.wait_all()
        for fd in self.fds:
            os.fdatasync(fd)

    def _close_files(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()

    def close(self) -> None:
        if self._ring is None:
            return
        self.sync()
        self.lib.chm_ring_close(self._ring)
        self._ring = None
        self._close_files()
