"""The SSD backend: each emulated SSD is a sparse backing file, read and
written with O_DIRECT through io_uring.

Layout of the device address space over the SSDs (docs/emulator.md, "Address layout over the SSDs"):
the space is cut into stripes of ``ssd.stripe_bytes``; stripe ``s`` lives on
SSD ``s % count`` at file offset ``(s // count) * stripe_bytes``. So address
``a`` is at byte ``(a // stripe // count) * stripe + a % stripe`` of file
``ssd{(a // stripe) % count}.img``.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import os
import time
import warnings
from collections import deque
from pathlib import Path

from driver.native import load_or_build

from . import media
from .config import IO_ALIGN, Config
from .errors import ChmError
from .media import media_file  # the backing files' names (tests and callers of locate import it from here)


def locate(cfg: Config, addr: int) -> tuple[int, int]:
    """Device address -> (SSD index, byte offset in its backing file)."""
    stripe, count = cfg.ssd.stripe_bytes, cfg.ssd.count
    s = addr // stripe
    return s % count, (s // count) * stripe + addr % stripe


def _load_ring_module():
    from . import uring_build

    return load_or_build(uring_build.MODULE, uring_build.build, Path(uring_build.__file__).with_suffix(".lock"))


class MediaIOError(ChmError):
    """A media transfer failed: its errno (ENOSPC, EIO, ...) and where."""

    def __init__(self, err: int, op: str, path: Path, offset: int = 0, length: int = 0):
        what = f"media {op} of {length} bytes at offset {offset} of {str(path)!r}" if length else f"{op} of {str(path)!r}"
        super().__init__(err, f"{what} failed: {os.strerror(err)}")
        self.op, self.path, self.offset, self.length = op, path, offset, length


class FaultInjector:
    """Test-only (config ``[faults]``): media operations number ``first_failing_op`` to
    ``first_failing_op + failing_ops - 1`` of the chosen kind complete with ``errno`` instead of
    being performed, the way a full or failing disk answers; with ``read_delay_ms`` every read's
    completion is held back until that long after its submission, the way a slow disk answers.
    Works without root."""

    def __init__(self, cfg: Config):
        f = cfg.faults
        self.errno = 0 if f.errno == "none" else getattr(errno, f.errno)
        self.ops = f.ops
        self.first, self.count = f.first_failing_op, f.failing_ops
        self.seen = 0  # media operations of the chosen kind so far
        self.read_delay_s = f.read_delay_ms / 1e3

    def fails(self, opcode: int) -> int:
        """0, or the errno the next operation of ``opcode`` completes with."""
        if not self.errno or (self.ops != "any" and self.ops != ("write" if opcode == SsdBackend.WRITE else "read")):
            return 0
        self.seen += 1
        return self.errno if self.first <= self.seen < self.first + self.count else 0


class SsdBackend:
    """Real I/O on the media files. Operations are queued, submitted in
    batches and completed asynchronously; callers hold integer tokens.

    Every completion is recorded before anything is raised, so the count of
    operations in the ring is always right and a wait can never hang; a failed
    operation's token keeps its error until ``wait`` raises it.

    A lock file in the media directory keeps two devices off the same media;
    ``chm.meta`` (``emulator.media``) says whose media they are and whether the
    last shutdown was clean.
    """

    READ, WRITE = 0, 1

    def __init__(self, cfg: Config, media_dir: str | os.PathLike, format_media: bool = False):
        self._mod = _load_ring_module()
        self.ffi, self.lib = self._mod.ffi, self._mod.lib
        self.media_dir = Path(media_dir)
        self._ring = None
        self.fds: list[int] = []
        self._lock = self._lock_media_dir()
        self.direct = True
        try:
            self.meta, self.unclean_shutdown = media.open_media(cfg, self.media_dir, format_media)
            self.paths = [media_file(self.media_dir, i) for i in range(cfg.ssd.count)]
            for path in self.paths:
                self.fds.append(self._open_media(path))
            ring = self.ffi.new("struct chm_ring **")
            ret = self.lib.chm_ring_open(cfg.emulation.io_queue_depth, ring)
            if ret < 0:
                raise ChmError(-ret, f"io_uring_queue_init(depth={cfg.emulation.io_queue_depth}) failed: {os.strerror(-ret)}")
        except BaseException:
            self._close_files()
            raise
        self._ring = ring[0]
        self.depth = cfg.emulation.io_queue_depth
        self.faults = FaultInjector(cfg)
        self._ops = self.ffi.new("struct chm_io[]", self.depth)
        self._done_buf = self.ffi.new("struct chm_done[]", 2 * self.depth)
        self._queued: deque[int] = deque()  # tokens not yet in the ring
        self._ops_of: dict[int, tuple[int, int, int, int, int]] = {}  # token -> (opcode, ssd, len, offset, buf), until complete
        self._injected: deque[tuple[int, int]] = deque()  # (token, -errno) completions the fault hook made
        self._results: dict[int, int | MediaIOError] = {}  # completed token -> bytes, or its error
        self._submitted_at: dict[int, float] = {}  # token -> monotonic submit time (only with a read delay)
        self._held_back: list[tuple[float, int, int]] = []  # (due, token, res): completions the read delay holds
        self._inflight = 0  # operations in the ring
        self._next_token = 1
        self.bytes_read = self.bytes_written = 0

    def _lock_media_dir(self):
        where = str(self.media_dir)
        try:
            self.media_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ChmError(errno.ENOTDIR, f"media path {where!r} exists and is not a directory") from None
        except OSError as exc:
            raise ChmError(exc.errno or errno.EIO, f"cannot create media directory {where!r}: {exc.strerror}") from None
        if not self.media_dir.is_dir():
            raise ChmError(errno.ENOTDIR, f"media path {where!r} is not a directory")
        try:
            lock = open(self.media_dir / ".chm.lock", "w")
        except OSError as exc:
            raise ChmError(exc.errno or errno.EIO, f"media directory {where!r} is not writable: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ChmError(errno.EBUSY, f"media directory {where!r} is in use by another device") from None
        return lock

    def _open_media(self, path: Path) -> int:
        flags = os.O_RDWR | getattr(os, "O_DIRECT", 0)
        try:
            return os.open(path, flags)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise ChmError(exc.errno, f"cannot open media file {str(path)!r}: {exc.strerror}") from None
        # The file system refuses O_DIRECT (e.g. an old tmpfs): fall back, and say so.
        warnings.warn(f"{path}: O_DIRECT not supported here, using buffered I/O", RuntimeWarning, stacklevel=3)
        self.direct = False
        try:
            return os.open(path, flags & ~getattr(os, "O_DIRECT", 0))
        except OSError as exc:
            raise ChmError(exc.errno, f"cannot open media file {str(path)!r}: {exc.strerror}") from None

    # ---- submission and completion -------------------------------------------
    def submit(self, opcode: int, ssd: int, offset: int, buf_addr: int, length: int) -> int:
        """Queue one aligned transfer between a DRAM address and SSD ``ssd``; return its token."""
        if (offset | buf_addr | length) % IO_ALIGN:
            raise ChmError(errno.EINVAL, f"unaligned media I/O: offset={offset} buf=0x{buf_addr:x} len={length}")
        token = self._next_token
        self._next_token += 1
        self._ops_of[token] = (opcode, ssd, length, offset, buf_addr)
        if self.faults.read_delay_s and opcode == self.READ:
            self._submitted_at[token] = time.monotonic()
        injected = self.faults.fails(opcode)
        if injected:
            self._injected.append((token, -injected))
        else:
            self._queued.append(token)
        return token

    def _push(self) -> None:
        """Move queued operations into the ring, as many as the queue depth allows."""
        while self._queued and self._inflight < self.depth:
            n = min(len(self._queued), self.depth - self._inflight)
            for i in range(n):
                token = self._queued[i]
                opcode, ssd, length, offset, buf = self._ops_of[token]
                op = self._ops[i]
                op.opcode, op.fd, op.len, op.offset, op.buf, op.user_data = opcode, self.fds[ssd], length, offset, buf, token
            queued = self.lib.chm_ring_queue(self._ring, self._ops, n)
            for _ in range(queued):
                self._queued.popleft()
            self._inflight += queued
            ret = self.lib.chm_ring_submit(self._ring)
            if ret < 0:
                raise ChmError(-ret, f"io_uring_submit failed: {os.strerror(-ret)}")
            if queued < n:
                break

    def _reap(self, wait_nr: int) -> int:
        """Record completions; block for at least ``wait_nr`` only if none is at hand and the ring, or the test-only
        read delay, holds some. Returns how many it recorded."""
        got = self._release_held_back()
        while self._injected:
            self._complete(*self._injected.popleft())
            got += 1
        if not self._inflight:
            if wait_nr and not got and self._held_back:  # only held-back completions are left: nothing to reap
                time.sleep(self.held_back_s())
                got = self._release_held_back()
            return got
        n = self.lib.chm_ring_reap(self._ring, self._done_buf, 2 * self.depth, 0 if got else min(wait_nr, self._inflight))
        if n < 0:
            raise ChmError(-n, f"io_uring wait failed: {os.strerror(-n)}")
        self._inflight -= n
        for i in range(n):  # every completion is recorded; nothing here raises
            self._complete(self._done_buf[i].user_data, self._done_buf[i].res)
        return got + n

    def _complete(self, token: int, res: int) -> None:
        submitted = self._submitted_at.pop(token, None)
        if submitted is not None and time.monotonic() < submitted + self.faults.read_delay_s:
            heapq.heappush(self._held_back, (submitted + self.faults.read_delay_s, token, res))
            return
        opcode, ssd, length, offset, buf = self._ops_of.pop(token)
        if 0 <= res < length:  # short transfer: finish the rest synchronously
            try:
                res += self._finish_short(opcode, self.fds[ssd], length - res, offset + res, buf + res)
            except OSError as exc:
                res = -(exc.errno or errno.EIO)
        if res < 0:
            self._results[token] = MediaIOError(-res, "write" if opcode == self.WRITE else "read", self.paths[ssd],
                                                offset, length)
            return
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
            if n <= 0:  # end of file: the media file is shorter than the device says (truncated)
                raise OSError(errno.EIO, f"media transfer stopped short at offset {offset + done}")
            done += n
        return done

    def poll(self) -> None:
        """Submit what is queued and collect what has completed, without blocking. It returns with nothing
        queued outside the ring unless the ring is full: whoever then sleeps until the ring's next completion
        (``fileno``) never waits on work that was never submitted."""
        self._push()
        while self._reap(0) and self._queued:
            self._push()

    def _release_held_back(self) -> int:
        """Record the completions the read delay held back that are due now; how many."""
        n = 0
        now = time.monotonic()
        while self._held_back and self._held_back[0][0] <= now:
            _, token, res = heapq.heappop(self._held_back)
            self._complete(token, res)
            n += 1
        return n

    def held_back_s(self) -> float | None:
        """Seconds until the first held-back completion is due; None if none is held back."""
        return max(0.0, self._held_back[0][0] - time.monotonic()) if self._held_back else None

    def fileno(self) -> int:
        """The io_uring's descriptor: it polls readable while completions wait to be reaped."""
        return self.lib.chm_ring_fd(self._ring)

    def is_done(self, token: int) -> bool:
        return token in self._results

    def wait(self, token: int) -> int:
        """Block until the operation behind ``token`` is complete; return its byte count, or raise
        its MediaIOError (errno, file, offset, length)."""
        while token not in self._results:
            if token not in self._ops_of:
                raise ChmError(errno.EINVAL, f"unknown media I/O token {token}")
            self._push()
            self._reap(1)
        res = self._results.pop(token)
        if isinstance(res, MediaIOError):
            raise res
        return res

    def wait_all(self) -> None:
        """Until every submitted operation has completed (results stay for their waiters)."""
        while self._queued or self._inflight or self._injected or self._held_back:
            self._push()
            self._reap(1)

    def sync(self) -> None:
        """Make everything written durable on the media files."""
        self.wait_all()
        for fd, path in zip(self.fds, self.paths):
            try:
                os.fdatasync(fd)
            except OSError as exc:
                raise MediaIOError(exc.errno or errno.EIO, "fdatasync", path) from None

    def _close_files(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def close(self, clean: bool = True) -> None:
        """Sync and release the media; with ``clean`` (nothing was left unflushed) mark the shutdown clean.
        Resources are released even when the sync fails; the failure is raised after."""
        if self._ring is None:
            return
        try:
            self.sync()
            if clean:
                media.mark_clean(self.media_dir, self.meta)
        finally:
            self.lib.chm_ring_close(self._ring)
            self._ring = None
            self._close_files()
