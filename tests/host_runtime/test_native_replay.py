"""The native request loop (host_runtime/replay/native/replay_loop.c) against its specification, driver.py's
Python loop: every workload kind, sequential and in virtual time, several variants and device policies, the
Master refusing and evicting, keys past 64 bits, a trace out of time order. Each pair of replays must give the
same report (every field but the wall-clock speed), the same device state and the same Master state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from host_runtime.hymcache.native_master import NativeMaster
from host_runtime.replay.driver import Replay, replay_config
from host_runtime.replay.lcs_trace import LibCacheSimTrace, parse_trace_params
from host_runtime.replay.traces import ConversationGenerator, HymcacheMicrobench, MooncakeTrace, RandomReadBench

from .test_replay import GOLDEN, GOLDEN_OVERRIDES

KiB, MiB = 1024, 1 << 20
CSV_PARAMS = "time-col=1,obj-id-col=2,obj-size-col=3,delimiter=,,has-header=true"


def _csv(path, rows, header="time,obj_id,obj_size"):
    path.write_text(header + "\n" + "".join(f"{t},{o},{s}\n" for t, o, s in rows))
    return path


def _zipf_rows(n, objects, seed, max_size=4 * KiB, shuffle_times=False):
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.2, n), objects)
    times = np.sort(rng.integers(0, 600, n))
    if shuffle_times:
        rng.shuffle(times)
    sizes = rng.integers(1, max_size + 1, n)
    return list(zip(times.tolist(), ranks.tolist(), sizes.tolist()))


def _state(rp: Replay) -> dict:
    snap = rp.ctl.snapshot()
    snap.pop("latency", None)  # histograms' summaries: in the report's device section already, floats of them
    return {"device": snap, "master": rp.master.state(), "background_ns": rp.ctl.flusher.background_ns,
            "events": rp.ctl.events_run}


def _both(make_workload, variant="lru", device_policy=None, profile="small", overrides=None, **kw):
    """(Python result, native result), after checking they and the states they leave are equal."""
    out = []
    for native in (False, True):
        rp = Replay(replay_config(profile, variant, overrides if overrides is not None else GOLDEN_OVERRIDES,
                                  device_policy), variant, make_workload(), progress=False, native=native, **kw)
        result = rp.run()
        assert (rp.native_loop is not None) == native
        result.pop("speed")
        out.append((result, _state(rp)))
    (py, py_state), (nat, nat_state) = out
    assert json.dumps(nat, sort_keys=True, default=str) == json.dumps(py, sort_keys=True, default=str)
    assert nat_state == py_state
    return py, nat


def golden():
    return MooncakeTrace(GOLDEN, block_bytes=256 * KiB, tokens_per_block=512, time_scale=0.01)


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "virtual-time"])
@pytest.mark.parametrize("variant, device_policy", [("lru", None), ("lru", "s3fifo"), ("lru", "fifo"),
                                                     ("lru", "clock"), ("lru", "sieve"),
                                                     ("hymcache-noprefetch", "lru")])
def test_golden_trace(variant, device_policy, sequential):
    py, _ = _both(golden, variant, device_policy, sequential=sequential)
    assert py["total"]["blocks_read"] > 0 and py["device"]["evictions"] > 0  # the trace exercises the device


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "virtual-time"])
@pytest.mark.parametrize("make", [
    lambda: HymcacheMicrobench(256 * KiB, 8, 8, 3),
    lambda: ConversationGenerator(256 * KiB, 128, 30, 3.0, 69.5, 214.5, mean_think_s=3.0, sessions_per_s=2.0, seed=3),
    lambda: RandomReadBench(256 * KiB, 64 * MiB, 4, 50, 1),
], ids=["microbench", "conversation", "randread"])
def test_generated_workloads(make, sequential):
    """Phases (rows per phase), streams of several requests with think times, populated blocks."""
    _both(make, "lru", "s3fifo", sequential=sequential, bucket_ns=1e9)


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "virtual-time"])
def test_the_master_evicts_and_refuses_alike(sequential):
    """A device of 1 MiB: the Master evicts to make room and refuses puts it cannot place (ENOSPC)."""
    py, _ = _both(golden, "lru", overrides={**GOLDEN_OVERRIDES, "ssd.capacity_bytes": 1 * MiB}, sequential=sequential)
    assert py["master"]["evictions"] > 0


def test_a_request_past_the_device_is_refused_after_its_first_chunk(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "hash_ids": list(range(70_000))}) + "\n"
                    + json.dumps({"timestamp": 1, "hash_ids": [0, 1, 2]}) + "\n")
    py, _ = _both(lambda: MooncakeTrace(path, MiB, tokens_per_block=512), overrides={})
    assert py["master"]["no_space_puts"] >= 1


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "virtual-time"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_libcachesim_csv_of_multi_block_objects(tmp_path, policy, sequential):
    path = _csv(tmp_path / "t.csv", _zipf_rows(3000, 400, seed=7, max_size=20 * KiB))
    py, nat = _both(lambda: LibCacheSimTrace(path, "csv", 4 * KiB, parse_trace_params(CSV_PARAMS)), "lru", policy,
                    overrides={**GOLDEN_OVERRIDES, "dram.size_bytes": 2 * MiB}, sequential=sequential, bucket_ns=60e9)
    assert len(py["rows"]) > 1 and py["workload"]["objects"] == nat["workload"]["objects"] <= 400


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "virtual-time"])
def test_keys_past_64_bits(tmp_path, sequential):
    """String object ids are hashed to 64 bits (obj-id-is-num=false): block keys o << 24 | j pass 64 bits."""
    rows = [(t, f"obj-{o}", s) for t, o, s in _zipf_rows(800, 120, seed=5, max_size=8 * KiB)]
    path = _csv(tmp_path / "s.csv", rows)
    params = parse_trace_params(CSV_PARAMS + ",obj-id-is-num=false")
    trace = LibCacheSimTrace(path, "csv", 4 * KiB, params)
    assert max(trace.obj_ids) >> 40  # some key is wider than 64 bits
    _both(lambda: LibCacheSimTrace(path, "csv", 4 * KiB, params), overrides={**GOLDEN_OVERRIDES, "dram.size_bytes": 2 * MiB},
          sequential=sequential)


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "virtual-time"])
@pytest.mark.parametrize("case", ["earliest-not-first", "back-in-time-later"])
def test_a_trace_out_of_time_order(tmp_path, sequential, case):
    """Times not sorted. The earliest request not first: the streamed attempt stops at once (a request before the
    first) and runs again fed whole, timed from the earliest request as the Python loop times it. A later batch
    going back in time, never before the first: in virtual time the loop finds a stream starting before an event
    it ran (RP_E_UNSORTED) and runs again fed whole; sequential replays need no second run."""
    if case == "earliest-not-first":
        rows = _zipf_rows(5000, 300, seed=11, shuffle_times=True)
        rows[0] = (300, rows[0][1], rows[0][2])
    else:  # past the reader's first batch (native_reader.BATCH requests)
        rows = [(100 + i * 500 // 66000, o, s) for i, (_, o, s) in enumerate(_zipf_rows(66000, 3000, seed=12))]
        rows += [(150 + t // 6, o, s) for t, o, s in _zipf_rows(2000, 3000, seed=13)]
    path = _csv(tmp_path / "u.csv", rows)
    _both(lambda: LibCacheSimTrace(path, "csv", 4 * KiB, parse_trace_params(CSV_PARAMS)),
          overrides={**GOLDEN_OVERRIDES, "dram.size_bytes": 8 * MiB}, sequential=sequential, bucket_ns=60e9)


def test_the_native_loop_runs_where_it_can_and_says_why_not():
    rp = Replay(replay_config("small", "lru", GOLDEN_OVERRIDES), "lru", golden(), progress=False)
    rp.run()
    assert rp.native_loop is not None and type(rp.master) is NativeMaster
    rp = Replay(replay_config("small", "hymcache", GOLDEN_OVERRIDES), "hymcache", golden(), progress=False,
                window_bytes=MiB)
    rp.run()
    assert rp.native_loop is None  # prefetching: the Python loop
    with pytest.raises(ValueError, match="prefetches"):
        Replay(replay_config("small", "hymcache", GOLDEN_OVERRIDES), "hymcache", golden(), progress=False,
               window_bytes=MiB, native=True).run()
    with pytest.raises(ValueError, match="recorded"):
        Replay(replay_config("small", "lru", GOLDEN_OVERRIDES), "lru", golden(), progress=False, record_ops=True,
               native=True).run()


def test_percentiles_of_counted_latencies_are_the_sorted_elements():
    from host_runtime.replay.driver import Bucket

    rng = np.random.default_rng(1)
    lat = rng.integers(1, 50, 1001).astype(float)
    plain, counted = Bucket("a"), Bucket("b")
    plain.read_latency_ns.extend(lat)
    values, counts = np.unique(lat, return_counts=True)
    counted.latency_counts = (values, counts.astype(np.uint64))
    for p in (0, 1, 50, 99, 99.9, 100):
        assert counted.percentile_ms(p) == plain.percentile_ms(p)
    assert Bucket("e", latency_counts=(np.empty(0), np.empty(0, np.uint64))).percentile_ms(50) == 0.0
    assert not math.isnan(plain.percentile_ms(50))
