"""The timing model: modelled hardware resources with queues, in virtual nanoseconds.

Bytes move for real elsewhere; here only time is computed ("compute, then
hold", as FEMU does). Each resource serves requests in the order they are
reserved; a request gets a start (when the resource is free and the request is
ready) and a finish. Bandwidths are in GB/s, which is bytes per nanosecond.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Sequence

from .config import Config
from .native import ffi, lib

_pipe_transfer, _clocked_run, _histogram_add = lib.chm_pipe_transfer, lib.chm_clocked_run, lib.chm_histogram_add
_ssd_read, _ssd_write, _ssd_reads_in_flight = lib.chm_ssd_read, lib.chm_ssd_write, lib.chm_ssd_reads_in_flight


def earliest_time(guess: float, due: Callable[[float], bool]) -> float:
    """The smallest float time ``t`` with ``due(t)``, for a ``due`` that is monotone in ``t`` and true or
    nearly true at ``guess`` (e.g. ``guess = since + delay`` for ``due = lambda t: t - since >= delay``):
    float rounding can put the exact threshold a few ulps either side of the sum, and a deadline
    must be the very time the rule it mirrors starts to hold."""
    while not due(guess):
        guess = math.nextafter(guess, math.inf)
    while due(below := math.nextafter(guess, -math.inf)):
        guess = below
    return guess


def _struct_field(name: str) -> property:
    """An attribute kept in the object's native struct (``self._c``), where the native core reads it too."""
    return property(lambda self: getattr(self._c, name), lambda self, value: setattr(self._c, name, value))


class Pipe:
    """A serial server with a fixed per-request latency and a bandwidth.

    The latency is pipelined (it does not occupy the pipe); the transfer
    occupies it for bytes / bandwidth. A request's arrival:
    ``free_at = max(ready, free_at) + nbytes / bandwidth * slowdown``, then
    ``free_at + latency_ns * slowdown``.

    The state is a native ``struct chm_pipe`` (emulator/native/chm_core.h), which computes each step as
    written here (the DRAM-hit read in C runs the same pipes).
    """

    __slots__ = ("name", "_c", "_owner")
    latency_ns = _struct_field("latency_ns")
    bandwidth_gbps = _struct_field("bandwidth_gbps")
    free_at = _struct_field("free_at")
    busy_ns = _struct_field("busy_ns")
    bytes = _struct_field("bytes")

    def __init__(self, name: str, latency_ns: float, bandwidth_gbps: float, free_at: float = 0.0,
                 busy_ns: float = 0.0, bytes: int = 0):
        self.name = name
        self._c = ffi.new("struct chm_pipe *", {"latency_ns": latency_ns, "bandwidth_gbps": bandwidth_gbps,
                                                "free_at": free_at, "busy_ns": busy_ns, "bytes": bytes})
        self._owner = None

    @classmethod
    def view(cls, name: str, c, owner) -> Pipe:
        """The pipe whose ``struct chm_pipe`` is ``c``, a part of ``owner`` (kept alive with the view)."""
        pipe = cls.__new__(cls)
        pipe.name, pipe._c, pipe._owner = name, c, owner
        return pipe

    def __repr__(self) -> str:
        return (f"Pipe({self.name!r}, latency_ns={self.latency_ns!r}, bandwidth_gbps={self.bandwidth_gbps!r}, "
                f"free_at={self.free_at!r}, busy_ns={self.busy_ns!r}, bytes={self.bytes!r})")

    def transfer(self, ready: float, nbytes: int, slowdown: float = 1.0) -> float:
        """Reserve the pipe for ``nbytes`` no earlier than ``ready``; return the arrival time."""
        return _pipe_transfer(self._c, ready, nbytes, slowdown)

    def stream(self, ready: Sequence[float], sizes: Sequence[int], slowdown: float = 1.0) -> list[float]:
        """``transfer`` of each piece in turn (piece i no earlier than ready[i]); the arrival of each."""
        c = self._c
        return [_pipe_transfer(c, r, n, slowdown) for r, n in zip(ready, sizes)]


class Clocked:
    """The controller pipeline: work is counted in cycles of its clock; ``run`` occupies it for
    ``cycles * 1000.0 / clock_mhz`` from ``max(ready, free_at)`` (a native ``struct chm_clocked``)."""

    __slots__ = ("name", "_c")
    clock_mhz = _struct_field("clock_mhz")
    free_at = _struct_field("free_at")
    busy_ns = _struct_field("busy_ns")

    def __init__(self, name: str, clock_mhz: float, free_at: float = 0.0, busy_ns: float = 0.0):
        self.name = name
        self._c = ffi.new("struct chm_clocked *", {"clock_mhz": clock_mhz, "free_at": free_at, "busy_ns": busy_ns})

    def __repr__(self) -> str:
        return (f"Clocked({self.name!r}, clock_mhz={self.clock_mhz!r}, free_at={self.free_at!r}, "
                f"busy_ns={self.busy_ns!r})")

    def run(self, ready: float, cycles: int) -> float:
        return _clocked_run(self._c, ready, cycles)


class SsdModel:
    """One SSD: up to ``parallelism`` commands in service, media bandwidth per
    direction, and reads slowed by ``read_slowdown_under_writes`` while any
    write is in flight (program/erase interference).

    A command starts when it is ready and a command slot is free (``_slots``: a min-heap of when each
    frees); a read takes ``read_latency_ns * slow`` and then its bytes through ``read_media`` at
    ``slow`` times the cost, where ``slow`` is the slowdown if a reserved write ends after the read
    starts (``writes_until``), else 1; a write takes ``write_latency_ns`` and then ``write_media``.
    ``reads_in_flight(now)`` counts the reserved reads finishing after ``now``, dropping the others from
    ``_read_finishes`` (a min-heap of read finishes).

    The state is a native ``struct chm_ssd`` (emulator/native/chm_core.h), which computes each step as
    written here, with both heaps laid out as ``heapq`` lays out a list (so the controller's sequential
    path in C runs the same SSDs).
    """

    __slots__ = ("name", "_c", "read_media", "write_media")
    read_latency_ns = _struct_field("read_latency_ns")
    write_latency_ns = _struct_field("write_latency_ns")
    slowdown = _struct_field("slowdown")
    writes_until = _struct_field("writes_until")  # virtual time the last reserved write finishes
    reads_until = _struct_field("reads_until")  # virtual time the last reserved read finishes
    slowed_reads = _struct_field("slowed_reads")
    parallelism = property(lambda self: self._c.parallelism)

    def __init__(self, index: int, cfg: Config):
        s = cfg.ssd
        self.name = f"ssd{index}"
        out = ffi.new("struct chm_ssd **")
        rc = lib.chm_ssd_new(s.parallelism, s.read_latency_ns, s.write_latency_ns, s.read_slowdown_under_writes,
                             s.read_bandwidth_gbps, s.write_bandwidth_gbps, out)
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(f"{self.name}: {s.parallelism} command slots")
        if rc:
            raise ValueError(f"{self.name}: ssd.parallelism = {s.parallelism} must be at least 1")
        self._c = c = ffi.gc(out[0], lib.chm_ssd_free)
        self.read_media = Pipe.view(f"{self.name}.read", ffi.addressof(c, "read_media"), c)
        self.write_media = Pipe.view(f"{self.name}.write", ffi.addressof(c, "write_media"), c)

    @property
    def _slots(self) -> list[float]:
        """When each command slot frees (a heapq min-heap)."""
        c = self._c
        return ffi.unpack(c.slots, c.parallelism)

    @property
    def _read_finishes(self) -> list[float]:
        """The finishes of the reads reserved and not yet dropped by ``reads_in_flight`` (a heapq min-heap)."""
        c = self._c
        return ffi.unpack(c.read_finishes, c.n_read_finishes) if c.n_read_finishes else []

    def read(self, ready: float, nbytes: int) -> float:
        finish = _ssd_read(self._c, ready, nbytes)
        if finish != finish:
            raise MemoryError(f"{self.name}: no room for another read in flight")
        return finish

    def write(self, ready: float, nbytes: int) -> float:
        return _ssd_write(self._c, ready, nbytes)

    def reads_in_flight(self, now: float) -> int:
        return _ssd_reads_in_flight(self._c, now)

    @property
    def busy_ns(self) -> float:
        return self.read_media.busy_ns + self.write_media.busy_ns


class LatencyHistogram:
    """Modelled latencies of one operation kind in a fixed number of log-linear buckets.

    Storage and summary cost do not depend on how many samples were added (a
    server's ``stats()`` must not slow down, nor its memory grow, with uptime).
    Latencies are truncated to whole ns; below ``SUB_BUCKETS`` ns every ns has
    its bucket, above that each power-of-two range [2^e, 2^(e+1)) is cut into
    ``SUB_BUCKETS`` equal buckets, so a bucket is at most 1/32 of its lower
    bound wide. A percentile is reported as the midpoint of the bucket holding
    that rank (clamped to the exact min and max): its error is at most
    ``RELATIVE_ERROR`` (1/64, about 1.6 %) of the true order statistic, or
    0.5 ns below 32 ns. Count, mean and max are exact.

    The buckets and totals are a native ``struct chm_histogram`` (the DRAM-hit read in C adds to the
    same one); ``chm_histogram_bucket`` is the bucket function.
    """

    SUB_BITS = lib.CHM_HIST_SUB_BITS
    SUB_BUCKETS = lib.CHM_HIST_SUB_BUCKETS  # 32 linear sub-buckets per power of two
    RELATIVE_ERROR = 1 / (2 * SUB_BUCKETS)
    BUCKETS = lib.CHM_HIST_BUCKETS  # covers every latency below 2^64 ns (584 years)
    __slots__ = ("_c", "counts")
    count = _struct_field("count")
    total_ns = _struct_field("total_ns")
    min_ns = _struct_field("min_ns")
    max_ns = _struct_field("max_ns")

    def __init__(self):
        self._c = ffi.new("struct chm_histogram *")
        lib.chm_histogram_init(self._c)
        self.counts = memoryview(ffi.buffer(self._c.counts)).cast("Q")

    @classmethod
    def bucket_of(cls, latency_ns: float) -> int:
        return lib.chm_histogram_bucket(min(int(latency_ns), (1 << 64) - 1) if latency_ns > 0 else 0)

    @classmethod
    def bucket_bounds(cls, index: int) -> tuple[int, int]:
        """[low, high) in ns of bucket ``index``."""
        if index < cls.SUB_BUCKETS:
            return index, index + 1
        shift = (index >> cls.SUB_BITS) - 1
        low = (index - (shift << cls.SUB_BITS)) << shift
        return low, low + (1 << shift)

    def add(self, latency_ns: float) -> None:
        _histogram_add(self._c, latency_ns)

    def percentiles(self, *ps: float) -> list[float]:
        """The values at ranks ``min(n - 1, int(p / 100 * n))`` (0-based, in sorted order), within the bucket error."""
        cumulative = list(accumulate(self.counts))
        out = []
        for p in ps:
            rank = min(self.count - 1, int(p / 100.0 * self.count))
            low, high = self.bucket_bounds(bisect_right(cumulative, rank))
            out.append(min(self.max_ns, max(self.min_ns, (low + high) / 2)))
        return out

    def summary(self) -> dict[str, float]:
        p50, p99 = self.percentiles(50, 99)
        return {"count": self.count, "mean_ns": self.total_ns / self.count, "p50_ns": p50, "p99_ns": p99,
                "max_ns": self.max_ns}


@dataclass
class LatencyLog:
    """Per-operation modelled latencies: one fixed-size histogram per operation kind."""

    histograms: dict[str, LatencyHistogram] = field(default_factory=dict)

    def add(self, kind: str, latency_ns: float) -> None:
        h = self.histograms.get(kind)
        if h is None:
            h = self.histograms[kind] = LatencyHistogram()
        _histogram_add(h._c, latency_ns)

    def histogram(self, kind: str) -> LatencyHistogram:
        """The kind's histogram, made empty if it has none yet (summaries leave empty ones out)."""
        h = self.histograms.get(kind)
        if h is None:
            h = self.histograms[kind] = LatencyHistogram()
        return h

    def summary(self) -> dict[str, dict[str, float]]:
        return {kind: h.summary() for kind, h in self.histograms.items() if h.count}


class TimingModel:
    """All modelled resources of one device."""

    def __init__(self, cfg: Config):
        link = cfg.host_link
        self.link_to_host = Pipe("link.to_host", link.latency_ns, link.bandwidth_gbps)
        self.link_to_device = Pipe("link.to_device", link.latency_ns, link.bandwidth_gbps)
        self.controller = Clocked("controller", cfg.controller.clock_mhz)
        self.dram = Pipe("dram", cfg.dram.latency_ns, cfg.dram.bandwidth_gbps)
        self.ssds = [SsdModel(i, cfg) for i in range(cfg.ssd.count)]
        self.latencies = LatencyLog()

    def reads_in_flight(self, now: float) -> int:
        return sum(s.reads_in_flight(now) for s in self.ssds)

    def reads_idle_at(self, now: float, max_in_flight: int = 0) -> float:
        """The earliest time >= ``now`` at which at most ``max_in_flight`` of the SSD reads reserved so far
        are in flight (``reads_in_flight(t) <= max_in_flight`` from then on, until a new read is reserved)."""
        if max_in_flight == 0:  # every read has landed: the last finish (O(SSDs), the common case)
            return max([now] + [s.reads_until for s in self.ssds])
        finishes = [f for s in self.ssds for f in s._read_finishes if f > now]
        if len(finishes) <= max_in_flight:
            return now
        # in flight at t: finishes > t; at most k of them once t reaches the (k+1)-th latest finish
        return heapq.nlargest(max_in_flight + 1, finishes)[-1]

    def busy(self) -> dict[str, float]:
        out = {p.name: p.busy_ns for p in (self.link_to_host, self.link_to_device, self.controller, self.dram)}
        for s in self.ssds:
            out[s.read_media.name] = s.read_media.busy_ns
            out[s.write_media.name] = s.write_media.busy_ns
        return out
