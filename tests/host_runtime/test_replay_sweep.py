"""``chm replay --sweep``: grid points as Dask tasks give what the same replays give run one by one."""

from __future__ import annotations

import json

import pytest

from emulator.cli import main as chm_main
from host_runtime.replay.sweep import WALL_FIELDS, grid, parse_sweep

# a few blocks on the small profile: each point replays in well under a second
SMALL = ["microbench", "--profile", "small", "--block-bytes", "8MiB", "--concurrency", "2", "--blocks-per-turn", "8",
         "--turns", "3", "--window-bytes", "16MiB", "--no-progress"]  # 128 MiB per turn: the 64 MiB buffer refuses


def _comparable(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in WALL_FIELDS and k != "point"}


def test_a_sweep_on_a_local_cluster_equals_each_point_run_directly(tmp_path, capsys):
    rc = chm_main(["replay", *SMALL, "--sweep", "variant=lru,hymcache", "--workers", "2", "--out", str(tmp_path / "s")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "2 points (variant 2) on a LocalCluster of 2 single-threaded workers" in out
    assert "recomp blk" in out and "serve s" in out
    swept = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [r["point"] for r in swept] == [{"variant": "lru"}, {"variant": "hymcache"}]
    assert (tmp_path / "s" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    for r in swept:
        variant = r["point"]["variant"]
        assert chm_main(["replay", *SMALL, "--policy", variant, "--out", str(tmp_path / variant)]) == 0
        direct = json.loads((tmp_path / variant / "replay.json").read_text())
        assert _comparable(r) == _comparable(direct)
        assert r["rows"] == direct["rows"] and r["total"]["refused_writes"] == direct["total"]["refused_writes"]
    assert swept[1]["total"]["refused_writes"] > 0  # the two points differ: the comparison is not vacuous


def test_the_grid_is_the_product_of_the_axes_first_slowest():
    axes = parse_sweep(["variant=lru,hymcache", "dram=1GiB,2GiB,4GiB"])
    assert axes == {"variant": ["lru", "hymcache"], "dram": [1 << 30, 2 << 30, 4 << 30]}
    points = grid(axes)
    assert len(points) == 6 and points[0] == {"variant": "lru", "dram": 1 << 30}
    assert points[1] == {"variant": "lru", "dram": 2 << 30} and points[-1] == {"variant": "hymcache", "dram": 4 << 30}
    assert parse_sweep(["policy.flush_batch_bytes=8MiB", "write_buffer=0.1,0.5"]) == {
        "policy.flush_batch_bytes": [8 << 20], "write_buffer": [0.1, 0.5]}


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "dram"], "--sweep 'dram' must be FIELD=V1,V2,..."),
    (["--sweep", "nosuch=1"], "--sweep nosuch: unknown field; allowed: variant, device_policy, dram"),
    (["--sweep", "dram=12MB"], "--sweep dram = '12MB' is not a byte count"),
    (["--sweep", "dram=0GiB"], "--sweep dram = '0GiB' must be positive"),
    (["--sweep", "dram=1TiB,128TiB"], "dram.size_bytes = 140737488355328 is out of range [4096, 7.03687e+13]"),
    (["--sweep", "variant=lru,fifo"], "--sweep variant: 'fifo' is not one of lru, hymcache, hymcache-noprefetch"),
    (["--sweep", "device_policy=nosuch"], "--sweep device_policy: policy.name = 'nosuch' is not one of"),
    (["--sweep", "write_buffer=0.99"], "policy.write_buffer_fraction = 0.99 is out of range [0, 0.95]"),
    (["--sweep", "workload=nosuch.jsonl"], "--sweep workload: 'nosuch.jsonl' is neither a file nor one of microbench"),
    (["--sweep", "dram=1GiB,1GiB"], "--sweep dram: '1GiB' is given twice"),
    (["--sweep", "dram=1GiB", "--sweep", "dram.size_bytes=2GiB"], "--sweep dram.size_bytes is given twice"),
    (["--sweep", "variant=", ], "--sweep variant= names no value"),
    (["--sweep", "variant=lru", "--compare", "lru,hymcache"], "--sweep variant and --compare both choose it"),
    (["--sweep", "dram=1GiB", "--set", "dram.size_bytes=1073741824"], "--sweep dram and --set dram.size_bytes"),
    (["--workers", "2"], "--workers is for --sweep"),
    (["--sweep", "dram=1GiB", "--workers", "0"], "--workers: 0 must be >= 1"),
    # a point whose profile does not build fails before any task runs, naming the point
    (["--sweep", "dram=256MiB,128KiB"], "--sweep point dram=128KiB: "),
])
def test_bad_sweeps_are_usage_errors_naming_field_and_value(argv, message, capsys):
    assert chm_main(["replay", *SMALL, *argv]) == 2
    assert message in capsys.readouterr().err
