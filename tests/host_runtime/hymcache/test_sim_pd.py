"""``chm hymcache simulate``, second slice: the PD topology (4P-1D-1S), the mooncake-dram tier, AIPerf-style
workloads and the staging sweep, on small settings (seconds in all).

Each rule is checked where it lives and can fail: Mooncake's insert timeouts dropping chunks and breaking the
prefix chain, transfer-buffer back-pressure on loads and inserts, link sharing on the P->D path (a prefill
node's port and the decode node's aggregate link), the decode worker's admission and the prefill worker's
delayed free, the shared prefix of the AIPerf generator.
"""

import math

import pytest

from host_runtime.hymcache.sim.config import FIELDS, load_settings, preset_path
from host_runtime.hymcache.sim.events import Env
from host_runtime.hymcache.sim.run import runs, simulate, simulate_tier
from host_runtime.hymcache.sim.tiers import (Host, LMCacheLocal, MooncakePool, MooncakeTier, Nic, Staging, rdma)
from host_runtime.hymcache.sim.worker import Request
from host_runtime.hymcache.sim.workload import Turn, aiperf_conversations, reusable_footprint_bytes

MiB, GiB = 1 << 20, 1 << 30
B_TOKENS = 128
BLOCK = 1 * MiB          # small blocks: the rules, not the sizes, are under test
CHUNK = 2 * BLOCK        # 256-token chunks of 128-token blocks


def request(env, conv, turn, blocks, prev_blocks=0, shared_tokens=0):
    return Request(Turn(conv, turn, blocks * B_TOKENS + 1, prev_blocks * B_TOKENS + 1 if prev_blocks else 0,
                        shared_tokens), B_TOKENS, 1, env.event())


def run_proc(env, gen):
    p = env.process(gen)
    env.run()
    assert p.done.fired
    return p.done.value


def mooncake(env, *, staging=64 * MiB, nic_gbps=100.0, insert_timeout_s=30.0, timeout_s=10.0, capacity=1 * GiB):
    """A Mooncake tier on prefill node 1 whose pool's one segment lives on node 0: every put and get is remote."""
    hosts = [Host(env, 25.0, 0.0, staging, index=i, kv_nic=Nic(f"n{i}", nic_gbps, 0.0)) for i in range(2)]
    pool = MooncakePool(1, capacity, CHUNK, high_watermark=0.95, eviction_ratio=0.05, lease_s=5.0)
    tier = MooncakeTier(env, hosts[1], BLOCK, B_TOKENS, 256, pool, hosts, timeout_s=timeout_s,
                        insert_timeout_s=insert_timeout_s)
    return tier, pool, hosts


# ---------------------------------------------------------------------------- Mooncake: insert timeouts
def test_a_mooncake_insert_that_misses_its_timeout_is_dropped_and_breaks_the_chain():
    # 1 Gbps port: a 2 MiB chunk takes 16.8 ms to reach its segment; one chunk of transfer buffer; 20 ms timeout.
    # chunk 0 lands at 16.8 ms (in time); chunk 1 gets the slot then and lands at 33.6 ms (late: dropped);
    # chunk 2 would get the slot only at 33.6 ms, past the deadline: dropped without being sent
    env = Env()
    tier, pool, hosts = mooncake(env, staging=CHUNK, nic_gbps=1.0, insert_timeout_s=0.020)
    r1 = request(env, 0, 1, 6)
    tier.reserve_store(r1)
    run_proc(env, tier.store(r1))
    env.run()  # the async puts land
    assert r1.skipped_inserts == 2
    assert tier.counters["inserted"] == 1 and tier.counters["insert_late"] == 1
    assert tier.counters["insert_buffer_timeouts"] == 1
    assert set(pool.objects) == {(0, 0)} and not pool.pending and pool.seg_used == [1]
    r2 = request(env, 0, 2, 7, prev_blocks=6)
    assert tier.lookup(r2) == 2  # the chain stops at the dropped chunk 1
    # the same sequence with a timeout the puts meet: everything is stored, the whole prefix reusable
    env = Env()
    tier, pool, _ = mooncake(env, staging=CHUNK, nic_gbps=1.0, insert_timeout_s=1.0)
    r1 = request(env, 0, 1, 6)
    tier.reserve_store(r1)
    run_proc(env, tier.store(r1))
    env.run()
    assert r1.skipped_inserts == 0 and len(pool.objects) == 3
    assert tier.lookup(request(env, 0, 2, 7, prev_blocks=6)) == 6


def test_a_chunk_present_past_a_missing_one_is_not_reused():
    env = Env()
    tier, pool, _ = mooncake(env)
    r1 = request(env, 0, 1, 6)
    tier.reserve_store(r1)
    run_proc(env, tier.store(r1))
    env.run()
    assert tier.lookup(request(env, 0, 2, 7, prev_blocks=6)) == 6
    seg = pool.objects.pop((0, 1))  # chunk 1 gone (as a dropped insert leaves it)
    pool.seg_used[seg] -= 1
    assert (0, 2) in pool.objects
    assert tier.lookup(request(env, 0, 2, 7, prev_blocks=6)) == 2


def test_mooncake_master_evicts_the_least_recently_leased_past_its_high_watermark():
    pool = MooncakePool(2, 20 * CHUNK, CHUNK, high_watermark=0.95, eviction_ratio=0.05, lease_s=5.0)
    for i in range(19):  # 19 of 20: at the watermark
        assert pool.put_start(("a", i), 0.0) in (0, 1)
        assert pool.put_end(("a", i))
    pool.lease(("a", 0), 1e9)  # read at 1 s: leased until 6 s, and most recently used
    assert pool.put_start(("a", 0), 2e9) is None  # present: not stored twice
    assert pool.put_start(("b", 0), 2e9) is not None  # 20 > 0.95 x 20: evict ceil(5 % of 19) = 1 object first
    assert pool.counters["evictions"] == 1 and ("a", 1) not in pool.objects and ("a", 0) in pool.objects
    full = MooncakePool(1, 2 * CHUNK, CHUNK, high_watermark=1.0, eviction_ratio=0.05, lease_s=5.0)
    assert full.put_start("x", 0.0) == 0 and full.put_start("y", 0.0) == 0
    assert full.put_start("z", 0.0) == -1 and full.counters["put_no_space"] == 1  # pending puts cannot be evicted


# ---------------------------------------------------------------------------- transfer-buffer back-pressure
def test_staging_take_gives_up_at_its_deadline_and_lets_the_next_waiter_in():
    env = Env()
    st = Staging(env, 4 * MiB)
    got = []

    def user(name, n, deadline, hold):
        ok = yield from st.take(n, deadline)
        got.append((name, ok, env.now))
        if ok:
            yield env.now + hold
            st.give(n)

    env.process(user("a", 3 * MiB, math.inf, 10.0))
    env.process(user("b", 4 * MiB, 5.0, 0.0))    # needs everything: gives up at 5 ns
    env.process(user("c", 1 * MiB, math.inf, 0.0))  # fits behind "a" but queued behind "b" until b gives up
    env.run()
    assert got == [("a", True, 0.0), ("b", False, 5.0), ("c", True, 5.0)]
    assert st.timeouts == 1 and st.used == 0 and st.peak == 4 * MiB


def test_a_small_transfer_buffer_makes_mooncake_loads_and_inserts_wait():
    def load_time(staging):
        env = Env()
        tier, pool, hosts = mooncake(env, staging=staging, nic_gbps=8.0)
        r1 = request(env, 0, 1, 8)
        tier.reserve_store(r1)
        t0 = env.now
        run_proc(env, tier.store(r1))
        store_s = env.now - t0
        env.run()
        r2 = request(env, 0, 2, 9, prev_blocks=8)
        assert tier.lookup(r2) == 8
        t0 = env.now
        assert run_proc(env, tier.load(r2, 8)) == 8
        return env.now - t0, store_s, hosts[1].staging

    roomy, roomy_store, st_roomy = load_time(64 * MiB)
    tight, tight_store, st_tight = load_time(CHUNK)
    assert st_roomy.waits == 0 and st_tight.waits > 0 and st_tight.peak <= CHUNK
    # one chunk in flight at a time: each waits for the previous one's RDMA read and PCIe copy
    assert tight > 1.5 * roomy, (tight, roomy)
    # an insert holds its slot until its put lands: the next one waits (the step is back-pressured)
    assert tight_store > roomy_store


# ---------------------------------------------------------------------------- links: the P->D path
def test_pd_links_are_shared_fifo_pipes():
    n = 1 << 30
    one = 1 << 30  # bytes
    decode = Nic("decode", 200.0, 0.0)
    ports = [Nic(f"p{i}", 100.0, 0.0) for i in range(4)]
    alone = rdma(Nic("p", 100.0, 0.0), Nic("d2", 200.0, 0.0), 0.0, n)
    assert alone == pytest.approx(one / 12.5)  # a 100 Gbps port alone: 12.5 GB/s
    # four prefill nodes at once: the decode node's 200 Gbps is the bottleneck, the last lands at 4 n / 25 GB/s
    arrivals = [rdma(p, decode, 0.0, n) for p in ports]
    assert arrivals[0] == pytest.approx(one / 12.5) and arrivals[-1] == pytest.approx(4 * one / 25.0)
    # two requests of one prefill node share its port: the second waits for the first
    port, dec = Nic("p", 100.0, 0.0), Nic("d", 200.0, 0.0)
    first, second = rdma(port, dec, 0.0, n), rdma(port, dec, 0.0, n)
    assert second == pytest.approx(2 * first)


def pd_small(**over) -> dict:
    """The Fig. 10 preset, shrunk, with the turn-barrier client: every conversation's history between two of its
    turns, so the remote tier (not the GPU cache) serves the reuse (the clients: test_sim_client.py)."""
    s = load_settings(preset_path(10))
    s.update({"workload.conversations": 16, "workload.turns": 3, "workload.concurrency": 8,
              "workload.max_tokens": 8, "workload.input_tokens": 300.0, "workload.client": "turn-barrier"})
    s.update(over)
    return s


def test_a_slower_decode_link_delays_the_first_token_end_to_end():
    fast = simulate_tier("recompute", pd_small())
    slow = simulate_tier("recompute", pd_small(**{"topology.decode_gbps": 1.0}))
    for a, b in zip(fast["rows"], slow["rows"]):
        assert b["ttft_p50_ms"] > a["ttft_p50_ms"]
    assert fast["summary"]["pd_bytes"] == slow["summary"]["pd_bytes"] > 0


def test_pd_run_flows_prefill_to_decode_and_hymcache_hits():
    # a GPU KV cache of ~33 blocks per prefill worker: too small to keep its 8 conversations (the tier serves them)
    s = pd_small(**{"tiers.dram": 1 * GiB, "workload.conversations": 32, "gpu.gpu_memory_utilization": 0.79})
    out = {t: simulate_tier(t, s) for t in ("recompute", "hymcache", "mooncake-dram", "lmcache-local")}
    for name, r in out.items():
        sm = r["summary"]
        assert sm["decode_steps"] >= s["workload.max_tokens"]  # every request decoded its tokens
        assert sm["decode_kv_peak_blocks"] <= sm["decode_kv_blocks"]
        assert [row["requests"] for row in r["rows"]] == [32, 32, 32]
        assert all(row["e2e_ms"] > row["ttft_mean_ms"] > 0 for row in r["rows"])  # decode runs past the 1st token
    assert out["hymcache"]["rows"][2]["hit_rate"] > 0.9  # (a 256 MiB write buffer refuses a few turn-2 writes)
    assert out["mooncake-dram"]["rows"][2]["hit_rate"] == pytest.approx(1.0)
    assert out["recompute"]["rows"][2]["recomputed_tokens"] > 0
    assert out["hymcache"]["summary"]["makespan_s"] < out["recompute"]["summary"]["makespan_s"]


def test_the_prefill_worker_holds_a_requests_blocks_until_the_decode_worker_has_pulled_them():
    # a P->D link so slow that the pulls, not the prefill, decide when a prefill worker can admit the next request
    base = pd_small(**{"workload.conversations": 8, "workload.turns": 1})
    fast = simulate_tier("recompute", base)
    slow = simulate_tier("recompute", {**base, "topology.pd_port_gbps": 0.5, "gpu.gpu_memory_utilization": 0.835})
    assert slow["summary"]["makespan_s"] > 3 * fast["summary"]["makespan_s"]


# ---------------------------------------------------------------------------- AIPerf-style workload
def test_aiperf_histories_thread_the_answers_and_route_by_conversation():
    turns = aiperf_conversations(6, 3, input_tokens=100, output_tokens=20, prefill_workers=4)
    for c in range(6):
        assert [turns[t][c].input_tokens for t in range(3)] == [100, 220, 340]
        assert {turns[t][c].worker for t in range(3)} == {c % 4}
    assert reusable_footprint_bytes(turns, 2) == 6 * 220 * 2
    noisy = aiperf_conversations(50, 2, input_tokens=100, input_tokens_stddev=30, output_tokens=0, seed=3)
    deltas = [t.input_tokens for t in noisy[0]]
    assert len(set(deltas)) > 5 and 80 < sum(deltas) / len(deltas) < 120


def test_a_shared_prefix_is_one_set_of_keys_across_conversations():
    turns = aiperf_conversations(2, 1, input_tokens=600, output_tokens=1, prefix_ratio=0.5)
    env = Env()
    a, b = (Request(t, B_TOKENS, 1, env.event()) for t in turns[0])
    assert a.shared_blocks == b.shared_blocks == 300 // B_TOKENS == 2
    assert a.gpu_key(1) == b.gpu_key(1) and a.gpu_key(2) != b.gpu_key(2)
    assert b.reusable_blocks == 2  # turn 1 can reuse the shared prefix another conversation computed
    tier = LMCacheLocal(env, Host(env, 25.0, 0.0, GiB), BLOCK, B_TOKENS, 64 * MiB, 256)
    tier.reserve_store(a)
    run_proc(env, tier.store(a))
    assert tier.lookup(b) == 2  # conversation b finds conversation a's prefix chunk


# ---------------------------------------------------------------------------- presets and the sweep
def test_fig10_to_fig14_presets_are_complete_and_every_number_is_sourced():
    import re

    tags = re.compile(r"#\s*\[(paper|LMSYS|vLLM|LMCache|runtime|assumption|AIPerf|Mooncake|Redis)\]")
    for fig in (10, 11, 12, 13, 14):
        s = load_settings(preset_path(fig))
        assert {f.key for f in FIELDS} <= set(s)
        for line in preset_path(fig).read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#") and not line.startswith(("number", "title")):
                assert tags.search(line), f"fig{fig}: no source on: {line}"
    s10, s12 = load_settings(preset_path(10)), load_settings(preset_path(12))
    assert s10["topology.prefill_workers"] == 4 and s10["model.name"] == "qwen2.5-32b"
    assert s12["sweep.staging"] == [10 ** 10, 2 * 10 ** 10, 3 * 10 ** 10, 4 * 10 ** 10]
    # the calibrated size gives ~1.5 TB of reusable KV
    from host_runtime.hymcache.sim.run import make_turns
    from host_runtime.replay.models import get_model
    fp = reusable_footprint_bytes(make_turns(s10), get_model("qwen2.5-32b").bytes_per_token)
    assert 1.49e12 < fp < 1.51e12
    # everything but the sweep and the tiers is Fig. 10's
    differ = {k for k in s10 if s10[k] != s12[k]}
    assert differ == {"figure.number", "figure.title", "tiers.run", "sweep.staging"}


def test_a_staging_sweep_runs_each_buffered_tier_once_per_size():
    s = pd_small(**{"tiers.run": ["recompute", "mooncake-dram", "hymcache"], "sweep.staging": [64 * MiB, 128 * MiB],
                    "workload.conversations": 8, "workload.turns": 2})
    assert [label for label, _, _ in runs(s)] == ["recompute", "mooncake-dram@64MiB", "mooncake-dram@128MiB",
                                                  "hymcache@64MiB", "hymcache@128MiB"]
    out = simulate(s)
    assert [r["tier"] for r in out["rows"] if r["turn"] == 1] == [lab for lab, _, _ in runs(s)]
    assert {r["staging_bytes"] for r in out["rows"] if r["base_tier"] == "hymcache"} == {64 * MiB, 128 * MiB}
    assert "hymcache@64MiB_vs_recompute" in out["speedups"]
