"""``chm hymcache simulate``: the mooncake-nvmeof and lmcache-redis tiers (Fig. 11, 14), on small settings.

Each rule is checked where it lives and can fail: the file-system path's per-node ceiling and per-operation
cost, the load timeout that sends the rest of a prefix to recomputation, Redis refusing writes above maxmemory
(noeviction) and the chain that breaks there, and the two-level tier serving from its local LRU first.
"""

import pytest

from host_runtime.hymcache.sim.config import load_settings, preset_path
from host_runtime.hymcache.sim.events import Env
from host_runtime.hymcache.sim.run import make_turns
from host_runtime.hymcache.sim.tiers import (FsPath, Host, LMCacheLocal, LMCacheRedis, MooncakeNvmeofTier,
                                             MooncakePool, Nic, Redis)
from host_runtime.hymcache.sim.worker import Request
from host_runtime.hymcache.sim.workload import Turn, reusable_footprint_bytes
from host_runtime.replay.models import get_model

MiB, GiB = 1 << 20, 1 << 30
B_TOKENS = 128
BLOCK = 1 * MiB
CHUNK = 2 * BLOCK        # 256-token chunks of 128-token blocks
MS = 1e6


def request(env, conv, turn, blocks, prev_blocks=0):
    return Request(Turn(conv, turn, blocks * B_TOKENS + 1, prev_blocks * B_TOKENS + 1 if prev_blocks else 0, 0),
                   B_TOKENS, 1, env.event())


def run_proc(env, gen):
    p = env.process(gen)
    env.run()
    assert p.done.fired
    return p.done.value


def timed(env, gen):
    """Run ``gen`` to the end: (its value, the time it returned)."""
    out = []

    def wrap():
        v = yield from gen
        out.append((v, env.now))

    run_proc(env, wrap())
    return out[0]


# ---------------------------------------------------------------------------- mooncake-nvmeof
def nvmeof(env, nodes=2, *, fs_gb_per_s=1.0, op_us=0.0, timeout_s=10.0, capacity=1 * GiB):
    """``nodes`` prefill nodes, each with its own volume and file-system path; 100 Gbps ports, a 200 Gbps storage NIC."""
    hosts = [Host(env, 1000.0, 0.0, 64 * MiB, index=i, kv_nic=Nic(f"n{i}", 100.0, 0.0)) for i in range(nodes)]
    storage = Nic("storage", 200.0, 0.0)
    out = []
    for h in hosts:
        vol = MooncakePool(1, capacity // nodes, CHUNK, high_watermark=0.95, eviction_ratio=0.05, lease_s=5.0)
        out.append(MooncakeNvmeofTier(env, h, BLOCK, B_TOKENS, 256, vol, FsPath(f"xfs{h.index}", fs_gb_per_s, op_us * 1e3),
                                      storage, timeout_s=timeout_s, insert_timeout_s=30.0,
                                      peer=out[0] if out else None))
    return out


def stored(tier, conv, chunks):
    for c in range(chunks):
        assert tier.pool.put_start((conv, c), 0.0) == 0
        tier.pool.put_end((conv, c))


def test_nvmeof_reads_are_bounded_by_each_nodes_file_system_path_plus_its_per_operation_cost():
    # 1 GB/s file system, 100 us per file: a 2 MiB chunk occupies the path 2.097 + 0.1 ms; the 100 Gbps port
    # would move it in 0.17 ms. Four chunks on one node: 4 x 2.197 ms. Two nodes at once: private paths, no sharing
    env = Env()
    t0, t1 = nvmeof(env, fs_gb_per_s=1.0, op_us=100.0)
    stored(t0, 0, 4)
    stored(t1, 1, 4)
    r0, r1 = request(env, 0, 2, 9, prev_blocks=8), request(env, 1, 2, 9, prev_blocks=8)
    assert t0.lookup(r0) == 8 and t1.lookup(r1) == 8
    p0, p1 = env.process(t0.load(r0, 8)), env.process(t1.load(r1, 8))
    env.run()
    per_chunk = CHUNK / 1.0 + 100e3
    assert p0.done.value == 8 and p1.done.value == 8
    assert r0.read_bytes == 4 * CHUNK
    assert p0.done.value == 8 and env.now == pytest.approx(4 * per_chunk + CHUNK / 1000.0, rel=1e-6)
    assert t0.fs.ops == 4 and t1.fs.ops == 4
    # a second load on node 0 queues behind the first on its path: the ceiling is per node
    env2 = Env()
    (t,) = nvmeof(env2, nodes=1, fs_gb_per_s=1.0, op_us=100.0)
    stored(t, 0, 4)
    stored(t, 1, 4)
    a, b = request(env2, 0, 2, 9, prev_blocks=8), request(env2, 1, 2, 9, prev_blocks=8)
    t.lookup(a), t.lookup(b)
    env2.process(t.load(a, 8)), env2.process(t.load(b, 8))
    env2.run()
    assert env2.now == pytest.approx(8 * per_chunk + CHUNK / 1000.0, rel=1e-6)


def test_nvmeof_a_load_past_the_timeout_is_recomputed_from_that_chunk():
    # 0.1 GB/s: 20.97 ms a chunk; a 50 ms timeout lets chunks 0 and 1 in, chunk 2 would land at 62.9 ms
    env = Env()
    (t,) = nvmeof(env, nodes=1, fs_gb_per_s=0.1, timeout_s=0.050)
    stored(t, 0, 4)
    r = request(env, 0, 2, 9, prev_blocks=8)
    assert t.lookup(r) == 8
    loaded, at = timed(env, t.load(r, 8))
    assert loaded == 4  # the rest (4 blocks) is recomputed
    assert r.timeouts == 1 and t.counters["load_timeouts"] == 1
    assert at == pytest.approx(50 * MS)  # the worker waited for the timeout
    # with a timeout the reads meet, all of it is loaded
    env = Env()
    (t,) = nvmeof(env, nodes=1, fs_gb_per_s=0.1, timeout_s=0.100)
    stored(t, 0, 4)
    r = request(env, 0, 2, 9, prev_blocks=8)
    t.lookup(r)
    assert run_proc(env, t.load(r, 8)) == 8 and r.timeouts == 0


def test_nvmeof_volumes_are_private_to_their_node():
    env = Env()
    t0, t1 = nvmeof(env)
    stored(t0, 0, 2)
    assert t0.lookup(request(env, 0, 2, 5, prev_blocks=4)) == 4
    assert t1.lookup(request(env, 0, 2, 5, prev_blocks=4)) == 0


# ---------------------------------------------------------------------------- lmcache-redis, lmcache-local+redis
def redis_tier(env, *, capacity, policy="noeviction", local_bytes=None, gbps=8.0, timeout_s=10.0):
    host = Host(env, 1000.0, 0.0, 64 * MiB)
    redis = Redis(env, capacity, CHUNK, policy=policy, gbps=gbps, latency_ns=0.0)
    local = LMCacheLocal(env, host, BLOCK, B_TOKENS, local_bytes, 256) if local_bytes else None
    return LMCacheRedis(env, host, BLOCK, B_TOKENS, 256, redis, timeout_s=timeout_s, local=local,
                        name="lmcache-local+redis" if local else None), redis


def store(env, tier, req):
    tier.reserve_store(req)
    run_proc(env, tier.store(req))
    env.run()  # the SETs land


def test_redis_refuses_writes_above_maxmemory_and_the_chain_breaks_there():
    # maxmemory 1.5 chunks, noeviction: SET 0 (used 0) and SET 1 (used 1 chunk <= 1.5) run, SET 2 (used 2 > 1.5) is
    # refused with OOM; next turn the chain stops at chunk 2 and its store is refused again
    env = Env()
    tier, redis = redis_tier(env, capacity=3 * CHUNK // 2)
    r1 = request(env, 0, 1, 6)
    store(env, tier, r1)
    assert r1.skipped_inserts == 1 and redis.counters["set_oom"] == 1
    assert redis.readable() == {(0, 0), (0, 1)}
    r2 = request(env, 0, 2, 10, prev_blocks=6)
    assert tier.lookup(r2) == 4
    assert run_proc(env, tier.load(r2, 4)) == 4
    store(env, tier, r2)
    assert r2.skipped_inserts == 3 and tier.lookup(request(env, 0, 3, 12, prev_blocks=10)) == 4
    # room for everything: nothing refused, the whole prefix reusable
    env = Env()
    tier, redis = redis_tier(env, capacity=1 * GiB)
    r1 = request(env, 0, 1, 6)
    store(env, tier, r1)
    assert r1.skipped_inserts == 0 and tier.lookup(request(env, 0, 2, 10, prev_blocks=6)) == 6


def test_redis_allkeys_lru_evicts_instead_of_refusing():
    env = Env()
    tier, redis = redis_tier(env, capacity=3 * CHUNK // 2, policy="allkeys-lru")
    r1 = request(env, 0, 1, 6)
    store(env, tier, r1)
    assert r1.skipped_inserts == 0 and redis.counters["evictions"] == 1
    assert redis.readable() == {(0, 1), (0, 2)}
    assert tier.lookup(request(env, 0, 2, 10, prev_blocks=6)) == 0  # chunk 0 went first: nothing is reusable


def test_redis_value_is_readable_only_once_it_has_landed():
    env = Env()
    tier, redis = redis_tier(env, capacity=1 * GiB, gbps=8.0)  # 1 GB/s: a 2 MiB SET lands 2.1 ms after it is sent
    r1 = request(env, 0, 1, 2)
    tier.reserve_store(r1)
    p = env.process(tier.store(r1))
    env.run(until=1 * MS)
    assert p.done.fired and redis.pending((0, 0)) and (0, 0) not in redis
    assert tier.lookup(request(env, 0, 2, 3, prev_blocks=2)) == 0
    env.run()
    assert (0, 0) in redis and env.now == pytest.approx(CHUNK / 1000.0 + CHUNK / 1.0, rel=1e-6)


def test_two_level_tier_serves_from_local_first_then_redis_with_write_back():
    env = Env()
    tier, redis = redis_tier(env, capacity=1 * GiB, local_bytes=2 * CHUNK)  # local LRU: 2 chunks
    r1 = request(env, 0, 1, 4)
    store(env, tier, r1)  # written through: both chunks in local and Redis
    assert set(tier.local.lru) == {(0, 0), (0, 1)} and redis.readable() == {(0, 0), (0, 1)}
    gets = redis.counters["gets"]
    r2 = request(env, 0, 2, 5, prev_blocks=4)
    assert tier.lookup(r2) == 4
    t0 = env.now
    assert run_proc(env, tier.load(r2, 4)) == 4
    assert redis.counters["gets"] == gets and tier.counters["loaded_local"] == 2  # no GET: local first
    assert env.now - t0 == pytest.approx(4 * BLOCK / 1000.0, rel=1e-6)  # PCIe only
    # another conversation's chunks push conversation 0 out of the local LRU: now it comes from Redis
    store(env, tier, request(env, 1, 1, 4))
    assert (0, 0) not in tier.local.lru and (0, 0) in redis
    r3 = request(env, 0, 3, 5, prev_blocks=4)
    assert tier.lookup(r3) == 4
    t0 = env.now
    assert run_proc(env, tier.load(r3, 4)) == 4
    assert redis.counters["gets"] == gets + 2 and tier.counters["loaded_redis"] == 2
    assert env.now - t0 >= 2 * CHUNK / 1.0  # two GETs at 1 GB/s
    assert (0, 0) in tier.local.lru and (0, 1) in tier.local.lru  # written back into the hot cache


def test_fig14_footprint_fits_in_128_gb_and_fig11_is_fig10_with_nvmeof():
    s = load_settings(preset_path(14))
    fp = reusable_footprint_bytes(make_turns(s), get_model(s["model.name"]).bytes_per_token)
    assert 120e9 < fp < 128e9
    assert s["redis.capacity"] + s["tiers.dram"] >= fp and s["redis.capacity"] < fp
    s11, s10 = load_settings(preset_path(11)), load_settings(preset_path(10))
    assert s11["tiers.run"] == ["recompute", "mooncake-nvmeof", "hymcache"]
    same = {k for k in s10 if not k.startswith(("figure.", "tiers.run", "nvmeof.", "sweep."))}
    assert {k: s11[k] for k in same} == {k: s10[k] for k in same}
