"""The device DRAM: its bytes (a shared-memory region) and the state of each frame.

Frame states (per DRAM frame, in ``Frames``):
* ``ready_at[f]`` -- virtual time the frame's data is in DRAM (later than now:
  the page is still being staged; a second access then is a merged miss);
* ``io_token[f]`` -- the real media read filling the frame, until settled (``NO_TOKEN``: settled);
* ``write_seq[f]`` -- bumped by every write, so a flush that completes after a
  newer write does not mark the frame clean;
* a frame being flushed is pinned until its flush completes (the flusher's pin);
* ``read_error[f]`` -- the media error of a staging read that failed: reads of
  the frame raise it until the frame is dropped (once nobody pins it).
"""

from __future__ import annotations

import mmap
import os
from array import array

from .errors import ChmError
from .media_io import MediaIO
from .native import lib
from .policies import Policy
from .ssd import MediaIOError

NO_TOKEN = lib.CHM_NO_TOKEN  # io_token of a frame with no media read outstanding


class DramRegion:
    """The device DRAM: one shared-memory region (a memfd, so other processes
    can map it), page-aligned so media I/O can land in it with O_DIRECT."""

    def __init__(self, size: int, ffi):
        self.size = size
        self.fd = os.memfd_create("chm-dram", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.view = memoryview(self.map)
        self._cdata = ffi.from_buffer(self.map)
        self.base_addr = int(ffi.cast("uintptr_t", self._cdata))

    def close(self) -> None:
        self.view.release()
        del self._cdata
        self.map.close()
        os.close(self.fd)


class Frames:
    """Per-frame state of the device DRAM (see the module docstring) and the settling of staging reads.

    ``ready_at``, ``io_token`` and ``write_seq`` are arrays, not lists: the native hit read and the native
    sequential path (``Controller.run_sequential``) use them in place (so they never change size). They and
    ``read_error`` are never rebound, so others may hold them."""

    def __init__(self, count: int, page: int, region: DramRegion | None, media: MediaIO, policy: Policy,
                 stats: dict, log):
        self.page = page
        self.region = region  # None when emulation.data is off (no bytes move)
        self.media, self.policy, self.stats, self.log = media, policy, stats, log
        self.ready_at = array("d", bytes(8 * count))
        self.io_token = array("q", bytes(8 * count))  # all NO_TOKEN
        self.write_seq = array("q", bytes(8 * count))
        self.read_error: dict[int, ChmError] = {}
        self._read_error_logged: tuple | None = None  # (errno, file) last logged: each kind once in a row
        # chm_mmap's hooks (emulator/serve/mapping.py), None without mappings: before_snapshot(frame) runs
        # before a frame's bytes are written to the media (clients' writes must trap again after it);
        # before_reuse(frame) before a frame receives another page's bytes (clients' mappings must go).
        self.before_snapshot = None
        self.before_reuse = None

    def view(self, frame: int, start: int = 0, end: int | None = None) -> memoryview:
        """The bytes [start, end) of ``frame`` (to its end when ``end`` is None)."""
        base = frame * self.page
        return self.region.view[base + start: base + (self.page if end is None else end)]

    def settle(self, frame: int) -> None:
        """Make sure a frame's staging read has really landed (a failure is kept in ``read_error``)."""
        token = self.io_token[frame]
        if token != NO_TOKEN:
            self.io_token[frame] = NO_TOKEN
            try:
                self.media.wait(token)
            except MediaIOError as exc:
                self.read_error[frame] = exc
                self.stats["read_failures"] += 1
                if self._read_error_logged != (exc.errno, exc.path):
                    self._read_error_logged = (exc.errno, exc.path)
                    self.log(f"media error on a staging read: {exc.message}")

    def check_read(self, frame: int) -> None:
        """Raise the media error of the frame's staging read, if it failed."""
        exc = self.read_error.get(frame)
        if exc is not None:
            raise ChmError(exc.errno, exc.message)

    def reuse(self, frame: int) -> None:
        """The policy gave ``frame`` to another page: its earlier read must have landed, and its error goes."""
        self.settle(frame)
        self.read_error.pop(frame, None)
        if self.before_reuse is not None:
            self.before_reuse(frame)

    def drop_failed_reads(self, queued: bytearray) -> None:
        """Frames whose staging read failed leave DRAM once nobody pins them (and no flush waits on them:
        ``queued``), so a later read retries the media."""
        policy = self.policy
        for frame in list(self.read_error):
            page = policy.page_of(frame)
            if page is None:
                del self.read_error[frame]
            elif policy.pins(frame) == 0 and not queued[frame] and not policy.is_dirty(frame):
                policy.drop(frame)
                del self.read_error[frame]

    def close(self) -> None:
        """Unmap the region (no read may reach it after)."""
        if self.region is not None:
            self.region.close()
            self.region = None
