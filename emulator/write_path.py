"""The controller's write path: admission, the pages' frames and their bytes, in C where the native data-off
path runs (controller.py's docstring) and in Python otherwise. Methods of Controller.
"""

from __future__ import annotations

from .errors import ChmError
from .native import lib
from .outcomes import WriteOutcome, _all_pinned, _tuple_new, _write_refused, _write_too_big
from .ssd import MediaIOError

_dev_write = lib.chm_dev_write


class WritePath:
    """``write`` and its per-page steps (a Controller mixin)."""

    def write(self, addr: int, data: memoryview | None, length: int, now: float, whole: bool = True) -> WriteOutcome:
        """Write ``length`` bytes (``data``, or nothing when data is off) at ``addr``; returns the finish time
        and its pages (WriteOutcome).

        Raises WriteBufferFull, having written nothing, when the policy refuses; its ``new_pages`` is the
        write-buffer pages the write asked for. ``whole`` as for ``read``.
        """
        self.check_range(addr, length)
        dev = self.flusher.dev
        if dev is not None:
            res = self._write_result
            rc = _dev_write(dev, addr, length, now, whole, res)
            self._fold_ops()
            if rc == 0:
                return _tuple_new(WriteOutcome, (res.finish, res.new_pages, res.pages - res.new_pages,
                                                 self.policy.write_buffer_pages))
            self._native_write_failed(rc, res, addr, length)
        self.tick(now)
        if self.flusher.media_error is not None:
            self.stats["media_refused_writes"] += 1
            raise self.flusher.refuse_write(f"write of {length} bytes at {addr}")
        pages = self._pages(addr, length)
        new_pages = sum(1 for p in pages if self.policy.write_lookup(p) is None)
        if new_pages > self.cfg.write_buffer_frames > 0:
            raise _write_too_big(addr, length, new_pages, self.cfg.write_buffer_frames)
        if not self.policy.admit_writes(new_pages):
            self.stats["refused_writes"] += 1
            self.stats["refused_write_bytes"] += length
            raise _write_refused(addr, length, new_pages)
        self.stats["write_bytes"] += length
        arrived = self.timing.link_to_device.transfer(now, length)  # a refused write moves no payload
        t = self._cycles(arrived, self.cfg.controller.cycles_per_command + len(pages) * self.cfg.controller.cycles_per_admission)
        finish = t
        for page in pages:
            lo = max(addr, page * self.page) - page * self.page
            hi = min(addr + length, (page + 1) * self.page) - page * self.page
            src = None if data is None else data[page * self.page + lo - addr: page * self.page + hi - addr]
            finish = max(finish, self._write_page(page, lo, hi, src, t))
        if whole:
            self.count_command("write", finish - now)
        return _tuple_new(WriteOutcome, (finish, new_pages, len(pages) - new_pages, self.policy.write_buffer_pages))

    def _native_write_failed(self, rc: int, res, addr: int, length: int):
        """Raise what ``write`` raises where ``chm_dev_write`` stopped with status ``rc``."""
        if rc == lib.CHM_WRITE_TOO_BIG:
            raise _write_too_big(addr, length, res.new_pages, self.cfg.write_buffer_frames)
        if rc == lib.CHM_WRITE_REFUSED:
            raise _write_refused(addr, length, res.new_pages)
        if rc == lib.CHM_NO_FRAME:
            raise _all_pinned("write", res.page)
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(f"write of {length} bytes at {addr}: no memory for the native path's state")
        raise RuntimeError(f"write of {length} bytes at {addr}: native status {rc}")

    def _write_page(self, page: int, lo: int, hi: int, src: memoryview | None, now: float) -> float:
        frames, read_error = self.frames, self.read_error
        frame = self.policy.write_lookup(page)
        ready = now
        if frame is None:
            ins, now = self._allocate(self.policy.allocate_write, page, now, "write")
            frame = ins.frame
            ready = self._take_frame(ins, now)
            self.ready_at[frame] = now
            if hi - lo < self.page:  # partial page: the rest must come from DRAM's staged copy or the media
                ready = max(ready, self._fill_partial(frame, page, now))
        else:
            frames.settle(frame)
            if frame in read_error:
                if hi - lo < self.page:
                    frames.check_read(frame)  # the rest of the page could not be read: nothing to merge with
                del read_error[frame]  # the write supplies every byte
            self.flusher.wait_flush_of(frame)
            self.policy.touch(frame)
        copy = self.policy.read_copy(page)
        for target in {frame, copy} - {None}:
            frames.settle(target)
            if src is not None:
                frames.view(target, lo, hi)[:] = src
        frames.write_seq[frame] += 1
        self.policy.mark_dirty(frame)
        self.flusher.enqueue(frame, now)
        return self.timing.dram.transfer(max(ready, self.ready_at[frame]), hi - lo)

    def _fill_partial(self, frame: int, page: int, now: float) -> float:
        copy = self.policy.read_copy(page)
        if copy is not None and copy != frame:
            self.frames.settle(copy)
            if self.data:
                self.frames.view(frame)[:] = self.frames.view(copy)
            return max(now, self.ready_at[copy])
        self.stats["rmw_reads"] += 1
        done, token = self.media.read(frame, page, now)
        if token is not None:
            try:
                self.media.wait(token)
            except MediaIOError as exc:  # the frame holds no valid copy of the page: give it up, fail the write
                self.stats["read_failures"] += 1
                self.policy.flushed(frame)  # not dirty; hymcache returns the write-buffer frame
                if self.policy.page_of(frame) is not None:
                    self.read_error[frame] = exc  # lru: dropped once unpinned
                raise ChmError(exc.errno, f"write needs the rest of page {page} from the media: {exc.message}") from None
        return done
