"""``hymcache``: DRAM split into a read-staging area and a write buffer (the HyMCache design)."""

from __future__ import annotations

from common.units import format_bytes

from ..write_buffer import FlushArbiter, WriteAdmission
from . import register
from .base import Area, Policy


class HymCachePolicy(Policy):
    """HyMCache: DRAM split at deployment into a read-staging area and a write
    buffer. Staged objects are dropped when released (read once, in order);
    writes are admitted only into free write-buffer frames, and flushed in
    batches while reads are idle, which frees their frames. The read-staging
    area evicts its unpinned pages by LRU (demand reads)."""

    name = "hymcache"
    splits_dram = True
    drops_staged_on_release = True
    refuses_writes = True
    # Read-prioritized: at most this many flush batches queued on the SSDs, so a read arriving after an
    # idle moment finds a bounded amount of write work ahead of it, not the whole write buffer.
    FLUSH_BATCHES_IN_FLIGHT = 1

    def __init__(self, cfg):
        super().__init__(cfg)
        self.write_area = self.add_area(Area(cfg.read_staging_frames, cfg.write_buffer_frames))
        self.admission = WriteAdmission(cfg.write_buffer_frames)
        # by frame: 1 for a flushed write-buffer frame a read holds, freed once unpinned (a bytearray the native
        # flusher shares: emulator/flusher.py)
        self._free_when_unpinned = bytearray(cfg.dram_frames)
        page = cfg.device.page_size_bytes
        self.arbiter = FlushArbiter(cfg.policy.flush_batch_bytes // page, cfg.policy.flush_max_reads_in_flight,
                                    cfg.policy.flush_max_delay_ns)
        self.flush_pages_in_flight = self.FLUSH_BATCHES_IN_FLIGHT * self.arbiter.batch_pages

    @classmethod
    def describe(cls, cfg):
        page = cfg.device.page_size_bytes
        return (f"{cls.name} (write buffer {format_bytes(cfg.write_buffer_frames * page)}, "
                f"read staging {format_bytes(cfg.read_staging_frames * page)})")

    @classmethod
    def check_config(cls, cfg, need):
        page = cfg.device.page_size_bytes
        need(cfg.write_buffer_frames >= 1,
             f"policy.write_buffer_fraction = {cfg.policy.write_buffer_fraction} leaves no write-buffer frame "
             f"out of {cfg.dram_frames} ({cls.name} needs at least 1)")
        need(cfg.policy.flush_batch_bytes <= cfg.write_buffer_frames * page,
             f"policy.flush_batch_bytes = {cfg.policy.flush_batch_bytes} exceeds the write buffer "
             f"({cfg.write_buffer_frames} frames of {page} bytes)")

    def native_lookup_areas(self):
        # lookup's order: the newest copy of a written page is in the write buffer
        return self._native_areas(HymCachePolicy.lookup, [self.write_area, self.read_area])

    @property
    def write_buffer_pages(self):
        return self.admission.used_pages

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
                self._free_when_unpinned[frame] = 1
            else:
                self._free_write_frame(frame)

    def unpin(self, frame):
        super().unpin(frame)
        if self._free_when_unpinned[frame] and self.pins(frame) == 0:
            self._free_when_unpinned[frame] = 0
            self._free_write_frame(frame)

    def mark_dirty(self, frame):
        super().mark_dirty(frame)
        self._free_when_unpinned[frame] = 0  # rewritten before it was freed: it stays

    def _free_write_frame(self, frame):
        self.write_area.table.invalidate(frame - self.write_area.base)
        self.admission.release(1)

    def released(self, frame):
        if frame in self.read_area and self.pins(frame) == 0:
            self.read_area.table.invalidate(frame - self.read_area.base)

    def flush_grant(self, dirty, now, reads_in_flight, force):
        oldest_age = now - dirty[0][1] if dirty else 0.0
        return self.arbiter.grant(len(dirty), reads_in_flight, oldest_age, force)

    def next_flush_at(self, dirty, now, reads_idle_at):
        if not dirty:
            return None
        batch = self.arbiter.batch_pages
        full_at = dirty[batch - 1][1] if len(dirty) >= batch else None  # dirty is in write order
        return self.arbiter.next_grant_at(len(dirty), dirty[0][1], full_at, now, reads_idle_at)


register(HymCachePolicy.name, HymCachePolicy)
