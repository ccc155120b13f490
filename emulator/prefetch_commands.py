"""The controller's prefetch commands: prefetch (stage an object, pinned), wait (until it is staged),
release (unpin it), in C where the native data-off path runs (controller.py's docstring). Methods of
Controller.
"""

from __future__ import annotations

import errno

from .dram import NO_TOKEN
from .errors import ChmError
from .native import ffi, lib
from .outcomes import PrefetchOutcome, Staged, _all_pinned, _tuple_new

_dev_prefetch_fetch = lib.chm_dev_prefetch_fetch


class PrefetchCommands:
    """``prefetch``, ``wait``, ``wait_would_block`` and ``release`` (a Controller mixin)."""

    def prefetch(self, addr: int, size: int, now: float) -> PrefetchOutcome:
        """Stage an object; returns its handle, the time the command is acknowledged and its pages
        (PrefetchOutcome)."""
        self.check_range(addr, size, "size")
        self.tick(now)
        pages = self._pages(addr, size)
        handle = self._next_handle
        self.engine.issue(handle, pages.start, len(pages))
        self._next_handle += 1
        self.stats["prefetches"] += 1
        self.stats["prefetch_bytes"] += size
        t = self._cycles(now, self.cfg.controller.cycles_per_command)
        dev = self.flusher.dev
        if dev is not None:  # the fetch loop in C (module docstring, "Native data-off path")
            buf = self._prefetch_frames
            if len(pages) > len(buf):
                buf = self._prefetch_frames = ffi.new("uint32_t[]", len(pages))
            res = self._prefetch_result
            rc = _dev_prefetch_fetch(dev, self.engine._c, t, buf, res)
            self._fold_ops()
            staged, resident = res.staged, res.resident
            self.stats["prefetch_staged_pages"] += staged
            self.stats["prefetch_resident_pages"] += resident
            if rc:
                if rc == lib.CHM_NO_FRAME:
                    raise _all_pinned("stage", res.page)
                raise MemoryError(f"prefetch of {size} bytes at {addr}: no memory for the native path's state")
            self.staged[handle] = Staged(ffi.unpack(buf, res.frames), res.ready_at)
            return _tuple_new(PrefetchOutcome, (handle, res.t + self.cfg.host_link.latency_ns, staged, resident,
                                                self.engine.pages_held))
        frames, ready_at = [], t
        staged = resident = 0
        try:
            while (fetch := self.engine.next_fetch()) is not None:
                page = fetch[1]
                t = self._cycles(t, self.cfg.controller.cycles_per_prefetch_page)
                frame = self.policy.staged_lookup(page)
                if frame is None and self.policy.lookup(page) is not None:
                    resident += 1  # newest data sits in the write buffer
                    continue
                if frame is None:
                    staged += 1
                    frame = self._stage(page, t)
                else:
                    resident += 1
                    self.policy.touch(frame)
                self.policy.pin(frame)
                frames.append(frame)
                ready_at = max(ready_at, self.ready_at[frame])
        finally:  # counted even when staging fails
            self.stats["prefetch_staged_pages"] += staged
            self.stats["prefetch_resident_pages"] += resident
        self.staged[handle] = Staged(frames, ready_at)
        self.media.poll()  # get the reads going now
        return _tuple_new(PrefetchOutcome, (handle, t + self.cfg.host_link.latency_ns, staged, resident,
                                            self.engine.pages_held))

    def _staged_in_time(self, handle: int, now: float, timeout_ns: float | None) -> Staged:
        """The staged object behind ``handle``; raises as ``wait`` does for an unknown handle or a modelled
        staging later than ``now + timeout_ns``."""
        self.engine.get(handle)  # an unknown handle raises here
        staged = self.staged[handle]
        if timeout_ns is not None and staged.ready_at > now + timeout_ns:
            raise ChmError(errno.ETIMEDOUT, f"prefetch handle {handle} not staged within {timeout_ns / 1e6:g} ms "
                                            f"(ready in {(staged.ready_at - now) / 1e6:.3f} ms of modelled time)")
        return staged

    def wait_would_block(self, handle: int, now: float, timeout_ns: float | None = None) -> bool:
        """Would ``wait`` block on media reads still in flight (real I/O, data on)? Raises what ``wait`` would
        raise before that (unknown handle, ETIMEDOUT). Never blocks: a server parks the wait meanwhile."""
        staged = self._staged_in_time(handle, now, timeout_ns)
        if not self.data:
            return False
        self.media.poll()
        tokens, landed = self.frames.io_token, self.media.landed
        return any(tokens[frame] != NO_TOKEN and not landed(tokens[frame]) for frame in staged.frames)

    def wait(self, handle: int, now: float, timeout_ns: float | None = None) -> float:
        """Until the object is staged; returns when the host learns it (virtual time)."""
        staged = self._staged_in_time(handle, now, timeout_ns)
        if self.data or self.read_error:  # else nothing to settle, no read failed
            for frame in staged.frames:
                self.frames.settle(frame)
            for frame in staged.frames:
                self.frames.check_read(frame)
        self.engine.arrive_all(handle)
        self.tick(now)
        return max(now, staged.ready_at) + self.cfg.host_link.latency_ns

    def release(self, handle: int, now: float) -> float:
        self.engine.release(handle)
        self.stats["releases"] += 1
        dev = self.flusher.dev
        if dev is not None:
            frames = self.staged.pop(handle).frames
            lib.chm_dev_release_frames(dev, ffi.new("uint32_t[]", frames), len(frames))
            self.tick(now)
            return self._cycles(now, self.cfg.controller.cycles_per_command) + self.cfg.host_link.latency_ns
        for frame in self.staged.pop(handle).frames:
            self.frames.settle(frame)
            self.policy.unpin(frame)
            self.policy.released(frame)
        self.tick(now)
        return self._cycles(now, self.cfg.controller.cycles_per_command) + self.cfg.host_link.latency_ns
