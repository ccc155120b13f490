"""``chm hymcache sweep --claims``: the claims map's parameter table is sourced and sweeps only what the presets
assume; a map point is what ``claims.evaluate`` says of a direct ``simulate`` of the same settings; bad input is
an error naming the option, the value and what is allowed."""

from __future__ import annotations

import json
import re

import pytest

from emulator.cli import main as chm_main
from host_runtime.hymcache.sim import claims_map
from host_runtime.hymcache.sim.claims import evaluate
from host_runtime.hymcache.sim.claims_map import PARAMETERS, point_specs, select
from host_runtime.hymcache.sim.config import BY_KEY, check, load_settings, preset_path
from host_runtime.hymcache.sim.run import simulate

# Fig. 13 shrunk (as test_sim_sweep's SMALL): a GPU KV cache of ~190 blocks, so later turns ask the tier
SMALL = {"workload.conversations": 24, "workload.turns": 3, "workload.concurrency": 8,
         "gpu.gpu_memory_utilization": 0.25}


def _preset_line(figure: str, key: str) -> str:
    """The preset's line (with its source comment) that sets ``key``."""
    section, name = key.split(".")
    current = None
    for line in preset_path(figure).read_text().splitlines():
        if m := re.match(r"\[([\w-]+)\]", line):
            current = m.group(1)
        elif current == section and re.match(rf"{re.escape(name)}\s*=", line):
            return line
    raise AssertionError(f"fig{figure}.toml sets no {key}")


@pytest.mark.parametrize("p", PARAMETERS, ids=lambda p: f"fig{p.figure}-{p.key}")
def test_every_parameter_is_an_assumed_setting_swept_over_a_sourced_range(p):
    assert p.key in BY_KEY and len(p.values) >= 4 and len(set(p.values)) == len(p.values)
    assert p.source.strip() and p.open.strip()
    assert all(check(BY_KEY[p.key], v) == v for v in p.values)
    assert load_settings(preset_path(p.figure))[p.key] in p.values  # the preset's own value is a point
    # never a tier's constant: the preset says it assumed the value (or, for Fig. 13's growth, that the paper
    # bounds it from one side only and the map sweeps it)
    line = _preset_line(p.figure, p.key)
    assert "[assumption]" in line or "claims map" in (line + _preset_comment_after(p.figure, p.key))


def _preset_comment_after(figure: str, key: str) -> str:
    lines = preset_path(figure).read_text().splitlines()
    i = lines.index(_preset_line(figure, key))
    return " ".join(line for line in lines[i + 1:i + 8] if line.lstrip().startswith("#"))


def test_fig13s_growth_runs_from_the_papers_64_gb_to_twice_it():
    p = next(p for p in PARAMETERS if p.key == "workload.turn_tokens")
    assert p.values == (953.0, 1271.0, 1589.0, 1907.0)


def test_a_map_point_is_evaluate_of_a_direct_simulate(tmp_path):
    m = claims_map.claims_map(["13"], ["workload.turn_tokens"], workers=1, progress=False, overrides=SMALL)
    paths = claims_map.write_map(m, tmp_path)
    assert [p.name for p in paths] == ["claims_map.json", "claims_map.md", "claims_map.png"]
    assert paths[2].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths[0].read_text()) == json.loads(json.dumps(m))
    (panel,) = m["panels"]
    assert panel["values"] == [953.0, 1271.0, 1589.0, 1907.0] and panel["preset"] == 953.0
    text = claims_map.format_map(m)
    assert "953*" in text and "fig13.hymcache_hit_rate_near_90" in text and "| claim | paper | 953* |" in paths[1].read_text()
    for i, value in enumerate(panel["values"]):
        s = {**load_settings(preset_path("13")), **SMALL, "workload.turn_tokens": value}
        direct = evaluate("13", simulate(s))
        assert {v["name"] for v in direct} == set(panel["claims"])
        for v in direct:
            cell = panel["claims"][v["name"]][i]
            assert (cell["holds"], cell["measured"]) == (v["holds"], v["measured"]), (v["name"], value)
    # the comparison is not vacuous: the points differ
    speedups = [c["measured"] for c in panel["claims"]["fig13.speedup_3x_over_lmcache_local"]]
    assert len(set(speedups)) == len(speedups)


def test_the_presets_value_of_two_parameters_is_one_simulation():
    params = select(["10"], ["workload.concurrency", "tiers.staging"])
    specs, where = point_specs(params)
    assert len(where) == 8 and len(specs) == 7
    assert where[("10", "workload.concurrency", 128)] == where[("10", "tiers.staging", 40 * 10 ** 9)]


def test_bad_overrides_are_errors_naming_them():
    with pytest.raises(ValueError, match="override workload.turn_tokens: it is the swept parameter of Fig. 13"):
        point_specs(select(["13"]), {"workload.turn_tokens": 10.0})
    with pytest.raises(ValueError, match="override 'nosuch' is outside the allowed range: a setting"):
        point_specs(select(["13"]), {"nosuch": 1})
    with pytest.raises(ValueError, match="override workload.turns 0 is outside the allowed range: an integer in"):
        point_specs(select(["13"]), {"workload.turns": 0})


@pytest.mark.parametrize("argv, message", [
    (["--figure", "99"], "--figure '99' is outside the allowed range: one of 10"),
    (["--figure", "13", "--parameter", "tiers.dram"],
     "--parameter 'tiers.dram' is outside the allowed range: one of workload.turn_tokens (the claims map's "
     "parameters of Fig. 13)"),
    (["--turns", "3"], "--claims runs each figure's preset with one parameter changed at a time: --turns would "
                       "change it"),
    (["--sweep", "dram=1GiB"], "--sweep would change it"),
    (["--preset", "x.toml"], "--preset would change it"),
])
def test_bad_claims_maps_are_usage_errors_naming_field_and_value(argv, message, capsys):
    assert chm_main(["hymcache", "sweep", "--claims", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_parameter_without_claims_is_a_usage_error(capsys):
    assert chm_main(["hymcache", "sweep", "--parameter", "redis.gbps", "--figure", "14"]) == 2
    assert "--parameter chooses a parameter of the claims map: give it with --claims" in capsys.readouterr().err


def test_a_point_the_simulator_refuses_is_that_points_error_not_the_maps():
    s = {**load_settings(preset_path("13")), **SMALL, "model.name": "opt-30b"}  # 60 GB of weights in 20 GB of HBM
    record = claims_map.run_point({"figure": "13", "settings": s})
    assert record["verdicts"] == [] and record["error"].startswith("ValueError: gpu: ") and "no room" in record["error"]
    assert claims_map.cell_text({"holds": None, "measured": None}) == "error"
