"""Write admission and the flush arbiter (hymcache's write path).

Reference models for ``rtl_model/chm_write_admission``: admission is a
serialized, all-or-nothing check-and-reserve of write-buffer pages (the
native core's ``chm_admission_*``); space returns when a flush of those pages
completes. The arbiter grants the SSDs to
the flusher only while reads are (nearly) idle, and gathers pages into
batches.
"""

from __future__ import annotations

from typing import Callable

from .native import ffi, lib


class WriteAdmission:
    """The write buffer's page count, in the native core (``struct chm_admission``)."""

    def __init__(self, capacity_pages: int):
        self._c = ffi.new("struct chm_admission *", {"capacity_pages": capacity_pages})

    @property
    def capacity_pages(self) -> int:
        return self._c.capacity_pages

    @property
    def used_pages(self) -> int:
        return self._c.used_pages

    @property
    def free_pages(self) -> int:
        return self._c.capacity_pages - self._c.used_pages

    def admit(self, pages: int) -> bool:
        """Reserve ``pages`` if all fit; otherwise reserve nothing and refuse."""
        return bool(lib.chm_admission_admit(self._c, pages))

    def release(self, pages: int) -> None:
        if pages < 0 or lib.chm_admission_release(self._c, pages):
            raise AssertionError(f"release of {pages} pages with {self.used_pages} reserved")


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
        return lib.chm_arbiter_grant(self.batch_pages, self.max_reads_in_flight, self.max_delay_ns, dirty_pages,
                                     reads_in_flight, oldest_age_ns, force)

    def next_grant_at(self, dirty_pages: int, oldest_written_ns: float, batch_full_ns: float | None, now: float,
                      reads_idle_at: Callable[[int], float]) -> float | None:
        """The earliest time >= ``now`` at which ``grant`` (not forced) gives pages, if nothing is written, read
        or flushed meanwhile; None when nothing is dirty. That is once reads are idle enough
        (``reads_idle_at(n)``: the earliest time >= ``now`` with at most ``n`` in flight) and either the batch
        is full -- from ``batch_full_ns``, when its last page was written (``grant`` counts pages, but a flush
        cannot start before its data is in DRAM) -- or the oldest page, written at ``oldest_written_ns``, has
        waited ``max_delay_ns`` (its age at ``t`` is ``t - oldest_written_ns``, as ``grant`` is given it)."""
        if dirty_pages == 0:
            return None
        ready = lib.chm_arbiter_ready_at(self.batch_pages, self.max_delay_ns, dirty_pages, oldest_written_ns,
                                         0.0 if batch_full_ns is None else batch_full_ns)
        return max(now, ready, reads_idle_at(self.max_reads_in_flight))
