"""DRAM-management policies: what lives in device DRAM, chosen by name.

A policy owns the frame tables of its DRAM areas and answers a few questions
for the controller (in the spirit of libCacheSim's cache operations): where a
page is, which frame a page should be staged or written into (and whom that
evicts), whether a write is admitted, what happens when a flush or a
prefetch release completes, and how much dirty data to flush now.

Frames are global DRAM frame numbers (frame ``f`` is bytes
``[f * page, (f + 1) * page)`` of the DRAM region).
"""

from __future__ import annotations

from typing import Sequence

from .config import Config
from .frame_table import FrameTable, Inserted
from .write_buffer import FlushArbiter, WriteAdmission


class Area:
    """A contiguous run of DRAM frames managed by one frame table."""

    def __init__(self, base: int, frames: int):
        self.base = base
        self.end = base + frames
        self.table = FrameTable(frames)

    def __contains__(self, frame: int) -> bool:
        return self.base <= frame < self.end

    def lookup(self, page: int) -> int | None:
        local = self.table.lookup(page)
        return None if local is None else self.base + local

    def insert(self, page: int) -> Inserted | None:
        ins = self.table.insert(page)
        return None if ins is None else ins._replace(frame=self.base + ins.frame)


class Policy:
    """Base: one area (all of DRAM) used as a cache; subclasses refine."""

    name = "base"
    # Most flushed pages in flight before a background flush waits (None: no bound, flushes queue up on the SSDs).
    flush_pages_in_flight: int | None = None

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.read_area = Area(0, cfg.read_staging_frames)
        self.areas: list[Area] = [self.read_area]

    # -- where things are --------------------------------------------------------
    def area_of(self, frame: int) -> Area:
        for a in self.areas:  # a plain loop: this is the hottest call of a trace replay
            if a.base <= frame < a.end:
                return a
        raise ValueError(f"frame {frame} is in no DRAM area")

    def lookup(self, page: int) -> int | None:
        """The frame holding the page's newest data, if resident."""
        return self.read_area.lookup(page)

    def staged_lookup(self, page: int) -> int | None:
        """The page's frame in the read-staging area, if there."""
        return self.read_area.lookup(page)

    def write_lookup(self, page: int) -> int | None:
        """The page's frame on the write path (a write there needs no new admission), if any."""
        return self.read_area.lookup(page)

    def read_copy(self, page: int) -> int | None:
        """A second (clean, staged) copy that writes must keep current; None if there is none."""
        return None

    def page_of(self, frame: int) -> int | None:
        area = self.area_of(frame)
        return area.table.page_of[frame - area.base]

    # -- per-frame bookkeeping, forwarded to the owning table -----------------------
    def touch(self, frame: int) -> None:
        area = self.area_of(frame)
        area.table.touch(frame - area.base)

    def pin(self, frame: int) -> None:
        area = self.area_of(frame)
        area.table.pin(frame - area.base)

    def unpin(self, frame: int) -> None:
        area = self.area_of(frame)
        area.table.unpin(frame - area.base)

    def pins(self, frame: int) -> int:
        area = self.area_of(frame)
        return area.table.pins[frame - area.base]

    def mark_dirty(self, frame: int) -> None:
        area = self.area_of(frame)
        area.table.mark_dirty(frame - area.base)

    # -- decisions -------------------------------------------------------------------
    def allocate_clean(self, page: int) -> Inserted | None:
        """A frame to stage a clean page into (may evict; None if all are pinned)."""
        return self.read_area.insert(page)

    def admit_writes(self, new_pages: int) -> bool:
        """May ``new_pages`` pages not yet in the write path be written now?"""
        return True

    def allocate_write(self, page: int) -> Inserted | None:
        return self.allocate_clean(page)

    def flushed(self, frame: int) -> None:
        """A flush of ``frame`` completed and nothing rewrote it meanwhile."""
        area = self.area_of(frame)
        area.table.clear_dirty(frame - area.base)

    def released(self, frame: int) -> None:
        """A prefetch handle let go of ``frame``."""

    def flush_grant(self, dirty: Sequence[tuple[int, float]], now: float, reads_in_flight: int, force: bool) -> int:
        """How many of the queued dirty pages ``dirty`` ((frame, write time), oldest first) to flush now."""
        raise NotImplementedError


class LruPolicy(Policy):
    """Stock transparent cache (CMM-H): demand staging, LRU replacement, and
    dirty pages propagated to flash ``lru_writeback_delay_ns`` after the write,
    whatever the reads are doing."""

    name = "lru"

    def flush_grant(self, dirty, now, reads_in_flight, force):
        if force:
            return len(dirty)
        due_before = now - self.cfg.policy.lru_writeback_delay_ns
        n = 0
        for _, since in dirty:
            if since > due_before:
                break
            n += 1
        return n


class HymCachePolicy(Policy):
    """HyMCache: DRAM split at deployment into a read-staging area and a write
    buffer. Staged objects are dropped when released (read once, in order);
    writes are admitted only into free write-buffer frames, and flushed in
    batches while reads are idle, which frees their frames."""

    name = "hymcache"
    # Read-prioritized: at most this many flush batches queued on the SSDs, so a read arriving after an
    # idle moment finds a bounded amount of write work ahead of it, not the whole write buffer.
    FLUSH_BATCHES_IN_FLIGHT = 1

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.write_area = Area(cfg.read_staging_frames, cfg.write_buffer_frames)
        self.areas.append(self.write_area)
        self.admission = WriteAdmission(cfg.write_buffer_frames)
        self._free_when_unpinned: set[int] = set()
        page = cfg.device.page_size_bytes
        self.arbiter = FlushArbiter(cfg.policy.flush_batch_bytes // page, cfg.policy.flush_max_reads_in_flight,
                                    cfg.policy.flush_max_delay_ns)
        self.flush_pages_in_flight = self.FLUSH_BATCHES_IN_FLIGHT * self.arbiter.batch_pages

    def lookup(self, page):
        frame = self.write_area.lookup(page)
        return self.read_area.lookup(page) if frame is None else frame

    def write_lookup(self, page):
        return self.write_area.lookup(page)

    def read_copy(self, page):
        return self.read_area.lookup(page)

    def admit_writes(self, new_pages):
        return self.admission.admit(new_pages)

    def allocate_write(self, page):
        return self.write_area.insert(page)  # admitted pages always find a free frame

    def flushed(self, frame):
        super().flushed(frame)
        if frame in self.write_area:
            if self.pins(frame):  # a read is copying out of it right now: free it when that ends
                self._free_when_unpinned.add(frame)
            else:
                self._free_write_frame(frame)

    def unpin(self, frame):
        super().unpin(frame)
        if frame in self._free_when_unpinned and self.pins(frame) == 0:
            self._free_when_unpinned.discard(frame)
            self._free_write_frame(frame)

    def mark_dirty(self, frame):
        super().mark_dirty(frame)
        self._free_when_unpinned.discard(frame)  # rewritten before it was freed: it stays

    def _free_write_frame(self, frame):
        self.write_area.table.invalidate(frame - self.write_area.base)
        self.admission.release(1)

    def released(self, frame):
        if frame in self.read_area and self.pins(frame) == 0:
            self.read_area.table.invalidate(frame - self.read_area.base)

    def flush_grant(self, dirty, now, reads_in_flight, force):
        oldest_age = now - dirty[0][1] if dirty else 0.0
        return self.arbiter.grant(len(dirty), reads_in_flight, oldest_age, force)


POLICIES = {cls.name: cls for cls in (LruPolicy, HymCachePolicy)}


def make_policy(cfg: Config) -> Policy:
    return POLICIES[cfg.policy.name](cfg)
