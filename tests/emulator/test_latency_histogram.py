"""Per-operation latency statistics: fixed storage and summary cost, percentiles within the documented error."""

import tracemalloc

import numpy as np
import pytest

from emulator import timing
from emulator.timing import LatencyLog


def _order_statistic(values: np.ndarray, p: float) -> float:
    """The sample at rank min(n - 1, int(p / 100 * n)) of the sorted values (what the summary reports)."""
    ordered = np.sort(values)
    return float(ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))])


def test_buckets_tile_the_range_within_the_relative_width():
    hist = timing.LatencyHistogram
    expected_low = 0
    for i in range(hist.BUCKETS):
        low, high = hist.bucket_bounds(i)
        assert low == expected_low, f"bucket {i} leaves a gap or overlaps"
        assert hist.bucket_of(low) == i == hist.bucket_of(high - 1)
        if low >= hist.SUB_BUCKETS:
            assert (high - low) / low <= 2 * hist.RELATIVE_ERROR
        expected_low = high
    assert expected_low == 1 << 64


@pytest.mark.parametrize("dist", ["lognormal", "uniform", "bimodal"])
def test_percentiles_are_within_the_documented_error_of_numpy(dist):
    rng = np.random.default_rng(11)
    n = 50_000
    if dist == "lognormal":
        values = rng.lognormal(mean=np.log(20_000), sigma=1.5, size=n)
    elif dist == "uniform":
        values = rng.uniform(40, 5e6, size=n)
    else:  # DRAM hits and SSD misses
        values = np.concatenate([rng.normal(900, 50, n // 2), rng.normal(80_000, 4_000, n // 2)])
    hist = timing.LatencyHistogram()
    for v in values.tolist():
        hist.add(v)
    for p, got in zip((1, 50, 90, 99, 99.9), hist.percentiles(1, 50, 90, 99, 99.9)):
        want = _order_statistic(values, p)
        assert abs(got - want) <= hist.RELATIVE_ERROR * want, (dist, p, got, want)
    s = hist.summary()
    assert s["count"] == n
    assert s["mean_ns"] == pytest.approx(values.mean(), rel=1e-9)
    assert s["max_ns"] == values.max()


def test_one_value_is_reported_exactly():
    log = LatencyLog()
    log.add("read", 12_345.6)
    assert log.summary() == {"read": {"count": 1, "mean_ns": 12_345.6, "p50_ns": 12_345.6, "p99_ns": 12_345.6,
                                      "max_ns": 12_345.6}}


def _filled(adds: int) -> tuple[LatencyLog, int]:
    """A log after ``adds`` reads, and the bytes it holds (traced allocations while filling it)."""
    values = np.random.default_rng(3).lognormal(np.log(5_000), 1.0, size=adds).tolist()
    tracemalloc.start()
    try:
        log = LatencyLog()
        for v in values:
            log.add("read", v)
        return log, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def _summary_peak_bytes(log: LatencyLog) -> int:
    tracemalloc.start()
    try:
        log.summary()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_storage_and_summary_cost_do_not_grow_with_the_operation_count():
    """A long-running server: after 1,000,000 reads the log holds what it held after 10, and stats() works
    through the same fixed buckets (measured as what the summary allocates, not its time)."""
    few, few_bytes = _filled(10)
    many, many_bytes = _filled(1_000_000)
    assert many.summary()["read"]["count"] == 1_000_000
    assert many_bytes <= few_bytes + 1024, (few_bytes, many_bytes)
    # a fixed budget: the running sum over the buckets; sorting a million kept samples needs megabytes
    budget = 256 * 1024
    assert _summary_peak_bytes(few) <= budget and _summary_peak_bytes(many) <= budget
