"""HybridGen on the real SmolLM2-135M (loaded once for this module)."""

import functools
import json

import pytest
import torch

from emulator.cli import UsageError
from host_runtime.hybridgen import cli
from host_runtime.hybridgen.engine import Engine, EngineOptions
from host_runtime.hybridgen.evaluate import EvalSettings, evaluate_methods, layer_input_similarity, long_english_text
from host_runtime.hybridgen.model import SmolLM2
from host_runtime.hybridgen.tokenizer import Tokenizer

PROMPT = "Write a short story about a robot who learns to paint."
ROW_BYTES_ALL_LAYERS = 30 * 3 * 64 * 4  # one token's K (or V) over SmolLM2's 30 layers, fp32


@functools.cache
def load_smol():
    """SmolLM2 and its tokenizer, loaded once per test session (the other hybridgen test modules import this)."""
    model = SmolLM2.load()
    return model, Tokenizer.from_gguf(model.tokenizer_reader)


@pytest.fixture(scope="module")
def smol():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # decode-sized ops: one thread avoids contention on a small shared box
    yield load_smol()
    torch.set_num_threads(threads)


@pytest.fixture
def loaded(smol, monkeypatch):
    """The CLI's loader answers with the already loaded model (it would load the same file again)."""
    monkeypatch.setattr(cli, "_load", lambda: smol)
    return smol


def test_model_shape_and_tokenizer_round_trip(smol):
    model, tok = smol
    c = model.cfg
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 9, 3, 64)
    text = tok.chat_prompt("Hello, world! 12345 café")
    ids = tok.encode(text)
    assert ids[0] == tok.control["<|im_start|>"] and tok.decode(ids) == text


def test_model_answers_a_factual_question(smol):
    """Q/K permutation and RoPE are right only if the model still knows things."""
    model, tok = smol
    ids = tok.encode(tok.chat_prompt("What is the capital of France?"))
    with Engine(model, EngineOptions(method="full", capacity=128)) as eng:
        out = eng.generate(ids, 8, eos_id=tok.eos_id)
    assert "Paris" in tok.decode(out)


def test_decode_step_equals_prefill(smol):
    model, tok = smol
    ids = tok.encode(long_english_text())[:40]
    with Engine(model, EngineOptions(method="hybridgen", selection=False, layer_ahead=False, resident_budget=7,
                                     host_dram_bytes=0, capacity=64)) as eng:  # every row in the CXL tier
        eng.prefill(torch.tensor(ids[:-1]))
        step_logits = eng.step(ids[-1])
    ref = model.prefill(torch.tensor(ids))[0][-1]
    assert (step_logits - ref).abs().max().item() < 1e-3


def test_greedy_64_tokens_identical_full_vs_hybridgen_without_selection(smol):
    model, tok = smol
    ids = tok.encode(tok.chat_prompt(PROMPT))
    with Engine(model, EngineOptions(method="full", capacity=160)) as eng:
        full = eng.generate(ids, 64)
    # 16 tokens resident, the rest offloaded into 100 rows per layer of host DRAM: K stays there, the oldest V
    # rows move to the emulated CXL device
    with Engine(model, EngineOptions(method="hybridgen", selection=False, layer_ahead=False, resident_budget=16,
                                     host_dram_bytes=100 * ROW_BYTES_ALL_LAYERS, capacity=160)) as eng:
        hybrid = eng.generate(ids, 64)
        last = eng.steps[-1]
    assert len(full) == 64 and hybrid == full
    assert last.offloaded > 50 and last.bytes["cxl_read"] > 0 and last.bytes["dram_read"] > 0
    assert last.k_in_cxl == 0 < last.v_in_cxl


def test_selection_changes_what_is_attended(smol):
    """With a tiny K the hybrid path really drops tokens: its logits move away from full attention."""
    model, tok = smol
    ids = tok.encode(long_english_text())[:80]
    outs = {}
    for k in (2, 200):
        with Engine(model, EngineOptions(method="hybridgen", k_min=k, k_max=k, layer_ahead=False,
                                         resident_budget=8, capacity=96)) as eng:
            eng.prefill(torch.tensor(ids[:-1]))
            outs[k] = eng.step(ids[-1])
    ref = model.prefill(torch.tensor(ids))[0][-1]
    assert (outs[200] - ref).abs().max() < 1e-3 < (outs[2] - ref).abs().max()


def test_every_method_generates(smol):
    model, tok = smol
    ids = tok.encode(long_english_text())[:48]
    for method in ("flexgen", "moe-lightning", "h2o", "keyformer", "streamingllm", "infinigen"):
        with Engine(model, EngineOptions(method=method, resident_budget=8, k_min=8, window=16, host_dram_bytes=0,
                                         capacity=64)) as eng:
            out = eng.generate(ids, 3)
            assert len(out) == 3 and len(eng.steps) == 2, method
            exact = method in ("flexgen", "moe-lightning")
            assert (eng.steps[-1].k == len(ids) + 1) if exact else (eng.steps[-1].k == 8), method


def test_generate_command_prints_text_and_step_stats(loaded, capsys):
    rc = cli.build_parser_for_tests().parse_args(["generate", "--prompt", "Name a color.", "--max-new-tokens", "4",
                                                  "--resident-budget", "8", "--k-min", "4", "--json"])
    assert rc.func(rc) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "hybridgen" and len(out["tokens"]) >= 1 and isinstance(out["text"], str)
    step = out["steps"][0]
    for key in ("k", "strategy", "t_cpu", "t_gpu", "t_tx", "bytes", "model_t_cpu"):
        assert key in step
    assert step["bytes"]["dram_read"] > 0


def test_generate_rejects_bad_method():
    with pytest.raises(UsageError, match="--method: invalid choice: 'nope'"):
        cli.build_parser_for_tests().parse_args(["generate", "--prompt", "x", "--method", "nope"])


def test_similarity_of_consecutive_layer_inputs(smol):
    model, tok = smol
    sims = layer_input_similarity(model, tok.encode(long_english_text())[:32])
    assert len(sims) == 29 and all(-1 <= s <= 1 for s in sims)
    assert sum(sims[2:]) / len(sims[2:]) > 0.8  # the premise of layer-ahead pipelining


def test_eval_rows_full_vs_static_window(smol):
    model, tok = smol
    settings = EvalSettings(context_tokens=96, scored_tokens=8, passkey_tokens=96, passkey_depths=(0.1, 0.9),
                            k_min=8, window=16)
    base = EngineOptions(resident_budget=8)
    rows = {r["method"]: r for r in evaluate_methods(model, tok, ["full", "streamingllm"], base, settings)}
    assert rows["full"]["agreement"] == 1.0
    assert rows["full"]["passkey_accuracy"] == 1.0
    assert rows["streamingllm"]["passkey_accuracy"] < 1.0  # the key at depth 0.1 is outside its window
    assert rows["full"]["perplexity"] < 100


def test_scheduler_runs_inside_the_engine_on_modelled_times(smol):
    model, tok = smol
    ids = tok.encode(long_english_text())[:60]
    with Engine(model, EngineOptions(method="hybridgen", timing="model", resident_budget=8, k_min=4, k_max=64,
                                     k_step=4, capacity=80)) as eng:
        eng.generate(ids, 5)
        assert len(eng.scheduler.history) == len(eng.steps) == 4
        assert [s.branch for s in eng.steps] == [d.branch for d in eng.scheduler.history]
        assert all(s.model_t_gpu > 0 and s.model_t_cpu > 0 for s in eng.steps)


def test_layer_ahead_uses_the_previous_layer_input(smol):
    """Speculated logits differ from exact ones, yet stay close (consecutive inputs are similar)."""
    model, tok = smol
    ids = tok.encode(long_english_text())[:60]
    outs = {}
    for ahead in (False, True):
        with Engine(model, EngineOptions(method="hybridgen", selection=False, layer_ahead=ahead, resident_budget=8,
                                         capacity=64)) as eng:
            eng.prefill(torch.tensor(ids[:-1]))
            outs[ahead] = eng.step(ids[-1])
    diff = (outs[True] - outs[False]).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(outs[True], outs[False], dim=0).item()
    assert diff > 1e-3 and cos > 0.9


def test_eval_command_json(loaded, capsys):
    args = cli.build_parser_for_tests().parse_args(
        ["eval", "--methods", "full,hybridgen", "--context-tokens", "48", "--scored-tokens", "4",
         "--passkey-tokens", "48", "--passkey-depths", "0.5", "--resident-budget", "8", "--k-min", "8", "--json"])
    assert args.func(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["full", "hybridgen"]
    assert set(rows[0]) == {"method", "perplexity", "agreement", "passkey_accuracy", "k_range", "post_qkt_fraction",
                            "offloaded", "decode_ms_per_token"}
    assert rows[1]["k_range"] == [8, 8] and rows[1]["post_qkt_fraction"] == 1.0


def test_similarity_command(loaded, capsys):
    args = cli.build_parser_for_tests().parse_args(["similarity", "--tokens", "16", "--json"])
    assert args.func(args) == 0
    assert len(json.loads(capsys.readouterr().out)) == 29


def test_interleaved_mapping_reads_k_pages_from_cxl_and_stays_exact(smol):
    model, tok = smol
    ids = tok.encode(long_english_text())[:50]
    with Engine(model, EngineOptions(method="full", capacity=64)) as eng:
        full = eng.generate(ids, 4)
    with Engine(model, EngineOptions(method="hybridgen", selection=False, layer_ahead=False, mapping="interleaved",
                                     resident_budget=8, capacity=64)) as eng:
        inter = eng.generate(ids, 4)
        b = eng.steps[-1].bytes
    assert inter == full
    # the CPU's scan of K touched CXL pages: more than the V rows alone would read
    assert b["cxl_read"] > b["dram_read"] / 4
