"""``chm hymcache sweep``: grid points as Dask tasks give what the same points give run one by one, and what
``chm hymcache simulate`` gives for the same tier and settings; bad axes are usage errors naming the field,
the value and what is allowed."""

from __future__ import annotations

import json

import pytest

from emulator.cli import build_parser
from emulator.cli import main as chm_main
from host_runtime.hymcache.sim.run import EXTRA_FIELDS, ROW_FIELDS
from host_runtime.hymcache.sim.sweep import WALL_FIELDS, parse_axes, point_specs, run_point

# Fig. 13 shrunk: a GPU KV cache of ~190 blocks, so later turns ask the tier; each point well under a second
SMALL = ["--conversations", "24", "--turns", "3", "--concurrency", "8", "--gpu-memory-utilization", "0.25",
         "--mean-prompt-tokens", "400", "--turn-tokens", "0", "--no-progress"]
AXES = ["--sweep", "tier=lmcache-local,hymcache", "--sweep", "dram=256MiB,4GiB"]


def _comparable(result: dict) -> dict:
    return {**result, "summary": {k: v for k, v in result["summary"].items() if k not in WALL_FIELDS}}


def _specs(argv: list[str]) -> list[dict]:
    args = build_parser().parse_args(["hymcache", "sweep", *argv])
    return point_specs(args, parse_axes(args.sweep))


def test_a_sweep_on_a_local_cluster_equals_the_points_run_serially(tmp_path, capsys):
    rc = chm_main(["hymcache", "sweep", *SMALL, *AXES, "--workers", "2", "--out", str(tmp_path / "s")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "sweep: 4 points (tier 2 x dram 2) on a LocalCluster of 2 single-threaded workers" in out
    assert "makespan s" in out and "hit % last" in out and "lmcache-local  256MiB" in out
    swept = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert (tmp_path / "s" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    specs = _specs([*SMALL, *AXES])
    assert [r["point"] for r in swept] == [s["point"] for s in specs] == [
        {"tier": "lmcache-local", "dram": 256 << 20}, {"tier": "lmcache-local", "dram": 4 << 30},
        {"tier": "hymcache", "dram": 256 << 20}, {"tier": "hymcache", "dram": 4 << 30}]
    for r, spec in zip(swept, specs):
        assert _comparable(r) == _comparable(json.loads(json.dumps(run_point(spec))))  # serially, in this process
    # the points differ (the comparison is not vacuous): the small DRAM breaks LMCache's chains, HyMCache skips
    hits = [r["rows"][-1]["hit_rate"] for r in swept]
    assert hits[0] < 0.5 < hits[1]
    assert swept[2]["summary"]["skipped_inserts"] > 0 == swept[3]["summary"]["skipped_inserts"]


def test_a_point_is_what_chm_hymcache_simulate_gives_for_its_tier(tmp_path):
    spec = _specs([*SMALL, "--sweep", "tier=hymcache", "--sweep", "dram=256MiB"])[0]
    swept = run_point(spec)
    assert chm_main(["hymcache", "simulate", *SMALL, "--tiers", "hymcache", "--dram", "256MiB",
                     "--json", str(tmp_path / "o.json")]) == 0
    direct = json.loads((tmp_path / "o.json").read_text())
    keys = ROW_FIELDS + EXTRA_FIELDS
    assert [{k: r[k] for k in keys} for r in json.loads(json.dumps(swept["rows"]))] == direct["rows"]
    assert swept["summary"]["makespan_s"] == direct["summary"]["hymcache"]["makespan_s"]


def test_the_points_are_the_grid_times_each_points_tiers():
    specs = _specs(["--figure", "12", "--tiers", "recompute,hymcache"])  # Fig. 12's own staging sweep: an axis
    GB = 10 ** 9
    assert [s["point"] for s in specs] == [{"tier": t, "staging": n * GB} for t in ("recompute", "hymcache")
                                           for n in (10, 20, 30, 40)]
    assert all(s["settings"]["sweep.staging"] == [] and s["settings"]["tiers.run"] == [s["point"]["tier"]]
               and s["settings"]["tiers.staging"] == s["point"]["staging"] for s in specs)
    specs = _specs(["--sweep", "figure=13,15", "--sweep", "workload.concurrency=16,64"])
    assert [tuple(s["point"].values()) for s in specs] == [
        ("recompute", "13", 16), ("gpu-prefix", "13", 16), ("lmcache-local", "13", 16), ("hymcache", "13", 16),
        ("recompute", "13", 64), ("gpu-prefix", "13", 64), ("lmcache-local", "13", 64), ("hymcache", "13", 64),
        ("hymcache", "15", 16), ("hymcache-noprefetch", "15", 16),
        ("hymcache", "15", 64), ("hymcache-noprefetch", "15", 64)]
    assert {s["settings"]["figure.number"] for s in specs} == {13, 15}
    assert all(s["settings"]["workload.concurrency"] == s["point"]["workload.concurrency"] for s in specs)


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "dram"], "--sweep 'dram' must be FIELD=V1,V2,..."),
    (["--sweep", "nosuch=1"], "--sweep nosuch: unknown field; allowed: tier, dram, staging, workload, conversations, "
                              "figure, or a setting: topology.kind"),
    (["--sweep", "tiers.run=hymcache"], "--sweep tiers.run: unknown field"),
    (["--sweep", "tier=hymcache,fifo"], "--sweep tier 'fifo' is outside the allowed range: one of recompute, "
                                        "gpu-prefix"),
    (["--sweep", "dram=12MB"], "--sweep dram '12MB' is outside the allowed range: a byte count in [1MiB, 64TiB]"),
    (["--sweep", "dram=0GiB"], "--sweep dram '0GiB' is outside the allowed range"),
    (["--sweep", "conversations=8,0"], "--sweep conversations 0 is outside the allowed range: an integer in "
                                       "[1, 1000000]"),
    (["--sweep", "workload=lmsys,sharegpt"], "--sweep workload 'sharegpt' is outside the allowed range: one of "
                                             "lmsys, aiperf, mooncake"),
    (["--sweep", "figure=13,99"], "--sweep figure '99' is outside the allowed range: one of 10, 11, 12, 13, 14, 15"),
    (["--sweep", "workload.concurrency=-4"], "--sweep workload.concurrency -4 is outside the allowed range"),
    (["--sweep", "dram=1GiB,1GiB"], "--sweep dram: '1GiB' is given twice"),
    (["--sweep", "dram=1GiB", "--sweep", "tiers.dram=2GiB"], "--sweep tiers.dram is given twice (or as both its "
                                                              "shorthand and tiers.dram)"),
    (["--sweep", "tier="], "--sweep tier= names no value"),
    (["--sweep", "tier=hymcache", "--tiers", "hymcache"], "--sweep tier and --tiers both choose it: give one"),
    (["--sweep", "dram=1GiB", "--dram", "2GiB"], "--sweep dram and --dram both choose it: give one"),
    (["--sweep", "figure=13", "--figure", "15"], "--sweep figure and --figure both choose the preset: give one"),
    (["--sweep", "staging=10GiB", "--staging-sweep", "20GiB"], "--sweep staging and --staging-sweep both choose"),
    (["--workers", "0"], "--workers: 0 must be >= 1"),
    (["--workers", "2", "--scheduler", "tcp://127.0.0.1:1"], "--workers is for the LocalCluster"),
    # a point whose settings do not go together fails before any task runs, naming the point
    (["--sweep", "workload=lmsys,mooncake", "--chunk-tokens", "1024"],
     "--sweep point tier=recompute workload=mooncake: --chunk-tokens 1024 must divide the Mooncake trace's hash "
     "block of 512 tokens"),
])
def test_bad_sweeps_are_usage_errors_naming_field_and_value(argv, message, capsys):
    assert chm_main(["hymcache", "sweep", *SMALL, *argv]) == 2
    assert message in capsys.readouterr().err
