"""The simulation's workloads beyond the generated chat: Mooncake JSONL traces (open loop, hash ids as block
keys, the replayer's reader), LMSYS prompts over a length (Fig. 15), the prefetch on/off tiers and the read
bandwidth's peak; the Fig. 15 preset."""

from __future__ import annotations

import json
import math
import re
from statistics import NormalDist

import pytest

from emulator.cli import main as chm_main
from emulator.shared_data import mooncake_conversation_trace
from host_runtime.hymcache.sim.config import FIELDS, load_settings, preset_path
from host_runtime.hymcache.sim.events import Env
from host_runtime.hymcache.sim.run import _peak, simulate_tier
from host_runtime.hymcache.sim.tiers import chunk_key
from host_runtime.hymcache.sim.worker import Request, open_client
from host_runtime.hymcache.sim.workload import conversations, footprints, mooncake_requests
from host_runtime.replay.traces import MooncakeTrace

B_TOKENS = 128
BLOCK = 16 << 20  # Llama-3.1-8B, 128 tokens


def _trace(tmp_path, records) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


RECORDS = [  # hand-written, Mooncake's format: hash 0 shared by all, request 1 extends request 0
    {"timestamp": 1000, "input_length": 900, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 2500, "input_length": 1400, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 3200, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]},
    {"timestamp": 6000, "input_length": 300, "output_length": 5, "hash_ids": [4]},
]


# ---------------------------------------------------------------------------- Mooncake traces
def test_a_trace_gives_requests_at_their_timestamps_with_hash_blocks_as_keys(tmp_path):
    path = _trace(tmp_path, RECORDS)
    windows = mooncake_requests(path, tokens_per_block=B_TOKENS, block_bytes=BLOCK, window_s=2.0, prefill_workers=2)
    reader = MooncakeTrace(path, BLOCK, B_TOKENS)  # the replayer's reader: its keys are the simulation's keys
    turns = [t for w in windows for t in w]
    assert [t.keys for t in turns] == [tuple(reader.keys_of(ids)) for _, ids in reader.records]
    assert turns[1].keys[:8] == turns[0].keys and turns[2].keys[:4] == turns[0].keys[:4] != turns[3].keys[:4]
    # arrivals counted from the first timestamp (ms -> ns); rows are the 2 s windows with arrivals
    assert [t.arrival_ns for t in turns] == [0.0, 1.5e9, 2.2e9, 5.0e9]
    assert [[t.conversation for t in w] for w in windows] == [[0, 1], [2], [3]]
    assert [t.turn for t in turns] == [1, 1, 2, 3]
    # the input is the record's input_length, the answer its output_length; the reusable prefix is the whole
    # blocks an earlier request computed (request 0's 900 tokens: 7 blocks of 128, not its 8 keys)
    assert [t.input_tokens for t in turns] == [900, 1400, 700, 300]
    assert [t.output_tokens for t in turns] == [5, 5, 5, 5]
    assert [t.prev_input_tokens // B_TOKENS for t in turns] == [0, 7, 4, 0]
    assert [t.worker for t in turns] == [0, 1, 0, 1]
    fp = footprints(windows, BLOCK // B_TOKENS, B_TOKENS)
    assert fp["kv_footprint_bytes"] == 5 * 4 * BLOCK and fp["reusable_footprint_bytes"] == 7 * BLOCK
    # time_scale and limit are the reader's
    half = mooncake_requests(path, tokens_per_block=B_TOKENS, block_bytes=BLOCK, window_s=2.0, time_scale=0.5, limit=3)
    assert [t.arrival_ns for w in half for t in w] == [0.0, 0.75e9, 1.1e9]


def test_trace_requests_key_blocks_and_chunks_by_hash_not_by_conversation(tmp_path):
    windows = mooncake_requests(_trace(tmp_path, RECORDS), tokens_per_block=B_TOKENS, block_bytes=BLOCK)
    env = Env()
    a, b, c, d = (Request(t, B_TOKENS, 1, env.event()) for w in windows for t in w)
    assert [a.gpu_key(i) for i in range(8)] == [b.gpu_key(i) for i in range(8)]
    assert [c.gpu_key(i) for i in range(4)] == [a.gpu_key(i) for i in range(4)] and c.gpu_key(4) != a.gpu_key(4)
    assert chunk_key(b, 3, 2) == chunk_key(a, 3, 2) and chunk_key(c, 2, 2) != chunk_key(a, 2, 2)
    assert chunk_key(d, 0, 2) != chunk_key(a, 0, 2)


def test_the_open_loop_client_submits_each_request_at_its_arrival(tmp_path):
    windows = mooncake_requests(_trace(tmp_path, RECORDS), tokens_per_block=B_TOKENS, block_bytes=BLOCK, window_s=2.0)
    env = Env()
    submitted, starts = [], []

    class Instant:  # serves a request in 10 ms, however many are in flight
        def submit(self, req):
            submitted.append((req.conv, env.now))
            env.call_at(env.now + 1e7, lambda: req.done.succeed(req))

    p = env.process(open_client(env, windows, [Instant()], tokens_per_block=B_TOKENS, max_tokens=1, window_ns=2e9,
                                on_turn_start=lambda w, now: starts.append((w, now)), on_done=lambda r: None))
    env.run()
    assert p.done.fired
    assert submitted == [(0, 0.0), (1, 1.5e9), (2, 2.2e9), (3, 5.0e9)]
    assert starts == [(1, 0.0), (2, 2e9), (3, 4e9)]


@pytest.mark.parametrize("decode_tokens", [0, 1])
def test_a_trace_request_decodes_its_own_output_length(tmp_path, decode_tokens):
    records = [dict(RECORDS[0], output_length=7), {k: v for k, v in RECORDS[3].items() if k != "output_length"}]
    windows = mooncake_requests(_trace(tmp_path, records), tokens_per_block=B_TOKENS, block_bytes=BLOCK)
    env, answers = Env(), []

    class Record:
        def submit(self, req):
            answers.append((req.max_tokens, req.decode_tokens))
            env.call_at(env.now + 1, lambda: req.done.succeed(req))

    env.process(open_client(env, windows, [Record()], tokens_per_block=B_TOKENS, max_tokens=3, window_ns=600e9,
                            on_turn_start=lambda w, now: None, on_done=lambda r: None, decode_tokens=decode_tokens))
    env.run()
    # the record's output_length, where it has one (PD: on the decode worker); else the settings' max_tokens
    assert answers == ([(7, 0), (3, 0)] if not decode_tokens else [(3, 7), (3, 1)])


@pytest.mark.parametrize("field, value, text", [
    ("input_length", 1025, "input_length = 1025 is more than its 2 hash blocks cover (1024 tokens)"),
    ("input_length", 0, "input_length = 0 must be an integer >= 1"),
    ("input_length", True, "input_length = True must be an integer >= 1"),
    ("output_length", -1, "output_length = -1 must be an integer >= 0"),
    ("output_length", "5", "output_length = '5' must be an integer >= 0"),
])
def test_the_readers_lengths_are_checked_with_the_line_named(tmp_path, field, value, text):
    path = _trace(tmp_path, [RECORDS[0], dict(RECORDS[0], **{field: value})])
    with pytest.raises(ValueError) as e:
        MooncakeTrace(path, BLOCK, B_TOKENS)
    assert ":2: not a Mooncake record" in str(e.value) and text in str(e.value)


def test_a_prefix_of_the_shared_mooncake_trace_is_simulated_open_loop():
    try:
        mooncake_conversation_trace()
    except FileNotFoundError:
        pytest.skip("the shared Mooncake conversation trace is not here")
    s = load_settings(preset_path(13))
    # 200 requests, a GPU KV cache of ~960 blocks: some prefixes are reused after the GPU has evicted them
    s.update({"workload.kind": "mooncake", "workload.trace_limit": 200, "workload.window_s": 10.0,
              "gpu.gpu_memory_utilization": 0.4})
    runs = {t: simulate_tier(t, s) for t in ("recompute", "gpu-prefix", "hymcache")}
    rows = {t: r["rows"] for t, r in runs.items()}
    assert sum(r["requests"] for r in rows["hymcache"]) == 200 and len(rows["hymcache"]) >= 2  # windows of arrivals
    reusable = [r["reusable_tokens"] for r in rows["recompute"]]
    assert sum(reusable) > 0 and all([r["reusable_tokens"] for r in rows[t]] == reusable for t in rows)
    # the trace's shared prefixes are reused across requests: by the GPU's prefix cache, and from the tier
    assert sum(r["gpu_hit_tokens"] for r in rows["gpu-prefix"]) > 0
    assert sum(r["loaded_tokens"] for r in rows["hymcache"]) > 0
    assert sum(r["recomputed_tokens"] for r in rows["recompute"]) == sum(reusable)
    assert runs["hymcache"]["summary"]["recomputed_tokens"] < runs["gpu-prefix"]["summary"]["recomputed_tokens"]


def test_trace_settings_that_cannot_work_are_usage_errors(tmp_path, capsys):
    assert chm_main(["hymcache", "simulate", "--workload", "mooncake", "--chunk-tokens", "1024"]) == 2
    assert "--chunk-tokens 1024 must divide the Mooncake trace's hash block of 512 tokens" in capsys.readouterr().err
    missing = str(tmp_path / "nosuch.jsonl")
    assert chm_main(["hymcache", "simulate", "--workload", "mooncake", "--trace", missing]) == 2
    assert f"--trace {missing!r}: no such file" in capsys.readouterr().err


# ---------------------------------------------------------------------------- Fig. 15: long prompts, prefetch
def test_long_prompts_are_lmsys_prompts_conditioned_on_their_length():
    m, mean = 500, 69.5
    turns = conversations(400, 4, min_prompt_tokens=m, seed=3)
    prompts = []
    for c in range(400):
        history = [turns[t][c] for t in range(4)]
        prompts.append(history[0].input_tokens)
    assert min(prompts) >= m
    a = math.log(m * math.exp(0.5) / mean)  # lognormal(0, 1) / e^(1/2) x mean over m: z > a
    expected = mean * NormalDist().cdf(1 - a) / NormalDist().cdf(-a)  # E[X | X >= m], ~730 tokens
    assert abs(sum(prompts) / len(prompts) - expected) < 0.06 * expected
    assert conversations(20, 3, min_prompt_tokens=0, seed=3) == conversations(20, 3, seed=3)  # 0: no filter


def test_prefetch_on_and_off_are_the_same_device_and_master_with_and_without_the_managers_window():
    s = load_settings(preset_path(15))
    s.update({"workload.conversations": 16, "workload.turns": 3, "gpu.gpu_memory_utilization": 0.25})
    on, off = simulate_tier("hymcache", s), simulate_tier("hymcache-noprefetch", s)
    d_on, d_off = on["details"], off["details"]
    assert d_on["device_policy"] == d_off["device_policy"] == "hymcache"
    assert d_on["loaded_blocks"] == d_off["loaded_blocks"] > 0
    assert d_on["manager"]["prefetches"] == d_on["loaded_blocks"] and d_off["manager"]["hints"] == 0
    assert d_on["device"]["prefetch_staged_pages"] > 0 == d_off["device"]["prefetch_staged_pages"]
    assert d_off["device"]["page_misses"] > 0  # demand reads
    for r in (on, off):
        row = r["rows"][-1]
        assert 0 < row["read_gbps"] < row["read_gbps_loading"] <= 25.0 + 1e-9  # the 200 Gbps link bounds it
        assert 0 < row["read_gbps_peak"] <= 25.0 + 1e-9


def test_the_peak_is_the_busiest_window_with_each_load_spread_over_its_span():
    ms = 1e6
    assert _peak([], 100 * ms) == 0.0
    assert _peak([(0, 50 * ms, 10 ** 9)], 100 * ms) == pytest.approx(10.0)  # 1 GB in one 100 ms window: 10 GB/s
    # 2 GB over 150-250 ms: half in each of two windows; with 0.5 GB more at 120 ms the first is the peak
    assert _peak([(150 * ms, 250 * ms, 2 * 10 ** 9)], 100 * ms) == pytest.approx(10.0)
    both = [(150 * ms, 250 * ms, 2 * 10 ** 9), (120 * ms, 120 * ms, 5 * 10 ** 8)]
    assert _peak(both, 100 * ms) == pytest.approx(15.0)


def test_the_fig15_preset_names_a_source_for_every_number():
    s = load_settings(preset_path(15))
    assert s["figure.number"] == 15 and s["tiers.run"] == ["hymcache", "hymcache-noprefetch"]
    assert (s["workload.kind"], s["workload.conversations"], s["workload.concurrency"], s["workload.turns"],
            s["workload.min_prompt_tokens"]) == ("lmsys", 512, 64, 6, 500)
    tags = re.compile(r"#\s*\[(paper|LMSYS|vLLM|LMCache|runtime|assumption|AIPerf|Mooncake|Redis)\]")
    for fig in (10, 11, 12, 13, 14, 15):
        text = preset_path(fig).read_text()
        for line in text.splitlines():
            if "=" in line and not line.lstrip().startswith("#") and not line.startswith(("number", "title")):
                assert tags.search(line), f"fig{fig}.toml: no source on: {line}"
        assert {f.key for f in FIELDS} <= set(load_settings(preset_path(fig)))


# ---------------------------------------------------------------------------- the calibrated turn size (Fig. 13, 15)
PAPER_TURN_GROWTH = 64e9  # "the prefix-read footprint added between Turn 6 and Turn 7 alone exceeds 64 GB"


def test_turn_tokens_scales_both_means_in_lmsys_split_and_zero_leaves_them():
    from host_runtime.hymcache.sim.workload import LMSYS_PROMPT_TOKENS, LMSYS_RESPONSE_TOKENS, scaled_means

    assert scaled_means(69.5, 214.5, 0.0) == (69.5, 214.5)
    prompt, response = scaled_means(LMSYS_PROMPT_TOKENS, LMSYS_RESPONSE_TOKENS, 953.0)
    assert prompt + response == pytest.approx(953.0) and prompt / response == pytest.approx(69.5 / 214.5)
    # the draws follow: 2,000 conversations' mean turn is within 5 % of the asked size
    turns = conversations(2000, 3, turn_tokens=953.0, seed=3)
    grown = sum(b.input_tokens - a.input_tokens for a, b in zip(turns[1], turns[2])) / 2000
    assert grown == pytest.approx(953.0, rel=0.05)
    assert conversations(5, 3, seed=3) == conversations(5, 3, turn_tokens=0.0, seed=3)


@pytest.mark.parametrize("figure", [13, 15])
def test_the_calibrated_presets_add_the_papers_prefix_footprint_a_turn(figure):
    """Fig. 13: the turn 6 -> 7 growth is the paper's 64 GB (within the claims' 10 %); Fig. 15 (the same generator,
    prompts over 2K characters) adds more than that ("exceeds") every turn from turn 2 on."""
    from host_runtime.hymcache.sim.run import make_turns
    from host_runtime.replay.models import get_model

    s = load_settings(preset_path(figure))
    growth = footprints(make_turns(s), get_model(s["model.name"]).bytes_per_token,
                        s["model.tokens_per_block"])["prefix_growth_bytes"]
    if figure == 13:
        assert growth["6-7"] == pytest.approx(PAPER_TURN_GROWTH, rel=0.10)
        assert all(v == pytest.approx(PAPER_TURN_GROWTH, rel=0.10) for k, v in growth.items() if k != "1-2")
    else:
        assert all(v > PAPER_TURN_GROWTH for k, v in growth.items() if k != "1-2")


def test_simulate_on_recorded_turns_runs_the_files_conversations(tmp_path, capsys):
    """``--workload turns --trace FILE``: the command runs the file's turns, not the LMSYS generator."""
    from host_runtime.hymcache.sim.workload import write_turns

    path = write_turns(tmp_path / "t.json", [[300, 200, 250], [400, 150, 100]], output_tokens=1)
    out = tmp_path / "r.json"
    rc = chm_main(["hymcache", "simulate", "--workload", "turns", "--trace", str(path), "--tiers", "gpu-prefix",
                   "--no-progress", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["requests"] for r in rows] == [2, 2, 2]
    assert json.loads(out.read_text())["workload"]["requests"] == 6
