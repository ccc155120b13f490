"""Replay in event-driven virtual time: idle spans cost nothing, so a trace's span does not set its cost.

The device's background work (flushes falling due, flushes landing) runs only at the times it is due,
and each run counts its events (``speed.background_events``): those must not grow with the span.
"""

from __future__ import annotations

import json
from itertools import islice

from emulator.cli import main as chm_main
from emulator.shared_data import mooncake_conversation_trace
from host_runtime.replay import LibCacheSimTrace, MooncakeTrace, Replay, replay_config

from .test_replay_libcachesim import DRAM_OVERRIDES, PAGE, skewed_requests, write_oracle_general

KiB, MiB = 1 << 10, 1 << 20
REQUESTS = 400  # the first requests of the shared trace: ~1 s per replay here
EPOCH_MS = 1_700_000_000_000  # 2023-11-14 in epoch milliseconds, as production traces stamp requests
DAY_MS, YEAR_MS = 86_400_000, 365 * 86_400_000
OVERRIDES = {"dram.size_bytes": 64 * MiB, "policy.prefetch_window_bytes": 8 * MiB}


def first_records() -> list[dict]:
    with mooncake_conversation_trace().open() as f:
        return [json.loads(line) for line in islice(f, REQUESTS)]


def write_trace(path, records, shift_ms=lambda i: 0):
    """The records with each timestamp moved by ``shift_ms(index)``."""
    with path.open("w") as f:
        for i, rec in enumerate(records):
            f.write(json.dumps({**rec, "timestamp": rec["timestamp"] + shift_ms(i)}) + "\n")
    return path


def replay(path, variant, time_scale=1.0) -> dict:
    """The run's result; its wall time is bench/bench_event_time.py's (the cost here is its event count)."""
    trace = MooncakeTrace(path, block_bytes=256 * KiB, tokens_per_block=512, time_scale=time_scale)
    rp = Replay(replay_config("small", variant, OVERRIDES), variant, trace, window_bytes=MiB, progress=False)
    return rp.run()


def same_run(a: dict, b: dict) -> bool:
    """Equal in everything but wall-clock speed."""
    strip = lambda r: {k: v for k, v in r.items() if k not in ("speed", "workload")}  # noqa: E731
    return strip(a) == strip(b) and a["speed"]["background_events"] == b["speed"]["background_events"]


def test_epoch_millisecond_timestamps_replay_like_timestamps_from_zero(tmp_path):
    records = first_records()
    plain = write_trace(tmp_path / "plain.jsonl", records)
    epoch = write_trace(tmp_path / "epoch.jsonl", records, lambda i: EPOCH_MS)
    for variant in ("lru", "hymcache"):
        base = replay(plain, variant)
        shifted = replay(epoch, variant)
        assert same_run(shifted, base), variant  # time counts from the first request, at full resolution
        assert shifted["rows"][0]["bucket"] == "0"


def test_epoch_second_clock_times_of_a_libcachesim_trace_replay_like_times_from_zero(tmp_path):
    requests = skewed_requests(2000, 200, PAGE)
    plain = write_oracle_general(tmp_path / "plain.oracleGeneral", requests)
    epoch = write_oracle_general(tmp_path / "epoch.oracleGeneral", [(EPOCH_MS // 1000 + t, o, n) for t, o, n in requests])
    runs = []
    for path in (plain, epoch):
        trace = LibCacheSimTrace(path, "oracleGeneral", PAGE)
        runs.append(Replay(replay_config("small", "lru", DRAM_OVERRIDES), "lru", trace, progress=False).run())
    assert same_run(*runs)


def test_a_day_long_gap_costs_no_more_than_no_gap(tmp_path):
    records = first_records()
    half = len(records) // 2
    plain = write_trace(tmp_path / "plain.jsonl", records)
    day = write_trace(tmp_path / "day.jsonl", records, lambda i: DAY_MS if i >= half else 0)
    year = write_trace(tmp_path / "year.jsonl", records, lambda i: YEAR_MS if i >= half else 0)
    for variant in ("lru", "hymcache"):
        base = replay(plain, variant)
        after_day = replay(day, variant)
        after_year = replay(year, variant)
        assert after_day["virtual_s"] > 86_400 > base["virtual_s"]
        # a day or a year of idle time: the same events (give or take float rounding, coarser a year on),
        # not one per tick of the span
        events = after_day["speed"]["background_events"]
        assert abs(events - after_year["speed"]["background_events"]) <= 0.05 * events
        assert events <= 2 * base["speed"]["background_events"] + 10


def test_time_scale_stretches_virtual_time_not_the_work(tmp_path):
    """--time-scale 1000 makes the trace's span 1000 times longer; the work, and so the cost, stays."""
    plain = write_trace(tmp_path / "plain.jsonl", first_records())
    for variant in ("lru", "hymcache"):
        base = replay(plain, variant)
        slow = replay(plain, variant, time_scale=1000.0)
        assert slow["virtual_s"] > 500 * base["virtual_s"]
        assert slow["speed"]["background_events"] <= 2 * base["speed"]["background_events"] + 10


def test_chm_replay_of_an_epoch_stamped_trace_with_a_day_gap(tmp_path, capsys):
    records = first_records()[:50]
    path = write_trace(tmp_path / "t.jsonl", records, lambda i: EPOCH_MS + (DAY_MS if i >= 25 else 0))
    rc = chm_main(["replay", str(path), "--profile", "small", "--policy", "lru", "--block-bytes", "256KiB",
                   "--tokens-per-block", "512", "--time-scale", "1000", "--window-s", "86400", "--no-progress",
                   "--set", "dram.size_bytes=67108864", "--set", "policy.prefetch_window_bytes=8388608"])
    assert rc == 0  # its wall time: bench/bench_event_time.py
    out = capsys.readouterr().out
    assert "total" in out
