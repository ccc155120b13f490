"""What a replay reports: the rows, their total, the device's and the Master's counters, the run's speed."""

from __future__ import annotations

import resource

import numpy as np

from .bucket import Bucket
from .variants import replay_label


class ReplayResult:
    """Replay's report (a mixin of ``driver.Replay``)."""

    def _result(self, t_start: float, t_end: float, wall_s: float, cpu_s: float) -> dict:
        window = self.bucket_ns if self.by_time else None
        flops_per_s = self.prefill.gpu.flops_per_s
        rows = [self.buckets[k].row(window, flops_per_s) for k in sorted(self.buckets)] if self.by_time else \
            [b.row(None, flops_per_s) for b in self.buckets.values()]
        total = Bucket("total", start_ns=t_start)
        for b in self.buckets.values():
            for name in Bucket.SUMMED:
                setattr(total, name, getattr(total, name) + getattr(b, name))
            total.first_read, total.last_read = min(total.first_read, b.first_read), max(total.last_read, b.last_read)
            total.first_write, total.last_write = min(total.first_write, b.first_write), max(total.last_write, b.last_write)
            total.read_latency_ns.extend(b.read_latency_ns)
        native_rows = [b.latency_counts for b in self.buckets.values() if b.latency_counts is not None]
        if native_rows:
            values = np.concatenate([v for v, _ in native_rows])
            order = np.argsort(values, kind="stable")
            total.latency_counts = (values[order], np.concatenate([c for _, c in native_rows])[order])
        snap = self.ctl.snapshot()
        page = self.cfg.device.page_size_bytes
        block_ops = total.reads + total.writes + total.refused_writes
        page_ops = snap["page_hits"] + snap["page_misses"] + snap["merged_misses"] + snap["prefetch_staged_pages"] \
            + snap["prefetch_resident_pages"] + snap["write_bytes"] // page
        device_policy = self.cfg.policy.name
        read_pages, write_pages = total.hit_pages + total.miss_pages, total.write_hit_pages + total.write_miss_pages
        misses = total.miss_pages + total.write_miss_pages
        total_row = total.row(None, flops_per_s)
        if self.by_time:  # first to last read of the run
            total_row.update(total.recompute_columns(True, flops_per_s))
        else:  # the turns' device read times add up (the barrier separates them)
            total_row["read_s"] = sum(row["read_s"] for row in rows)
            total_row["serve_s"] = total_row["read_s"] + total_row["recompute_s"]
        return {
            "policy": self.variant,
            "device_policy": device_policy,
            "label": replay_label(self.variant, device_policy),
            "sequential": self.sequential,
            "profile": self.cfg.source,
            "workload": {"name": self.workload.name, "block_bytes": self.block_bytes, **self.workload.describe()},
            "window_blocks": self.window_blocks if self.prefetching else None,
            "link_gbps": self.cfg.host_link.bandwidth_gbps,
            "dram_bytes": self.cfg.dram.size_bytes,
            "bucket_by": "time" if self.by_time else "phase",
            "bucket_s": self.bucket_ns / 1e9 if self.by_time else None,
            "rows": rows,
            "total": total_row,
            "recompute": self.prefill.describe(),
            "virtual_s": (t_end - t_start) / 1e9,
            "dram": {
                "peak_staged_bytes": self.peak_staged_pages * page,
                "peak_write_buffer_bytes": self.peak_write_buffer_pages * page,
                "write_buffer_bytes": self.cfg.write_buffer_frames * page,
                "window_bound_bytes": self._window_bound(),
            },
            "device": {k: snap[k] for k in ("page_hits", "page_misses", "merged_misses", "prefetch_staged_pages",
                                            "prefetch_resident_pages", "evictions", "dirty_evictions", "flushed_pages",
                                            "slowed_reads", "refused_writes", "ssd_read_bytes", "ssd_write_bytes")},
            # the host side (the runtime's Master): blocks it evicted to make room (the field's name predates it)
            "host_index_evictions": self.master.counters["evictions"],
            "master": self._master_counts(),
            # the DRAM as a cache: page accesses (reads and accepted writes) and those that found no frame
            "cache": {"accesses": read_pages + write_pages, "misses": misses, "read_misses": total.miss_pages,
                      "write_misses": total.write_miss_pages,
                      "miss_ratio": misses / (read_pages + write_pages) if read_pages + write_pages else 0.0},
            "speed": {"wall_s": wall_s, "cpu_s": cpu_s, "block_accesses": block_ops, "page_accesses": page_ops,
                      "background_events": self.ctl.events_run,
                      "block_accesses_per_s": block_ops / wall_s if wall_s else 0.0,
                      "page_accesses_per_s": page_ops / wall_s if wall_s else 0.0,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
        }

    def _master_counts(self) -> dict:
        """What the Master decided: its counters as they stand (no expiry run for the asking)."""
        c, m = self.master.counters, self.master
        return {"evictions": c["evictions"], "registered_blocks": c["registered_blocks"],
                "refused_revoked": self.revoked, "put_timeouts": c["revoked_blocks"] - self.revoked,
                "no_space_puts": self.no_space_puts, "lookup_hits": c["lookup_hits"],
                "settings": {k: getattr(m, k) for k in ("lease_s", "lease_max_s", "put_timeout_s", "high_watermark",
                                                        "low_watermark")}}

    def _window_bound(self) -> int | None:
        """Most staged bytes the per-request windows allow at the workload's concurrency."""
        if not self.prefetching:
            return None
        concurrency = getattr(self.workload, "concurrency", None)
        slot = self.slot_bytes
        device_bound = self.cfg.policy.prefetch_window_bytes
        return device_bound if concurrency is None else min(device_bound, concurrency * self.window_blocks * slot)
