"""``libcachesim:ALGORITHM``: the binding's cache object as the DRAM eviction policy."""

from __future__ import annotations

import os
import random

import pytest

from tests.conftest import require_oracle

from emulator import ConfigError, Device, load_profile
from emulator.frame_table import FrameTable
from emulator.policies import policy_class
from emulator.policies.libcachesim import trial_problem

from .conftest import KiB, TINY
from .test_policy_eviction import run_table

lcs = require_oracle("libcachesim")  # the oracle: missing, these tests fail with the install hint

ROOMY = {**TINY, "dram.size_bytes": 32 * 4 * KiB}  # 32 frames


def table(algorithm: str, frames: int) -> FrameTable:
    return FrameTable(frames, eviction=policy_class(f"libcachesim:{algorithm}").eviction)


# Algorithms whose get() is find + evict-while-full + insert, and that drop pages only when told to evict:
# driven by the device, they hit and miss exactly as their own get() does.
EXACT = ("ARC", "Clock", "FIFO", "LFU", "LRU", "MQ", "S3FIFO", "Sieve", "TwoQ")


@pytest.mark.parametrize("algorithm", EXACT)
def test_the_device_hits_as_libcachesim_get_does(algorithm):
    frames = 50
    rng = random.Random(5)
    seq = [min(int(rng.paretovariate(0.8)), 5 * frames) if rng.random() < 0.7 else rng.randrange(5 * frames)
           for _ in range(3000)]
    cache = getattr(lcs, algorithm)(cache_size=frames, hashpower=12)
    want = [cache.get(lcs.Request(obj_id=p, obj_size=1)) for p in seq]
    t = table(algorithm, frames)
    got = run_table(t, seq)[0]
    assert sum(got) == sum(want) and got == want
    assert t.counters() == {"pinned_reinserts": 0, "forced_victims": 0, "bypassed_pages": 0,
                            "victim_scans": t.counters()["victim_scans"]}


def test_a_pinned_victim_is_reinserted_as_most_recent_and_counted():
    t = table("LRU", 4)
    for page in range(4):
        t.insert(page)
    t.pin(t.lookup(0))  # LRU's victim
    assert t.insert(10).victim_page == 1
    assert t.counters()["pinned_reinserts"] == 1
    # 0 went back in as the most recent page: it is now the last of the old pages to go
    t.unpin(t.lookup(0))
    assert [t.insert(11 + i).victim_page for i in range(3)] == [2, 3, 0]


def test_pinned_reinserts_show_in_the_device_stats(media_dir):
    data = os.urandom(48 * 4 * KiB)  # 48 pages, 32 frames
    with Device.open("small", media_dir, policy="libcachesim:LRU", overrides=ROOMY) as dev:
        dev.write(0, data)
        dev.flush()
        handle = dev.prefetch(0, 8 * KiB)  # pages 0 and 1, staged again and pinned until released
        dev.wait(handle, timeout_ms=10)
        for off in range(8 * KiB, len(data), 8 * KiB):  # 46 more pages: LRU comes round to pages 0 and 1
            assert dev.read(off, 8 * KiB) == data[off:off + 8 * KiB]
        assert dev.read(0, 8 * KiB) == data[:8 * KiB]
        dev.release(handle)
        assert dev.stats()["policy_counters"]["pinned_reinserts"] > 0
    assert "pinned victim is reinserted" in policy_class("libcachesim:LRU").describe(load_profile("small"))


def test_arc_keeps_the_bytes(media_dir):
    data = os.urandom(160 * KiB)
    with Device.open("small", media_dir, policy="libcachesim:ARC", overrides=ROOMY) as dev:
        dev.write(0, data)
        for _ in range(2):
            for off in range(0, len(data), 16 * KiB):
                assert dev.read(off, 16 * KiB) == data[off:off + 16 * KiB]
        assert dev.stats()["evictions"] > 0


def test_wtinylfu_runs_the_device(media_dir):
    """WTinyLFU moves pages between its segments on a hit and may push one out: that page stays in its
    frame, unknown to it, and goes first (bypassed_pages)."""
    # 256 frames (its window LRU is 1% of them), 2048 pages of capacity
    cfg = load_profile("small").with_overrides({**ROOMY, "dram.size_bytes": 256 * 4 * KiB,
                                                "ssd.capacity_bytes": 4 << 20,
                                                "policy.name": "libcachesim:WTinyLFU", "emulation.data": False})
    from emulator.controller import Controller

    ctl = Controller(cfg)
    rng = random.Random(2)
    now = 0.0
    for _ in range(4000):
        page = min(int(rng.paretovariate(0.8)), 1000) if rng.random() < 0.7 else rng.randrange(2000)
        now = ctl.read(page * 4 * KiB, 4 * KiB, now).finish
    snap = ctl.snapshot()
    assert snap["page_hits"] > 0 and snap["evictions"] > 0
    assert set(snap["policy_counters"]) == {"pinned_reinserts", "forced_victims", "bypassed_pages", "victim_scans"}
    assert snap["policy_counters"]["bypassed_pages"] > 0


def test_an_algorithm_that_crashes_its_process_is_refused():
    # libcachesim 0.3.5: S3FIFO aborts the process when 10% of the cache is less than one object
    problem = trial_problem("S3FIFO", 4)
    assert problem is not None and "crashed the process" in problem and "SIGABRT" in problem
    # ... and admits nothing when it is one object (an object as large as the small queue is refused)
    assert "admitted none of the pages" in trial_problem("S3FIFO", 16)
    assert trial_problem("S3FIFO", 64) is None


def test_a_profile_naming_a_failing_algorithm_says_why():
    with pytest.raises(ConfigError) as exc:
        load_profile("small").with_overrides({**TINY, "policy.name": "libcachesim:S3FIFO"})
    assert "policy.name = 'libcachesim:S3FIFO'" in str(exc.value) and "admitted none of the pages" in str(exc.value)
