"""The simulation's hymcache tier against the live runtime: one short request sequence, the same Master decisions.

The live side is real processes (``HyMCacheSet(1, 1, profile="small")``: a Master, a ``chm serve`` device and a
KV Manager), driven the way the KV connector drives them: the Manager's ``hint`` (its lookups at the Master),
``acquire`` / a libchm read / ``release`` per hit, ``finish``; ``put_start`` at the Master for the blocks not
loaded, a libchm write per placed block (EAGAIN: refused, ``put_revoke``), ``put_end``. The simulated side is
``HyMCacheTier`` (the same Master and KV Manager classes in process, over the emulator's Controller in virtual
time) on the same device settings, driven through the tier interface as the simulated worker drives it.

What must be identical: every hint's hits, every placed block's (node, device, offset, length), every refused
(skipped) store, what is stored at the end, and the Master's counters (evictions, revocations, registrations,
lookup hits).

The device is set up so that its decisions do not depend on timing: a 128 MiB write buffer whose flush batch is
the whole buffer and whose partial-batch delay is 1e15 ns, so with 24 MiB blocks it takes five and then refuses
every write, in both worlds; 2 x 72 MiB of SSD, so the Master's device holds six blocks and its watermark
eviction runs. Leases (10 s) never end within the sequence in either world (the live run takes a few seconds).
"""

import os
import struct

import xxhash

from driver.errors import ChmError
from host_runtime.hymcache.sim.events import Env
from host_runtime.hymcache.sim.run import device_config
from host_runtime.hymcache.sim.tiers import HyMCacheTier, Host
from host_runtime.hymcache.sim.worker import Request
from host_runtime.hymcache.sim.workload import Turn

MiB = 1 << 20
BLOCK = 24 * MiB
TPB = 128
OVERRIDES = {"policy.write_buffer_fraction": 0.5, "policy.flush_batch_bytes": 128 * MiB,
             "policy.flush_max_delay_ns": 1e15, "ssd.capacity_bytes": 72 * MiB}
# (conversation, turn, full blocks, previous turn's full blocks)
SEQUENCE = [(0, 1, 3, 0), (1, 1, 3, 0), (0, 2, 4, 3), (1, 2, 4, 3), (2, 1, 2, 0), (1, 3, 5, 4), (0, 3, 5, 4)]
MASTER_COUNTERS = ("evictions", "revoked_blocks", "registered_blocks", "lookup_hits", "lookup_keys", "put_blocks",
                   "put_no_space", "blocks")


def key(conv: int, i: int) -> bytes:
    return struct.pack("<QQ", conv + 1, i)  # HyMCacheTier.keys' layout


def all_keys():
    return [key(c, i) for c in range(3) for i in range(6)]


def simulated() -> dict:
    env = Env()
    cfg = device_config("small", 256 * MiB, "hymcache", 200.0).with_overrides(OVERRIDES)
    tier = HyMCacheTier(env, Host(env, 25.0, 10_000.0, 1 << 30), BLOCK, cfg, window_bytes=128 * MiB, timeout_s=10.0)
    log = {"hints": [], "placed": [], "refused": []}
    master = tier.master
    put_start, put_revoke = master.put_start, master.put_revoke

    def rec_put_start(rid, keys, sizes):
        locs = put_start(rid, keys, sizes)
        log["placed"].append([(l.key, l.node, l.device, l.offset, l.length) for l in locs if l is not None])
        return locs

    def rec_put_revoke(keys):
        log["refused"].append(sorted(keys))
        return put_revoke(keys)

    master.put_start, master.put_revoke = rec_put_start, rec_put_revoke

    def drive():
        for conv, turn, blocks, prev in SEQUENCE:
            req = Request(Turn(conv, turn, blocks * TPB + 1, prev * TPB + 1 if prev else 0), TPB, 1, env.event())
            n = tier.lookup(req)
            log["hints"].append(n)
            if n:
                loaded = yield from tier.load(req, n)
                assert loaded == n
            else:
                tier.finish(req)
            before = len(log["placed"])
            tier.reserve_store(req)
            yield from tier.store(req)
            if len(log["placed"]) > before and not log["placed"][-1]:
                log["placed"].pop()  # all stored already: the connector would not have called put_start
            yield env.now + 1e6  # 1 ms between requests

    p = env.process(drive())
    env.run()
    assert p.done.fired
    assert env.now < 5e9  # leases (10 s) never end within the sequence
    stats = master.stats()
    stored = [k for k in all_keys() if master.lookup([k])]
    return {**log, "master": {k: stats[k] for k in MASTER_COUNTERS}, "stored": stored}


def live(tmp_path) -> dict:
    from host_runtime.hymcache.cli import HyMCacheSet
    from host_runtime.hymcache.manager import ManagerClient
    from host_runtime.hymcache.master import MasterClient
    from libchm import Device

    log = {"hints": [], "placed": [], "refused": []}
    overrides = [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in OVERRIDES.items()]
    with HyMCacheSet(1, 1, profile="small", media_root=str(tmp_path), device_overrides=overrides,
                     tag=f"hymcache-simdiff-{os.getpid()}", verbose=False) as hset:
        desc = hset.describe()
        mc = MasterClient(desc["master"], timeout_s=10)
        man = ManagerClient(desc["managers"][0]["endpoint"], timeout_s=10)
        dev = Device(desc["devices"][0]["path"], staging_bytes=32 * MiB)  # a block is one command, as the sim's
        buf = bytearray(BLOCK)
        try:
            for conv, turn, blocks, prev in SEQUENCE:
                rid = f"c{conv}-t{turn}"
                lookup = [key(conv, i) for i in range(blocks)]  # (input - 1) // block: every full block
                n = man.hint(rid, lookup)
                log["hints"].append(n)
                for k in lookup[:n]:
                    token = man.acquire(rid, k, 10.0)
                    dev.read_into(token.offset, memoryview(buf)[:token.length])
                    man.release(rid, k)
                man.finish(rid)
                keys = [key(conv, i) for i in range(n, blocks)]  # the connector: the blocks it did not load
                if not keys:
                    continue
                try:
                    locs = mc.put_start(rid, keys, [BLOCK] * len(keys))
                except ChmError as exc:  # nothing evictable (leased): skipped, offered again next turn
                    assert exc.errno == 28, exc  # ENOSPC
                    continue
                placed = [l for l in locs if l is not None]
                log["placed"].append([(l.key, l.node, l.device, l.offset, l.length) for l in placed])
                written, refused = [], []
                for loc in placed:
                    data = loc.key * (BLOCK // len(loc.key))
                    try:
                        dev.write(loc.offset, data)
                    except ChmError as exc:
                        assert exc.errno == 11, exc  # EAGAIN: the write buffer is full
                        refused.append(loc.key)
                        continue
                    written.append(loc.key)
                if refused:
                    log["refused"].append(sorted(refused))
                    mc.put_revoke(refused)
                if written:
                    assert mc.put_end(written, [xxhash.xxh3_64_intdigest(loc.key * (BLOCK // 16)) for loc in
                                                placed if loc.key in written]) == len(written)
            stats = mc.stats()
            stored = [k for k in all_keys() if mc.lookup([k])]
        finally:
            dev.close()
            man.close()
            mc.close()
    return {**log, "master": {k: stats[k] for k in MASTER_COUNTERS}, "stored": stored}


def test_the_simulated_tier_makes_the_live_masters_decisions(tmp_path):
    sim = simulated()
    # the sequence exercises what is compared: hits, a chain broken by an eviction, refused writes, evictions
    assert sum(sim["hints"]) > 0 and 0 in sim["hints"][1:]
    assert sim["master"]["evictions"] > 0 and sim["refused"] and sim["master"]["revoked_blocks"] > 0
    assert sim["master"]["put_no_space"] > 0
    got = live(tmp_path)
    assert got["hints"] == sim["hints"]
    assert got["placed"] == sim["placed"]  # (key, node, device, offset, length) of every placed block
    assert got["refused"] == sim["refused"]
    assert got["stored"] == sim["stored"]
    assert got["master"] == sim["master"]
