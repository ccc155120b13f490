"""Write admission and the flush arbiter (hymcache's write path).

Reference models for ``rtl_model/chm_write_admission``: admission is a
serialized, all-or-nothing check-and-reserve of write-buffer pages; space
returns when a flush of those pages completes. The arbiter grants the SSDs to
the flusher only while reads are (nearly) idle, and gathers pages into
batches.
"""

from __future__ import annotations


class WriteAdmission:
    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self.used_pages = 0

    @property
    def free_pages(self) -> int:
        return self.capacity_pages - self.used_pages

    def admit(self, pages: int) -> bool:
        """Reserve ``pages`` if all fit; otherwise reserve nothing and refuse."""
        if pages > self.free_pages:
            return False
        self.used_pages += pages
        return True

    def release(self, pages: int) -> None:
        assert 0 <= pages <= self.used_pages, f"release of {pages} pages with {self.used_pages} reserved"
        self.used_pages -= pages


class FlushArbiter:
    def __init__(self, batch_pages: int, max_reads_in_flight: int, max_delay_ns: float):
        self.batch_pages = batch_pages
        self.max_reads_in_flight = max_reads_in_flight
        self.max_delay_ns = max_delay_ns

    def grant(self, dirty_pages: int, reads_in_flight: int, oldest_age_ns: float, force: bool = False) -> int:
        """How many dirty pages to flush now (0: not now).

        ``force`` (flush or shutdown) drains regardless of reads; otherwise a
        batch goes only while reads are idle, and only once it is full or its
        oldest page has waited ``max_delay_ns``.
        """
        if dirty_pages == 0:
            return 0
        if force:
            return min(dirty_pages, self.batch_pages)
        if reads_in_flight > self.max_reads_in_flight:
            return 0
        if dirty_pages >= self.batch_pages:
            return self.batch_pages
        if oldest_age_ns >= self.max_delay_ns:
            return dirty_pages
        return 0
