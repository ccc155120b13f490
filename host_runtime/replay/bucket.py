"""One report row's accumulators: a turn of a workload, or a window of virtual time."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np


@dataclass
class Bucket:
    """One report row's accumulators (a turn, or a window of virtual time)."""

    label: str
    start_ns: float = math.inf
    end_ns: float = 0.0
    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    refused_writes: int = 0
    hit_pages: int = 0  # read pages found in DRAM (or already being staged)
    miss_pages: int = 0  # read pages staged from the SSDs
    write_hit_pages: int = 0  # written pages that already had a frame
    write_miss_pages: int = 0  # written pages that needed a new frame (a first touch: a cache miss)
    prefetch_busy: int = 0
    recomputed_blocks: int = 0  # reusable blocks of the row's requests that the device did not serve
    recompute_flops: float = 0.0  # their prefill FLOPs (prefill.PrefillModel)
    first_read: float = math.inf
    last_read: float = 0.0
    first_write: float = math.inf
    last_write: float = 0.0
    read_latency_ns: array = field(default_factory=lambda: array("d"))
    # the native loop's: the distinct latencies, ascending, and how often each came (instead of read_latency_ns)
    latency_counts: tuple | None = None
    # the accumulators a total adds up, and the ones it takes the earliest / latest of
    SUMMED: ClassVar[tuple[str, ...]] = ("reads", "writes", "read_bytes", "write_bytes", "refused_writes", "hit_pages",
                                         "miss_pages", "write_hit_pages", "write_miss_pages", "prefetch_busy",
                                         "recomputed_blocks", "recompute_flops")
    SPANS: ClassVar[tuple[str, ...]] = ("first_read", "last_read", "first_write", "last_write")

    def percentile_ms(self, p: float) -> float:
        """The p-th percentile read latency (ms): the sorted latencies' element ``int(p / 100 * n)``."""
        if self.latency_counts is None:
            lat = sorted(self.read_latency_ns)
            return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] / 1e6 if lat else 0.0
        values, counts = self.latency_counts
        cumulative = np.cumsum(counts)
        n = int(cumulative[-1]) if len(cumulative) else 0
        if not n:
            return 0.0
        return float(values[np.searchsorted(cumulative, min(n - 1, int(p / 100 * n)), side="right")]) / 1e6

    def row(self, window_ns: float | None, flops_per_s: float = math.inf) -> dict:
        def gbps(nbytes, span):  # GB/s is bytes per ns
            return nbytes / span if span > 0 else 0.0

        pct = self.percentile_ms

        pages = self.hit_pages + self.miss_pages
        return {
            "bucket": self.label,
            "read_gbps": gbps(self.read_bytes, window_ns or self.last_read - self.first_read),
            "write_gbps": gbps(self.write_bytes, window_ns or self.last_write - self.first_write),
            "hit_rate": self.hit_pages / pages if pages else 0.0,
            "blocks_read": self.reads, "blocks_written": self.writes, "refused_writes": self.refused_writes,
            "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
            "hit_pages": self.hit_pages, "miss_pages": self.miss_pages,
            "write_hit_pages": self.write_hit_pages, "write_miss_pages": self.write_miss_pages,
            "prefetch_busy": self.prefetch_busy,
            "read_p50_ms": pct(50), "read_p99_ms": pct(99),
            "span_s": (max(self.last_read, self.last_write) - self.start_ns) / 1e9 if self.start_ns < math.inf else 0.0,
            **self.recompute_columns(window_ns is not None, flops_per_s),
        }

    def recompute_columns(self, by_time: bool, flops_per_s: float) -> dict:
        """The cost of what was not served (driver module docstring): blocks, their prefill time, read and serve time."""
        if not self.reads:
            read_s = 0.0
        else:
            read_s = (self.last_read - (self.first_read if by_time else self.start_ns)) / 1e9
        recompute_s = self.recompute_flops / flops_per_s
        return {"recomputed_blocks": self.recomputed_blocks, "recompute_flops": self.recompute_flops,
                "recompute_s": recompute_s, "read_s": read_s, "serve_s": read_s + recompute_s}
