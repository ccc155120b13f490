"""The performance model against this machine: calibrate, then the model's CPU and transfer times of a
generation must come within ±25 % of what the engine measures (median over 32 steps of per-step ratios).

Wall-clock times on a shared 2-core box: other processes' work lands in the measured times, never in the
model, and only as an excess. So the calibration takes best cases (``calibrate``) and the check likewise
repeats the generation and takes, step by step, the fastest of the runs (a burst of load slows one run's
steps, rarely the same step of every run). Without a GPU, T_cpu and T_tx are thread CPU times (``Engine``),
which leave out the time other processes hold the CPUs. No skip: the check runs under load too."""

from statistics import median

import pytest

from host_runtime.hybridgen import calibrate, cli, perfmodel
from host_runtime.hybridgen.engine import Engine, EngineOptions
from host_runtime.hybridgen.evaluate import PrefillCache, long_english_text

from .test_hybridgen_model import smol  # noqa: F401 -- the fixture

CHECK_PROMPT_TOKENS = 1000  # ~4x the calibration's offloaded tokens (calibrate.IN_SITU_PROMPT)
CHECK_STEPS = 32
CHECK_RUNS = 3    # the generation is repeated; each step's measured time is its fastest run's
TOLERANCE = 0.25
ATTEMPTS = 2      # a second calibration if the first was skewed by a burst no minimum could drop


def calibrated(model, path):
    path.write_text(calibrate.to_toml(calibrate.measure(model)))
    return path


def model_over_measured(model, tok, platform, strategy, prefill) -> dict[str, float]:
    """Median over CHECK_STEPS steps of the per-step ratio of modelled to measured time, for T_cpu and T_tx;
    a step's measured time is the fastest of CHECK_RUNS runs (``generate --strategy post --k-min 64``)."""
    ids = tok.encode(long_english_text())[:CHECK_PROMPT_TOKENS]
    opts = EngineOptions(method="hybridgen", strategy=strategy, resident_budget=32, k_min=64, k_max=512,
                         platform=str(platform), capacity=CHECK_PROMPT_TOKENS + CHECK_STEPS + 4)
    runs = []
    for _ in range(CHECK_RUNS):
        with Engine(model, opts) as eng:
            eng.generate(ids, CHECK_STEPS + 2, prefilled=prefill(eng, ids))
            runs.append(eng.steps[1:CHECK_STEPS + 1])  # the first step is cold (the scheduler ignores it too)
    assert all(len(r) == CHECK_STEPS for r in runs)
    fields = ("t_cpu", "t_tx", "model_t_cpu", "model_t_tx")
    # the model's times depend on the placement, never on timing: every run models the same steps
    assert all([getattr(s, f) for s in r for f in fields[2:]] == [getattr(s, f) for s in runs[0] for f in fields[2:]]
               for r in runs)
    steps = calibrate.fastest_runs(runs, fields)
    return {name: median(s[f"model_t_{name}"] / s[f"t_{name}"] for s in steps) for name in ("cpu", "tx")}


def test_calibrated_file_loads_as_a_platform(smol, tmp_path):  # noqa: F811
    p = perfmodel.load_platform(str(calibrated(smol[0], tmp_path / "here.toml")))
    assert p.cpu_bw > 0 and p.cpu_flops > 0 and p.has_cxl and p.element_bytes == 4
    assert p.cpu_task_overhead > 0 and p.pcie_lat > 0 and p.cxl_lat > 0 and p.cxl_request_overhead >= 0
    assert p.cxl_stage_bw >= 0


def test_the_cxl_line_separates_the_fixed_cost_from_the_cost_per_read():
    fixed, per_read, link, row, bw, staging = 200e-6, 5e-6, 50e-6, 768, 1e9, 30e-6
    runs = [{"cxl_reads": reads, "t_tx": link + staging + fixed + reads * per_read + k * row / bw}
            for reads, k in ((30, calibrate.IN_SITU_K), (10, calibrate.IN_SITU_K_FEW))]
    assert calibrate.cxl_line(*runs, link, row, bw, staging) == pytest.approx((fixed, per_read))
    runs[1]["t_tx"] = runs[0]["t_tx"] + 1e-3  # noise: fewer reads took longer; no negative cost per read
    assert calibrate.cxl_line(*runs, link, row, bw, staging)[1] == 0


def test_model_within_25_percent_of_generate_on_this_machine(smol, tmp_path):  # noqa: F811
    """Calibrate, then generate 1000 tokens in with post-QKᵀ pinned at K = 64 (``generate --strategy post
    --k-min 64``): within ±25 % passes; a second attempt recalibrates.

    Not checked: Algorithm 1's own run, where K grows to ~300. There the measured CPU time exceeds the
    model by 25-40 %: the accelerator's thread does more transfer work beside the CPU job, and the two
    threads share this machine's two vCPUs — an interference the model does not describe.
    """
    strategy = "post"
    model, tok = smol
    seen, prefill = [], PrefillCache(model)
    for _ in range(ATTEMPTS):
        ratios = model_over_measured(model, tok, calibrated(model, tmp_path / "here.toml"), strategy, prefill)
        seen.append({k: round(v, 3) for k, v in ratios.items()})
        if all(1 - TOLERANCE <= r <= 1 + TOLERANCE for r in ratios.values()):
            print(f"model / measured, per attempt: {seen}")  # shown by pytest -rP
            return
    pytest.fail(f"model / measured outside 1 ± {TOLERANCE} in every attempt: {seen}")


def test_calibrate_command_writes_a_platform_file(smol, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(cli, "_load", lambda: smol)
    monkeypatch.setattr(calibrate, "measure", lambda model: {
        "name": "stub", "gpu": {"memory_bandwidth_gbps": 1.0}, "cpu": {}, "link": {}, "cxl": {}, "scenario": {}})
    out = tmp_path / "p.toml"
    args = cli.build_parser_for_tests().parse_args(["calibrate", "--out", str(out)])
    assert args.func(args) == 0
    assert 'name = "stub"' in out.read_text() and "memory_bandwidth_gbps = 1" in out.read_text()
