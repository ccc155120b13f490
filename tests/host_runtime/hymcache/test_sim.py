"""``chm hymcache simulate``: the serving simulation's rules, on small settings (seconds in all).

Each tier's rule is checked where it lives (the tier, the staging buffer, the GPU cache) and end to end
through ``simulate_tier``: LRU chain breaking in LMCache, a refused insertion offered again next turn,
a timed-out load recomputed, staging back-pressure, recomputation growing with the turn, determinism.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

from host_runtime.hymcache.sim.config import FIELDS, load_settings, preset_path
from host_runtime.hymcache.sim.events import Env
from host_runtime.hymcache.sim.gpucache import GpuPrefixCache
from host_runtime.hymcache.sim.run import device_config, simulate, simulate_tier, write_json
from host_runtime.hymcache.sim.tiers import HyMCacheTier, Host, LMCacheLocal, Staging
from host_runtime.hymcache.sim.worker import Request
from host_runtime.hymcache.sim.workload import Turn, conversations

ROOT = Path(__file__).resolve().parents[3]
CHM = ROOT / ".venv" / "bin" / "chm"
MiB, GiB = 1 << 20, 1 << 30
B_TOKENS = 128
BLOCK = 16 * MiB  # Llama-3.1-8B, 128 tokens


def small(**over) -> dict:
    """The Fig. 13 preset, shrunk: few conversations and turns, each of LMSYS's own size (the preset's calibrated
    turn size would pass these tests' small GPUs)."""
    s = load_settings(preset_path(13))
    s.update({"workload.conversations": 8, "workload.turns": 3, "workload.concurrency": 4, "workload.turn_tokens": 0.0})
    s.update(over)
    return s


def fixed_turns(convs: int, turns: int, tokens_per_turn: int) -> list[list[Turn]]:
    """Every conversation's turn t sends t x tokens_per_turn tokens (+1: the last token is never looked up)."""
    return [[Turn(c, t, t * tokens_per_turn + 1, (t - 1) * tokens_per_turn + 1 if t > 1 else 0)
             for c in range(convs)] for t in range(1, turns + 1)]


def request(env: Env, conv: int, turn: int, blocks: int, prev_blocks: int = 0) -> Request:
    return Request(Turn(conv, turn, blocks * B_TOKENS + 1, prev_blocks * B_TOKENS + 1 if prev_blocks else 0),
                   B_TOKENS, 1, env.event())


def pause(env: Env, ns: float):
    yield env.now + ns


def run_proc(env: Env, gen):
    p = env.process(gen)
    env.run()
    assert p.done.fired
    return p.done.value


# ---------------------------------------------------------------------------- LMCache: chains and LRU
def test_lmcache_prefix_is_unusable_past_an_evicted_early_chunk():
    env = Env()
    host = Host(env, 25.0, 0.0, 1 * GiB)
    tier = LMCacheLocal(env, host, BLOCK, B_TOKENS, dram_bytes=4 * 32 * MiB, chunk_tokens=256)  # 4 chunks
    a = request(env, 0, 1, 8)  # conversation 0: 8 blocks = 4 chunks, fills the cache
    tier.reserve_store(a)
    run_proc(env, tier.store(a))
    nxt = request(env, 0, 2, 9, prev_blocks=8)
    assert tier.lookup(nxt) == 8
    tier.finish(nxt)  # served elsewhere: its lookup's pins go
    # conversation 0 reads chunks 1..3 (chunk 0 stays least recently used), then conversation 1 stores a chunk
    reader = request(env, 0, 2, 9, prev_blocks=8)
    reader.gpu_hit = 2  # the GPU holds chunk 0: only chunks 1..3 are read (and touched)
    assert tier.lookup(reader) == 6
    assert run_proc(env, tier.load(reader, 6)) == 6
    b = request(env, 1, 1, 2)
    tier.reserve_store(b)
    run_proc(env, tier.store(b))
    assert (0, 0) not in tier.lru and all((0, c) in tier.lru for c in (1, 2, 3))
    assert tier.lookup(nxt) == 0  # chunks 1..3 are there, but the chain breaks at chunk 0


def test_lmcache_thrashes_end_to_end_when_the_footprint_passes_its_dram():
    # 16 conversations x 8 blocks per turn; LMCache holds 130 chunks (4160 MiB), the GPU ~1 GiB. Turn 2 reuses 64
    # chunks and adds 64 (fits); turn 3 reuses 128 and adds 64: more than LMCache holds
    s = small(**{"tiers.run": ["lmcache-local"], "tiers.dram": 4160 * MiB, "gpu.gpu_memory_utilization": 0.22})
    out = simulate_tier("lmcache-local", s, fixed_turns(16, 3, 8 * B_TOKENS))
    rows = out["rows"]
    assert rows[1]["hit_rate"] == pytest.approx(1.0)
    # cyclic access under LRU: the conversations served first store new chunks, which evicts the oldest: the
    # first chunks of the conversations still to come; only those already looked up (pinned) keep their chains
    assert rows[2]["hit_rate"] < 0.5 and rows[2]["recomputed_tokens"] > 0
    assert out["details"]["chunks"] == out["details"]["capacity_chunks"]


# ---------------------------------------------------------------------------- GPU prefix cache
def test_gpu_prefix_cache_evicts_a_finished_requests_tail_first():
    cache = GpuPrefixCache(4)
    assert cache.allocate([], 4)
    cache.cache(["a0", "a1", "a2", "a3"])
    cache.free(["a0", "a1", "a2", "a3"], 0)
    assert cache.allocate([], 1)  # evicts one: the tail (a3), not the head
    assert cache.match(["a0", "a1", "a2", "a3"]) == 3


# ---------------------------------------------------------------------------- HyMCache: skipped and retried
def hymcache_tier(env: Env, dram: int = 64 * MiB, timeout_s: float = 10.0, staging: int = 1 * GiB, **overrides):
    cfg = device_config("paper", dram, "hymcache")
    if overrides:
        cfg = cfg.with_overrides(overrides)
    return HyMCacheTier(env, Host(env, 25.0, 10_000.0, staging), BLOCK, cfg, window_bytes=128 * MiB,
                        timeout_s=timeout_s)


def test_a_refused_insertion_is_skipped_then_offered_again_next_turn():
    env = Env()
    tier = hymcache_tier(env)  # 64 MiB of device DRAM: a 16 MiB write buffer holds one block
    assert tier.cfg.write_buffer_frames * tier.cfg.device.page_size_bytes == BLOCK
    r1 = request(env, 0, 1, 3)
    tier.reserve_store(r1)
    run_proc(env, tier.store(r1))
    assert r1.skipped_inserts == 2 and tier.counters["written_blocks"] == 1
    assert len(tier.master.lookup(tier.keys(0, 3))) == 1  # only the block the device took is stored
    run_proc(env, pause(env, 1e9))  # a second later: the write buffer has been flushed (reads are idle)
    r2 = request(env, 0, 2, 3, prev_blocks=3)
    assert tier.lookup(r2) == 1
    run_proc(env, tier.load(r2, 1))
    tier.finish(r2)
    tier.reserve_store(r2)  # the skipped blocks are offered again (the Master gives them places)...
    assert tier.counters["put_blocks"] == 3 + 2
    run_proc(env, tier.store(r2))
    assert r2.skipped_inserts == 1  # ...the buffer takes one of them this time
    assert len(tier.master.lookup(tier.keys(0, 3))) == 2


def test_skipped_insertions_end_to_end_are_retried_and_counted():
    s = small(**{"tiers.run": ["hymcache"], "tiers.dram": 64 * MiB, "gpu.gpu_memory_utilization": 0.25})
    out = simulate_tier("hymcache", s, fixed_turns(4, 3, 4 * B_TOKENS))
    skipped = [r["skipped_inserts"] for r in out["rows"]]
    assert skipped[0] > 0 and sum(skipped) == out["details"]["refused_writes"]
    # offered blocks = new blocks of each turn + the ones skipped the turn before
    assert out["details"]["put_blocks"] > 4 * 3 * 4


# ---------------------------------------------------------------------------- timeout -> recompute
def test_a_load_not_done_within_the_timeout_is_recomputed():
    base = small(**{"tiers.run": ["hymcache"], "gpu.gpu_memory_utilization": 0.22})
    turns = fixed_turns(8, 3, 8 * B_TOKENS)
    ok = simulate_tier("hymcache", base, turns)
    assert ok["details"]["loaded_blocks"] > 0 and ok["details"]["timeouts"] == 0
    assert ok["rows"][2]["hit_rate"] == pytest.approx(1.0) and ok["rows"][2]["recomputed_tokens"] == 0
    late = simulate_tier("hymcache", {**base, "tiers.load_timeout_s": 1e-6}, turns)  # every read takes longer
    assert late["details"]["timeouts"] > 0 and late["details"]["loaded_blocks"] == 0
    assert late["rows"][2]["hit_rate"] == 0.0
    row = late["rows"][2]
    assert row["recomputed_tokens"] == row["reusable_tokens"] - row["gpu_hit_tokens"] > 0
    assert late["rows"][2]["ttft_p50_ms"] > ok["rows"][2]["ttft_p50_ms"]


def test_timeout_mid_load_keeps_the_blocks_before_it():
    env = Env()
    tier = hymcache_tier(env, dram=1 * GiB, timeout_s=10.0)
    r1 = request(env, 0, 1, 4)
    tier.reserve_store(r1)
    run_proc(env, tier.store(r1))
    run_proc(env, pause(env, 1e9))
    r2 = request(env, 0, 2, 4, prev_blocks=4)
    assert tier.lookup(r2) == 4
    tier.timeout_ns = 1.5e6  # 1.5 ms: a 16 MiB block takes ~1 ms from SSD to host, the second one lands later
    loaded = run_proc(env, tier.load(r2, 4))
    assert 0 < loaded < 4 and r2.timeouts == 1
    assert tier.manager.requests == {}  # the Manager forgot the request (its window released)


# ---------------------------------------------------------------------------- staging back-pressure
def test_staging_buffer_makes_loads_wait_and_never_overflows():
    env = Env()
    st = Staging(env, 2 * BLOCK)
    order = []

    def user(name, hold_ns):
        yield from st.take(BLOCK)
        order.append((name, env.now))
        yield env.now + hold_ns
        st.give(BLOCK)

    for i, hold in enumerate((5.0, 5.0, 1.0, 1.0)):
        env.process(user(i, hold))
    env.run()
    assert [n for n, _ in order] == [0, 1, 2, 3] and [t for _, t in order] == [0.0, 0.0, 5.0, 5.0]
    assert st.peak == 2 * BLOCK and st.used == 0 and st.waits == 2


def test_a_small_staging_buffer_slows_loads_end_to_end():
    s = small(**{"tiers.run": ["hymcache"], "gpu.gpu_memory_utilization": 0.22})
    turns = fixed_turns(8, 3, 8 * B_TOKENS)
    roomy = simulate_tier("hymcache", s, turns)
    tight = simulate_tier("hymcache", {**s, "tiers.staging": BLOCK}, turns)  # one block of transfer space
    assert roomy["summary"]["staging_waits"] == 0 and tight["summary"]["staging_waits"] > 0
    assert tight["summary"]["staging_peak_bytes"] <= BLOCK
    # a load's next block waits until the previous one has crossed PCIe: slower per block
    per_block = {name: r["summary"]["load_s"] / r["details"]["loaded_blocks"] for name, r in
                 (("roomy", roomy), ("tight", tight))}
    assert per_block["tight"] > per_block["roomy"], per_block
    # stores take only the room free now: the rest is skipped (and offered again next turn)
    assert roomy["details"]["staging_skips"] == 0 < tight["details"]["staging_skips"]


# ---------------------------------------------------------------------------- recompute grows; determinism
def test_recompute_latency_grows_every_turn():
    rows = simulate_tier("recompute", small(**{"workload.turns": 5}))["rows"]
    ttft = [r["ttft_mean_ms"] for r in rows]
    assert all(b > a for a, b in zip(ttft, ttft[1:])), ttft
    assert all(r["hit_rate"] in (None, 0.0) for r in rows)


def test_two_runs_write_identical_json(tmp_path):
    s = small(**{"tiers.run": ["recompute", "gpu-prefix", "lmcache-local", "hymcache"], "tiers.dram": 256 * MiB,
                 "gpu.gpu_memory_utilization": 0.22, "workload.conversations": 12})
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"run{i}.json")
        write_json(simulate(s), str(paths[-1]))
    assert paths[0].read_bytes() == paths[1].read_bytes()
    rows = json.loads(paths[0].read_text())["rows"]
    assert len(rows) == 4 * 3 and set(rows[0]) >= {"tier", "turn", "hit_rate", "ttft_p50_ms", "ttft_p99_ms", "e2e_ms",
                                                     "read_gbps", "write_gbps", "skipped_inserts", "recomputed_tokens"}


def test_workload_histories_grow_and_reuse_the_previous_turn():
    turns = conversations(3, 4, seed=1)
    for c in range(3):
        inputs = [turns[t][c].input_tokens for t in range(4)]
        assert all(b > a for a, b in zip(inputs, inputs[1:]))
        assert [turns[t][c].prev_input_tokens for t in range(4)] == [0] + inputs[:-1]


# ---------------------------------------------------------------------------- the preset and the command
def test_every_preset_number_names_its_source():
    tags = re.compile(r"#\s*\[(paper|LMSYS|vLLM|LMCache|runtime|assumption|AIPerf|Mooncake|Redis)\]")
    for line in preset_path(13).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#") and not line.startswith(("number", "title")):
            assert tags.search(line), f"no source on: {line}"
    assert {f.key for f in FIELDS} <= set(load_settings(preset_path(13)))


def test_cli_errors_name_the_flag_the_value_and_the_range(tmp_path):
    r = subprocess.run([str(CHM), "hymcache", "simulate", "--conversations", "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == ("chm hymcache simulate: error: --conversations 0 is outside the allowed "
                                         "range: an integer in [1, 1000000]")
    bad = tmp_path / "bad.toml"
    bad.write_text(preset_path(13).read_text().replace("concurrency = 32", "concurrency = -1"))
    r = subprocess.run([str(CHM), "hymcache", "simulate", "--preset", str(bad)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "bad.toml: workload.concurrency -1 is outside the allowed range" in r.stderr


def test_cli_runs_a_small_preset_with_json_and_plot(tmp_path):
    r = subprocess.run([str(CHM), "hymcache", "simulate", "--conversations", "4", "--turns", "2", "--tiers",
                        "gpu-prefix,hymcache", "--json", str(tmp_path / "o.json"), "--plot", str(tmp_path / "o.png"),
                        "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "hymcache" in r.stdout and (tmp_path / "o.png").stat().st_size > 1000
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert [(x["tier"], x["turn"]) for x in rows] == [("gpu-prefix", 1), ("gpu-prefix", 2), ("hymcache", 1),
                                                       ("hymcache", 2)]
