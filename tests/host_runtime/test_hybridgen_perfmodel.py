"""The platform performance model, mechanism by mechanism, and ``chm hybridgen model-perf`` (no weights needed)."""

import json
import re

import pytest

from emulator.cli import UsageError
from host_runtime.hybridgen import cli
from host_runtime.hybridgen import perfmodel as pm

SOURCE_TAG = re.compile(r"#\s*\[(paper|spec|derived|assumption)\]")


@pytest.fixture(scope="module")
def models():
    return pm.load_models()


def test_every_platform_loads_and_every_number_names_its_source():
    for name in ("A", "B", "C"):
        p = pm.load_platform(name)
        assert p.gpu_bw > 0 and p.cpu_bw > 0 and p.pcie_bw > 0 and p.cpu_flops > 0
        text = (pm.HERE / "platforms" / f"{name}.toml").read_text()
        for line in text.splitlines():
            if "=" in line and not line.startswith("name") and not line.lstrip().startswith(("#", "name")):
                assert SOURCE_TAG.search(line), f"{name}.toml: no [source] tag for {line!r}"


def test_cpu_numbers_follow_the_spec_sheets_and_the_paper():
    """Bandwidth = channels x MT/s x 8 B x sockets; B's and C's FLOP/s = A's 46 scaled by sockets x cores x clock."""
    a, b, c = (pm.load_platform(n) for n in "ABC")
    assert a.cpu_bw == pytest.approx(8 * 2933e6 * 8 * 2)
    assert b.cpu_bw == pytest.approx(8 * 4800e6 * 8) and c.cpu_bw == pytest.approx(12 * 6400e6 * 8)
    assert a.cpu_flops == pytest.approx(46e9)
    assert b.cpu_flops == pytest.approx(46e9 * 32 * 2.1 / (2 * 26 * 2.2))
    assert c.cpu_flops == pytest.approx(46e9 * 72 * 2.7 / (2 * 26 * 2.2))
    assert (a.host_dram_bytes, b.host_dram_bytes, c.host_dram_bytes) == (128e9, 512e9, 128e9)
    assert not a.has_cxl and not b.has_cxl and c.has_cxl and c.cxl_bytes == 128e9


def test_k_min_is_an_absolute_token_count(models):
    assert all(models[n].k_min == 128 for n in pm.PAPER_MODELS)
    assert models["smollm2-135m"].k_min != 128  # profiled on this model by chm hybridgen kmin


def test_cpu_logits_cost_is_the_larger_of_compute_and_memory(models):
    m, p = models["llama-3.1-8b"], pm.load_platform("A")
    tokens = 1000
    flops = m.heads * m.head_dim * 2 * tokens / p.cpu_flops
    memory = (tokens * m.kv_row_bytes(2) + tokens * m.heads * pm.LOGIT_BYTES) / p.cpu_bw
    assert flops > memory  # at the paper's 46 GFLOP/s the logits are compute bound
    assert pm.cpu_logits_time(m, p, 1, tokens) == pytest.approx(p.cpu_task_overhead + flops)
    fast = pm.load_platform("A", {"cpu.attention_gflops": 1e6})
    assert pm.cpu_logits_time(m, fast, 1, tokens) == pytest.approx(fast.cpu_task_overhead + memory)


def test_pcie_and_cxl_legs_pipeline():
    p = pm.load_platform("C")
    assert pm.transfer_time(p, 1e6) == pytest.approx(p.pcie_lat + 1e6 / p.pcie_bw)
    both = pm.transfer_time(p, 1e6, 1e6)
    assert both == pytest.approx(p.pcie_lat + max(1e6 / p.pcie_bw, p.cxl_lat + 1e6 / p.cxl_bw))
    assert both < p.pcie_lat + 1e6 / p.pcie_bw + p.cxl_lat + 1e6 / p.cxl_bw


def test_a_staged_region_costs_its_bytes_at_the_staging_bandwidth_only_where_the_platform_gives_one(models):
    c = pm.load_platform("C")
    assert c.cxl_stage_bw == 0  # the paper's platforms: the staging is in the latency
    assert pm.transfer_time(c, 1e3, 1e3, 0, staged_bytes=1e9) == pm.transfer_time(c, 1e3, 1e3)
    table = pm.read_platform_table("C")
    table["cxl"]["staging_bandwidth_gbps"] = 2.0  # as `chm hybridgen calibrate` writes it
    calibrated = pm.platform_from_table(table)
    assert calibrated.cxl_stage_bw == 2e9
    assert pm.transfer_time(calibrated, 1e3, 1e3, 3, staged_bytes=1e6) == pytest.approx(
        calibrated.pcie_lat + calibrated.cxl_lat + 3 * calibrated.cxl_request_overhead + 1e3 / calibrated.cxl_bw
        + 1e6 / 2e9)
    # HybridGen stages each layer's CXL-resident V rows: the longer the offloaded context, the longer T_tx
    m, where = models["opt-13b"], pm.Placement(0.0, 1.0)
    short, long_ = (pm.hybrid_times(m, calibrated, 1, pm.Split(0, n), 64, pm.POST, where)[1] for n in (1000, 4000))
    staged = 3000 * m.kv_row_bytes(calibrated.element_bytes)
    assert long_ - short == pytest.approx(staged / 2e9)


def test_an_in_process_cxl_tier_costs_the_cpu_job_its_interference_only_while_v_is_there(models):
    table = pm.read_platform_table("C")
    assert pm.platform_from_table(table).cpu_cxl_interference == 0  # real hardware: the device does the work
    table["cpu"]["cxl_interference_us"] = 80.0  # as `chm hybridgen calibrate` measures this machine
    p, m = pm.platform_from_table(table), models["opt-13b"]
    t_cpu = {v: pm.hybrid_times(m, p, 1, pm.Split(0, 2000), 64, pm.POST, pm.Placement(0.0, v))[0] for v in (0.0, 0.5)}
    assert t_cpu[0.0] == pytest.approx(pm.cpu_logits_time(m, p, 1, 2000))
    assert t_cpu[0.5] - t_cpu[0.0] == pytest.approx(80e-6)


def test_cxl_holds_only_what_exceeds_host_dram_and_only_on_c(models):
    m = models["opt-13b"]
    a, c = pm.load_platform("A"), pm.load_platform("C")
    assert pm.placement(m, a, 16, 30000) == pm.Placement()       # A has no CXL tier: nothing goes there
    assert pm.placement(m, c, 1, 2000) == pm.Placement()          # fits host DRAM: nothing in CXL
    row = m.kv_row_bytes(2) * m.layers
    half = c.host_dram_bytes / (2 * row)                          # tokens whose K and V just fill DRAM
    where = pm.placement(m, c, 1, int(1.5 * half))                # K fits; the V beyond DRAM goes to CXL
    assert where.k_cxl == 0 and where.v_cxl == pytest.approx(2 / 3, rel=1e-3)
    big_cxl = pm.load_platform("C", {"cxl.capacity_gb": 1000.0})
    spill = pm.placement(m, big_cxl, 1, int(2.4 * half))          # past DRAM K spills too, after all of V
    assert spill.v_cxl == 1 and 0 < spill.k_cxl < 1
    assert pm.placement(m, c, 1, 100, "interleaved") == pm.Placement(0.5, 0.5)
    with pytest.raises(ValueError, match="exceed host DRAM plus CXL"):
        pm.placement(m, c, 16, 40000)


def test_layer_ahead_pipeline_hides_the_cpu_and_overlaps_transfers():
    layers = 40
    hidden = pm.layer_ahead_step(layers, t_cpu=1, t_tx=1, t_gpu=3)
    assert hidden == pytest.approx(layers * 3 + 2, abs=3)  # GPU bound, plus the first layer's CPU and transfer
    # CPU bound: each layer's transfer overlaps the next layer's logits; not cpu + tx in series per layer
    step = pm.layer_ahead_step(layers, t_cpu=4, t_tx=3, t_gpu=1)
    assert step < layers * (4 + 3) * 0.8 and step >= layers * 4
    # pre-QKᵀ: the rows are known up front, so their transfer runs beside the CPU
    assert pm.layer_ahead_step(layers, 2, 2, 1, selection_first=True) < pm.layer_ahead_step(layers, 2, 2, 1)


def test_infinigen_selection_is_a_serial_gpu_stage(models):
    m = models["llama-3.1-8b"]
    base = pm.decode_latency("infinigen", m, pm.load_platform("A"), 2048)
    slower = pm.decode_latency("infinigen", m, pm.load_platform("A", {"gpu.kernel_launch_us": 15.0}), 2048)
    # every launch of the speculation adds to every layer
    assert slower - base == pytest.approx(m.layers * pm.INFINIGEN_LAUNCHES * 10e-6, rel=0.05)


def test_hybridgen_reports_the_schedulers_steady_state(models):
    m, p = models["opt-13b"], pm.load_platform("C")
    s = pm.method_step("hybridgen", m, p, 2048)
    assert 0 <= s.post_fraction <= 1 and m.k_min <= s.k_range[0] <= s.k_range[1]
    assert s.seconds < pm.method_step("flexgen", m, p, 2048).seconds


def test_flexgen_grows_with_context_and_hybridgen_beats_it_at_long_context(models):
    m, p = models["llama-3.1-8b"], pm.load_platform("A")
    assert pm.decode_latency("flexgen", m, p, 32768) > 4 * pm.decode_latency("flexgen", m, p, 4096)
    assert pm.decode_latency("hybridgen", m, p, 16384) < pm.decode_latency("flexgen", m, p, 16384)


def test_semantic_mapping_beats_interleaving_for_the_k_scan(models):
    """Post-QKᵀ at K_min scans every K: interleaving puts half of it in CXL; semantic mapping none."""
    p = pm.load_platform("C")
    for name in pm.PAPER_MODELS:
        m = models[name]
        sem = pm.decode_latency("hybridgen-fixed", m, p, 8192, mapping="semantic")
        inter = pm.decode_latency("hybridgen-fixed", m, p, 8192, mapping="interleaved")
        assert inter >= sem
    m = models["opt-13b"]  # OPT's MHA K scan is memory bound: there interleaving costs
    assert (pm.decode_latency("hybridgen-fixed", m, p, 8192, mapping="interleaved")
            > 1.2 * pm.decode_latency("hybridgen-fixed", m, p, 8192, mapping="semantic"))


def test_hybridgen_leads_infinigen_and_keyformer_on_every_platform():
    for name in "ABC":
        over = pm.model_perf_report(pm.load_platform(name))["hybridgen_over"]
        assert over["infinigen"]["geomean"] > 1 and over["keyformer"]["geomean"] > 1, name


def test_overrides_name_the_unknown_field():
    with pytest.raises(ValueError, match="override 'cpu.gflops' names no field.*cpu.attention_gflops"):
        pm.load_platform("A", {"cpu.gflops": 1.0})


def test_unknown_platform_is_named():
    with pytest.raises(ValueError, match="platform 'Z'"):
        pm.load_platform("Z")


def test_model_perf_command_json(capsys):
    args = cli.build_parser_for_tests().parse_args(["model-perf", "--platform", "B", "--json"])
    assert args.func(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert len(r["models"]) == 11 and r["geomean_speedup_vs_flexgen"]["flexgen"] == pytest.approx(1.0)
    assert r["paper_speedup"] == {"infinigen": 1.41, "keyformer": 1.86, "flexgen": 3.2, "moe-lightning": 3.2}
    assert [s["model"] for s in r["seq_len_sweep"]] == ["llama-3.1-8b", "qwen2.5-7b"]
    assert [row["seq_len"] for row in r["seq_len_sweep"][0]["rows"]] == [2048, 4096, 8192, 16384, 32768]
    assert r["batch_sweep"]["model"] == "opt-13b"
    assert [row["batch"] for row in r["batch_sweep"]["rows"]] == [1, 2, 4, 8, 16]
    assert r["mapping"] == []  # B has no CXL tier


def test_model_perf_mapping_study_on_c(capsys):
    args = cli.build_parser_for_tests().parse_args(["model-perf", "--platform", "C", "--json"])
    assert args.func(args) == 0
    rows = [row for row in json.loads(capsys.readouterr().out)["mapping"] if row["fits"]]
    assert any(row["v_cxl"] > 0 for row in rows)
    assert all(row["hybridgen-fixed"]["semantic_speedup"] > 1 for row in rows)


def test_sensitivity_run_changes_the_answer(capsys):
    parse = cli.build_parser_for_tests().parse_args
    outs = []
    for extra in ([], ["--set", "gpu.kernel_launch_us=20"]):
        args = parse(["model-perf", "--platform", "A", "--json", *extra])
        assert args.func(args) == 0
        outs.append(json.loads(capsys.readouterr().out)["hybridgen_over"]["infinigen"]["geomean"])
    assert outs[1] > outs[0]


def test_model_perf_rejects_bad_values():
    parse = cli.build_parser_for_tests().parse_args
    with pytest.raises(UsageError, match="--seq-len"):
        parse(["model-perf", "--seq-len", "0"])
    with pytest.raises(UsageError, match="--set: .*SECTION.FIELD=NUMBER"):
        parse(["model-perf", "--set", "cpu"])
    args = parse(["model-perf", "--platform", "nowhere"])
    with pytest.raises(UsageError, match="--platform 'nowhere' must be one of A, B, C"):
        args.func(args)


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
    assert branches[0] == "warmup"
    assert branches.index("increase") < branches.index("decrease") < branches.index("switch-to-pre")
