"""bench_replay (issue 23): its synthetic CSV trace and, at a small size, one end-to-end case (chm replay and
libcachesim's process_trace as whole processes, sequential misses equal)."""

from __future__ import annotations

import json


from bench import bench_replay
from host_runtime.replay.lcs_trace import parse_trace_params
from tests.conftest import require_oracle

lcs = require_oracle("libcachesim")  # the oracle: missing, these tests fail with the install hint


def test_the_zipf_csv_is_seeded_and_libcachesim_reads_it_with_the_bench_params(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    info = bench_replay.write_zipf_csv(a, 5000)
    bench_replay.write_zipf_csv(b, 5000)
    assert a.read_bytes() == b.read_bytes()
    assert info["requests"] == 5000 and 0 < info["distinct_objects"] < 5000
    params = lcs.ReaderInitParam()
    for key, value in parse_trace_params(bench_replay.TRACE_PARAMS).items():
        setattr(params, key, value)
    reqs = [(r.clock_time, r.obj_id, r.obj_size) for r in lcs.TraceReader(str(a), lcs.TraceType.CSV_TRACE, params)]
    assert len(reqs) == 5000
    times = [t for t, _, _ in reqs]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < bench_replay.SPAN_S
    assert all(1 <= o <= bench_replay.OBJECTS and s == bench_replay.OBJ_BYTES for _, o, s in reqs)


def test_one_small_case_end_to_end(tmp_path):
    out = tmp_path / "results"
    status = bench_replay.main(["--requests", "3000", "--runs", "1", "--cases", "csv-lru", "--out", str(out),
                                "--workdir", str(tmp_path / "work")])
    assert status == 0
    result = json.loads((out / "bench_replay.json").read_text())
    (case,) = result["end_to_end"]["cases"]
    assert case["case"] == "csv-lru" and case["accesses"] == 3000
    assert case["misses"]["must_be_equal"] and case["misses"]["equal_every_run"]
    assert "chm replay $WORK/zipf.csv --trace-format csv" in case["chm_command"]
    for who in ("chm", "peer"):
        (run,) = case["runs"][who]
        assert run["wall_s"] > 0 and run["rss_bytes"] > 0
