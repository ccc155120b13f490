"""The platform performance model and ``chm hybridgen model-perf`` (no weights needed)."""

import json

import pytest

from emulator.cli import UsageError
from host_runtime.hybridgen import cli
from host_runtime.hybridgen import perfmodel as pm


def test_every_platform_loads_and_every_number_names_its_source():
    for name in ("A", "B", "C"):
        p = pm.load_platform(name)
        assert p.gpu_bw > 0 and p.cpu_bw > 0 and p.pcie_bw > 0
        text = (pm.HERE / "platforms" / f"{name}.toml").read_text()
        for line in text.splitlines():
            if "=" in line and not line.startswith("name") and not line.lstrip().startswith("#"):
                assert "#" in line, f"{name}.toml: no source for {line!r}"


def test_unknown_platform_is_named():
    with pytest.raises(ValueError, match="platform 'Z'"):
        pm.load_platform("Z")


def test_flexgen_grows_with_context_and_hybridgen_beats_it_at_long_context():
    m, p = pm.load_models()["llama-3.1-8b"], pm.load_platform("A")
    assert pm.decode_latency("flexgen", m, p, 32768) > 4 * pm.decode_latency("flexgen", m, p, 4096)
    assert pm.decode_latency("hybridgen", m, p, 16384) < pm.decode_latency("flexgen", m, p, 16384)


def test_interleaved_mapping_is_never_faster():
    p = pm.load_platform("C")
    for name in pm.PAPER_MODELS:
        m = pm.load_models()[name]
        sem = pm.decode_latency("hybridgen-fixed", m, p, 8192, mapping="semantic")
        inter = pm.decode_latency("hybridgen-fixed", m, p, 8192, mapping="interleaved")
        assert inter >= sem


def test_model_perf_command_json(capsys):
    args = cli.build_parser_for_tests().parse_args(["model-perf", "--platform", "B", "--json"])
    assert args.func(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert len(r["models"]) == 11 and r["geomean_speedup_vs_flexgen"]["flexgen"] == pytest.approx(1.0)
    assert [row["seq_len"] for row in r["seq_len_sweep"]] == [2048, 4096, 8192, 16384, 32768]
    assert [row["batch"] for row in r["batch_sweep"]] == [1, 2, 4, 8, 16]
    assert {"semantic_ms", "interleaved_ms"} <= set(r["mapping"][0])


def test_model_perf_rejects_bad_ratio():
    with pytest.raises(UsageError, match=r"--kv-ratio: 1.5 must be in \(0, 1\]"):
        cli.build_parser_for_tests().parse_args(["model-perf", "--kv-ratio", "1.5"])


def test_kmin_knee_is_where_the_curve_flattens():
    from host_runtime.hybridgen.evaluate import knee_point

    ratios = [0.05, 0.1, 0.25, 0.5, 1.0]
    assert knee_point(ratios, [0.40, 0.70, 0.95, 0.97, 1.0]) == 2
    assert knee_point(ratios, [0.90, 0.99, 0.995, 0.998, 1.0]) == 1


def test_schedule_command_shows_rise_fall_switch(capsys):
    args = cli.build_parser_for_tests().parse_args(["schedule", "--platform", "A"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    branches = [line.split()[-1] for line in lines[2:] if line.split()[0].isdigit()]
    assert branches[:3] == ["increase", "decrease", "switch"]
