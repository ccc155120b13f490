"""The replay's native index (host_runtime/hymcache/native_master.py, native/mt_*.c) makes the Python
Master's decisions.

Twins: a Python ``Master`` and a ``NativeMaster``, each on its own ManualClock, one node of one device, get
the same calls at the same clock times -- seeded random sequences of lookups (stored, unstored, in-flight
and repeated keys), put_starts (overflowing the watermarks, ENOSPC with leases holding a tiny device,
repeated keys, mixed sizes so that freed extents fragment and are reused), put_ends and put_revokes (with
and without versions, right and wrong), removes, expiry and stats, and clock steps across lease ends, lease
caps, put timeouts and the time base's move at 2^31 ms -- and must answer the same (locations, counts,
errors with their errno and text) and hold the same state after every call: every row by row number, the
put_start order, the write head, the freed extents in their order, evict_retry, the counters, the time base.
Then whole replays (the Mooncake trace's first requests; a libCacheSim trace whose keys pass 64 bits) run
with each and must give the same report and make the same calls. Planted wrong decisions (MT_MUTATION_*)
must be caught.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from driver.errors import ChmError
from emulator.shared_data import mooncake_conversation_trace
from host_runtime.hymcache.clock import ManualClock
from host_runtime.hymcache.master import MAX_BATCH, Master
from host_runtime.hymcache.messages import DeviceInfo
from host_runtime.hymcache.native_master import NativeMaster, load_module, master_state
from host_runtime.replay import LibCacheSimTrace, MooncakeTrace, Replay, get_model, replay_config
from host_runtime.replay import driver as replay_driver
from host_runtime.replay.lcs_trace import write_oracle_general

KiB = 1024
MEMORY_STATS = ("bytes_per_entry", "metadata_bytes")  # Python's objects against the C table's bytes


def key_of(i: int) -> bytes:
    """Replay's master_key; every other key past 64 bits (libCacheSim's obj_id << 24 | block reaches 2^88)."""
    return (i if i % 2 else i << 70 | i).to_bytes(16, "little")


class Twins:
    def __init__(self, capacity: int | None, start: float = 0.0, mutation: str | None = None, **options):
        self.py_clock, self.nat_clock = ManualClock(start), ManualClock(start)
        self.py = Master(self.py_clock, **options)
        self.nat = NativeMaster(self.nat_clock, mutation=mutation, **options)
        if capacity is not None:
            for m in (self.py, self.nat):
                m.register_node(0, "twin", [DeviceInfo(0, "twin", capacity, 0)])

    def both(self, op: tuple) -> tuple:
        out = [apply(m, clock, op) for m, clock in ((self.py, self.py_clock), (self.nat, self.nat_clock))]
        assert out[1] == out[0], op
        return out[0]

    def same_state(self) -> None:
        assert self.nat.state() == master_state(self.py)


def apply(m, clock: ManualClock, op: tuple):
    """One call; what it returned, or the error it raised (type, errno, text)."""
    kind, args = op[0], op[1:]
    try:
        if kind == "advance":
            clock.advance(args[0])
            return None
        if kind == "set_clock":
            clock.t = args[0]
            return None
        if kind == "stats":
            stats = m.stats()
            return {k: v for k, v in stats.items() if k not in MEMORY_STATS}
        return getattr(m, kind)(*args)
    except Exception as exc:  # noqa: BLE001 -- both must raise the same
        return ("raised", type(exc).__name__, getattr(exc, "errno", None), str(exc))


# ---- random call sequences -----------------------------------------------------------------------------

CONFIGS = {
    # mixed sizes: fragmentation and first-fit reuse of freed extents, evictions from the watermark band
    "mixed": dict(capacity=64 * KiB, sizes=(1, 100, 4 * KiB, 4 * KiB + 1, 8 * KiB, 12_000),
                  steps=(0, 0, 0.0004, 0.001, 0.25, 0.9, 1.0, 2.0, 2.6),
                  options=dict(lease_s=1.0, lease_max_s=2.5, put_timeout_s=2.0)),
    # a tiny device, no watermark round, long leases: put_starts fail whole (ENOSPC) while leases hold blocks
    "tiny_leased": dict(capacity=16 * KiB, sizes=(1 * KiB, 4 * KiB, 4 * KiB, 6 * KiB),
                        steps=(0, 0, 0.5, 5.0, 11.0),
                        options=dict(lease_s=10.0, lease_max_s=30.0, put_timeout_s=30.0, high_watermark=1.0,
                                     low_watermark=1.0)),
    # a deep watermark band with short leases and timeouts: big eviction rounds, evict_retry, drains
    "deep_band": dict(capacity=80 * KiB, sizes=(4 * KiB,), steps=(0, 0.0005, 0.1, 0.3, 0.6, 1.2),
                      options=dict(lease_s=0.5, lease_max_s=1.0, put_timeout_s=1.0, high_watermark=0.5,
                                   low_watermark=0.2)),
    # replay's shape: one slot size, the Master's default options, small steps of virtual time
    "replay_like": dict(capacity=32 * 64 * KiB, sizes=(64 * KiB,), steps=(0, 0.001, 0.01, 0.2, 3.0, 31.0),
                        options=dict()),
    # leases renewed by lookups again and again, up to their cap, on a device with room
    "renewals": dict(capacity=256 * KiB, sizes=(4 * KiB,), steps=(0, 0.3, 0.7, 0.9),
                     options=dict(lease_s=1.0, lease_max_s=1.5, put_timeout_s=5.0)),
    # the time base moves (2^31 ms) with leases, drains and puts in flight; a fractional start
    "rebase": dict(capacity=32 * KiB, sizes=(2 * KiB, 3 * KiB), start=12_345.678,
                   steps=(0, 0.3, 1.1, 2_147_483.6485, 2_147_483.649, 5.0e9),
                   options=dict(lease_s=1.0, lease_max_s=3.0, put_timeout_s=2.0, high_watermark=0.75,
                                low_watermark=0.5)),
}


def random_calls(twins: Twins, rng: random.Random, count: int, sizes, steps, keyspace: int = 40,
                 check_state: bool = True) -> dict:
    """``count`` calls chosen from what the Python Master answered so far, through both twins; what happened."""
    keys = [key_of(i) for i in range(keyspace)]
    started: dict[bytes, int] = {}  # key -> version of its last put_start (the Python twin's)
    seen = {"found": 0, "placed": 0, "enospc": 0, "draining": 0, "freed_extents": 0, "rebased": 0}
    base = twins.py._time_base
    requests = 0

    last_placed: list[bytes] = []

    def chain():
        a = rng.randrange(keyspace)
        if rng.random() < 0.6:  # mostly from a stored key (tried a few times)
            for _ in range(12):
                row = twins.py._index.get(keys[a])
                if row is not None and twins.py._table["state"][row] == 2:
                    break
                a = rng.randrange(keyspace)
        run = keys[a:a + rng.choice((1, 2, 3, 5, 8))]
        if rng.random() < 0.1:  # a key twice
            j = rng.randrange(len(run))
            run = run[:j + 1] + [rng.choice(run[:j + 1])] + run[j + 1:]
        if rng.random() < 0.1:
            run = rng.sample(keys, rng.randint(1, 6))
        return run

    for _ in range(count):
        r = rng.random()
        if r < 0.14:
            op = ("advance", rng.choice(steps))
        elif r < 0.40:
            op = ("lookup", chain())
        elif r < 0.64:
            run = chain()
            requests += 1
            op = ("put_start", f"r{requests}", run, [rng.choice(sizes) for _ in run])
        elif r < 0.82:
            if last_placed and rng.random() < 0.7:  # what the last put_start placed, as replay ends it
                chosen = [k for k in last_placed if rng.random() < 0.9]
            else:
                pool = list(started) + rng.sample(keys, 2)
                chosen = rng.sample(pool, min(len(pool), rng.randint(1, 6)))
            versions = None
            if rng.random() < 0.3:
                versions = [started.get(k, 1) + (rng.random() < 0.2) for k in chosen]
            op = ("put_end", chosen, [rng.getrandbits(64) for _ in chosen], versions)
        elif r < 0.90:
            pool = list(started) or keys
            chosen = rng.sample(pool, min(len(pool), rng.randint(1, 3)))
            op = ("put_revoke", chosen, [started.get(k, 1) for k in chosen] if rng.random() < 0.3 else None)
        elif r < 0.93:
            op = ("remove", rng.sample(keys, rng.randint(1, 3)))
        elif r < 0.96:
            op = (rng.choice(("expire", "tick")),)
        else:
            op = ("stats",)
        out = twins.both(op)
        if op[0] == "put_start" and isinstance(out, list):
            last_placed = [loc.key for loc in out if loc is not None]
            for loc in out:
                if loc is not None:
                    started[loc.key] = loc.version
                    seen["placed"] += 1
        elif op[0] == "put_start" and out[2] == 28:
            seen["enospc"] += 1
        elif op[0] == "lookup" and isinstance(out, list):
            seen["found"] += len(out)
        if check_state:
            twins.same_state()
        seen["draining"] = max(seen["draining"], len(twins.py._draining))
        dev = next(iter(twins.py._all_devices()), None)
        seen["freed_extents"] = max(seen["freed_extents"], len(dev.freed) if dev else 0)
        seen["rebased"] += twins.py._time_base != base
        base = twins.py._time_base
    twins.same_state()
    assert twins.both(("stats",))
    return {**seen, **twins.py.counters}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_calls_get_the_same_answers_and_leave_the_same_state(config, seed):
    c = CONFIGS[config]
    twins = Twins(c["capacity"], c.get("start", 0.0), **c["options"])
    seen = random_calls(twins, random.Random(seed * 1000 + len(config)), 500, c["sizes"], c["steps"])
    # what the sequence went through (so equality means something)
    assert seen["found"] > (2 if config == "deep_band" else 10)
    assert seen["placed"] and seen["registered_blocks"] and seen["revoked_blocks"]
    assert seen["evictions"] or config in ("rebase", "renewals")
    if config == "tiny_leased":
        assert seen["enospc"] and seen["put_no_space"]
    if config in ("mixed", "deep_band"):
        assert seen["freed_extents"] >= 2 and seen["draining"]
    if config == "rebase":
        assert seen["rebased"] >= 2 and seen["draining"]


def test_a_large_table_grows_alike():
    """Thousands of blocks of mixed sizes: the index, the row table, the extent maps and the heaps grow
    (compared every 500 calls and at the end)."""
    twins = Twins(850 * 4 * KiB, lease_s=0.5, lease_max_s=1.0, put_timeout_s=1.0)
    rng = random.Random(9)
    most: dict[str, int] = {}
    for _ in range(16):
        seen = random_calls(twins, rng, 500, (1 * KiB, 2 * KiB, 4 * KiB), (0, 0.001, 0.01, 0.2, 1.1),
                            keyspace=6000, check_state=False)
        most = {k: max(v, most.get(k, 0)) for k, v in seen.items()}
    assert len(twins.py._index) > 1200 and twins.py._rows_used > 1200  # past 1024 rows and 2048 slots
    assert most["freed_extents"] > 70 and most["draining"] > 64 and most["evictions"] > 100, most


def test_every_feature_is_reached_across_the_sequences():
    """Across all configs and seeds: evictions, ENOSPC, timeouts, drains, removals and reused extents."""
    total: dict[str, int] = {}
    for config, c in CONFIGS.items():
        twins = Twins(c["capacity"], c.get("start", 0.0), **c["options"])
        for k, v in random_calls(twins, random.Random(7), 150, c["sizes"], c["steps"], check_state=False).items():
            total[k] = total.get(k, 0) + v
    for name in ("evictions", "put_no_space", "revoked_blocks", "removed_blocks", "draining", "rebased"):
        assert total[name] > 0, name


def test_before_registration_and_bad_calls_fail_alike():
    twins = Twins(None, lease_s=1.0)
    k = [key_of(1), key_of(2)]
    for op in [("lookup", k), ("put_start", "r", k, [10, 10]), ("put_start", "r", [], []), ("put_end", k, [1, 2]),
               ("put_revoke", k), ("stats",), ("expire",), ("lookup", [b"short"]), ("lookup", "nope"),
               ("put_start", "", k, [1, 1]), ("put_start", "r", k, [1]), ("put_start", "r", k, [0, 1]),
               ("put_start", "r", k, [1, 1 << 32]), ("put_end", k, [1]), ("put_end", k, [1, -1]),
               ("put_end", k, [1, 2], [1]), ("put_revoke", k, [1, 1 << 32]), ("put_start", "r", k, [True, 1]),
               ("put_start", "r", k, [1.0, 1]), ("put_end", k, [1, 1 << 64]), ("put_end", k, [False, 1]),
               ("lookup", [key_of(0)] * (MAX_BATCH + 1))]:
        twins.both(op)
    twins.same_state()
    for m in (twins.py, twins.nat):
        m.register_node(0, "twin", [DeviceInfo(0, "twin", 8 * KiB, 0)])
    for op in [("put_start", "big", [key_of(i) for i in range(3)], [4 * KiB] * 3),  # more than the device
               ("put_start", "fits", k, [np.int64(4 * KiB), 4 * KiB]), ("put_end", k, [np.uint64(5), 6]),
               ("lookup", k),
               ("put_start", "full", [key_of(9)], [1]),  # leased: no room (ENOSPC), nothing evictable
               ("advance", 11.0), ("put_start", "evicts", [key_of(9)], [1]), ("stats",)]:
        twins.both(op)
        twins.same_state()


def test_what_the_native_index_does_not_do_it_refuses():
    """One node of one device, in process, no journal, no lease tokens: anything else is refused (EINVAL)."""
    clock = ManualClock()
    with pytest.raises(ChmError, match="state dir"):
        NativeMaster(clock, "/tmp/state")
    m = NativeMaster(clock)
    dev = DeviceInfo(0, "d", 1 << 20, 0)
    with pytest.raises(ChmError, match="one device"):
        m.register_node(0, "n", [dev, DeviceInfo(1, "d", 1 << 20, 0)])
    m.register_node(3, "n", [dev])
    m.register_node(3, "elsewhere", [dev])  # the same node and device again: fine
    assert m.nodes() == {3: {"endpoint": "elsewhere", "devices": [dev]}}
    for node, info in ((4, dev), (3, DeviceInfo(0, "d", 2 << 20, 0)), (3, DeviceInfo(0, "d", 1 << 20, 1))):
        with pytest.raises(ChmError, match="holds node 3 device 0 only"):
            m.register_node(node, "n", [info])
    with pytest.raises(ChmError, match="lease tokens"):
        m.lookup([key_of(1)], request_id="req")
    (loc,) = m.put_start("r", [key_of(1)], [4096])
    assert (loc.node, loc.device, loc.offset) == (3, 0, 0)
    assert m.put_end([key_of(1)], [9]) == 1 and m.lookup_offsets([key_of(1), key_of(2)]) == [0]
    assert m.put_start_offsets("r2", [key_of(1), key_of(2)], [4096, 4096]) == [None, 4096]


def test_clock_errors_are_the_masters():
    twins = Twins(64 * KiB, 5.0)
    twins.both(("put_start", "r", [key_of(1)], [10]))
    for t in (float("nan"), float("inf"), -float("inf"), 1e306, 4.0):  # 1e306 s: in ms, past a float
        twins.both(("set_clock", t))
        for op in (("lookup", [key_of(1)]), ("put_end", [key_of(1)], [3]), ("expire",), ("stats",)):
            twins.both(op)
        twins.same_state()


def test_a_put_timed_out_holds_its_extent_one_more_timeout_and_drains_in_lease_order():
    """Pinned decisions, spelled out (the random runs reach them too)."""
    twins = Twins(8 * KiB, lease_s=1.0, lease_max_s=1.0, put_timeout_s=2.0, high_watermark=1.0, low_watermark=1.0)
    a, b, c = key_of(1), key_of(2), key_of(3)
    assert twins.both(("put_start", "r1", [a, b], [2 * KiB, 2 * KiB]))[1].offset == 2 * KiB
    twins.both(("advance", 2.0))  # both time out: revoked, their extents held until t = 4
    assert twins.both(("put_end", [a, b], [1, 2])) == 0
    assert twins.both(("put_start", "r2", [c], [4 * KiB]))[0].offset == 4 * KiB  # the head, not their extents
    assert twins.both(("put_start", "r3", [a], [2 * KiB]))[0] == "raised"
    twins.both(("advance", 2.0))
    assert twins.both(("put_start", "r4", [a], [3 * KiB]))[0].offset == 1 * KiB  # merged [0, 4K), from its end
    twins.same_state()


# ---- whole replays -------------------------------------------------------------------------------------

class Recorder:
    """A Master as the replay sees it, recording each call it makes, its clock time and its answer."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("lookup", "put_start", "put_end", "put_revoke", "expire", "tick", "stats"):
            return attr

        def call(*args):
            try:
                out = attr(*args)
            except Exception as exc:
                self.calls.append((name, self.inner.clock.t, args, ("raised", type(exc).__name__,
                                                                    getattr(exc, "errno", None), str(exc))))
                raise
            self.calls.append((name, self.inner.clock.t, args, {k: v for k, v in out.items() if k not in MEMORY_STATS}
                                                                if name == "stats" else out))
            return out

        return call


def replay_both(monkeypatch, make_workload, cfg, variant: str, **kwargs):
    results = []
    for cls in (Master, NativeMaster):
        made = []
        monkeypatch.setattr(replay_driver, "HOST_INDEX", lambda clock, _cls=cls, **kw: made.append(
            Recorder(_cls(clock, **kw))) or made[-1])
        replay = Replay(cfg, variant, make_workload(), progress=False, **kwargs)
        assert isinstance(replay.master.inner, cls)
        result = replay.run()
        result.pop("speed")
        results.append((result, replay.master.calls, replay.master.stats()))
    (py, py_calls, py_stats), (nat, nat_calls, nat_stats) = results
    assert len(nat_calls) == len(py_calls)
    for i, (n, p) in enumerate(zip(nat_calls, py_calls)):
        assert n == p, i
    assert nat == py
    assert {k: v for k, v in nat_stats.items() if k not in MEMORY_STATS} == \
        {k: v for k, v in py_stats.items() if k not in MEMORY_STATS}
    return py


SMALL = {"dram.size_bytes": 2 << 30, "policy.prefetch_window_bytes": 512 << 20}  # as test_native_ops's


def mooncake(limit: int):
    try:
        path = mooncake_conversation_trace()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    block = get_model("llama-3.1-8b").block_bytes(128)
    return lambda: MooncakeTrace(path, block, 128, limit=limit)


@pytest.mark.parametrize("sequential", [True, False])
def test_a_mooncake_replay_prefix_makes_the_same_calls_and_report(monkeypatch, sequential):
    """The trace's first 300 requests on a device of 96 blocks: the Master evicts, and (leases of 10 s in a
    trace this short hold what was read) refuses puts whole."""
    make = mooncake(300)
    block = get_model("llama-3.1-8b").block_bytes(128)
    cfg = replay_config("paper", "lru", {**SMALL, "ssd.capacity_bytes": 48 * block})
    result = replay_both(monkeypatch, make, cfg, "lru", sequential=sequential)
    m = result["master"]
    assert m["evictions"] and m["registered_blocks"] and m["no_space_puts"] and m["lookup_hits"]


def test_a_mooncake_replay_with_short_leases_and_timeouts(monkeypatch):
    make = mooncake(200)
    block = get_model("llama-3.1-8b").block_bytes(128)
    cfg = replay_config("paper", "hymcache", {**SMALL, "ssd.capacity_bytes": 64 * block})
    options = {"lease_s": 0.001, "lease_max_s": 0.002, "put_timeout_s": 0.08, "high_watermark": 0.6,
               "low_watermark": 0.3}
    result = replay_both(monkeypatch, make, cfg, "hymcache", master_options=options)
    m = result["master"]
    assert m["evictions"] and m["put_timeouts"] and m["registered_blocks"] and m["lookup_hits"], m


def test_a_libcachesim_trace_with_keys_past_64_bits(monkeypatch, tmp_path):
    """obj_id << 24 | block: object ids near 2^64 give keys of 88 bits, which the index keeps whole."""
    page = replay_config("paper", "lru").device.page_size_bytes
    rng = random.Random(5)
    objects = [(1 << 64) - 1 - i * 7919 if i % 2 else i for i in range(120)]
    requests = [(t // 4, objects[int(len(objects) * rng.random() ** 2)], rng.randint(1, 3 * page))
                for t in range(1500)]
    path = write_oracle_general(tmp_path / "t.oracleGeneral", requests)
    cfg = replay_config("paper", "lru", {"ssd.capacity_bytes": 32 * page, "dram.size_bytes": 16 * page,
                                         "policy.prefetch_window_bytes": page})
    result = replay_both(monkeypatch, lambda: LibCacheSimTrace(path, "oracleGeneral", page), cfg, "lru",
                         sequential=True, master_options={"lease_s": 0.5, "lease_max_s": 1.0})
    assert result["master"]["evictions"] and result["master"]["lookup_hits"]


# ---- planted wrong decisions ---------------------------------------------------------------------------

@pytest.mark.parametrize("mutation", ["EVICT_MRU", "LEASE_NO_CAP", "FREED_NEWEST"])
def test_a_planted_wrong_decision_is_caught(mutation):
    assert load_module(mutation).lib.mt_mutation() == getattr(load_module().lib, f"MT_MUTATION_{mutation}")
    caught = []
    for config, c in CONFIGS.items():
        twins = Twins(c["capacity"], c.get("start", 0.0), mutation=mutation, **c["options"])
        try:
            random_calls(twins, random.Random(11), 300, c["sizes"], c["steps"])
        except AssertionError:
            caught.append(config)
    assert caught, f"no sequence tells MT_MUTATION_{mutation} from the Master"


def test_the_build_in_use_plants_nothing():
    assert load_module().lib.mt_mutation() == load_module().lib.MT_MUTATION_NONE
