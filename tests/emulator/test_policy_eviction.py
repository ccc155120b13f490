"""The built-in eviction policies against libCacheSim, and what each does with pinned pages.

A frame table with N frames (fully associative) driven by a plain access sequence must hit and miss
exactly as libCacheSim's cache of the same algorithm with ``cache_size=N`` and every object of size 1,
and evict the same pages in the same order."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tests.conftest import require_oracle

from emulator.frame_table import FrameTable
from emulator.policies import policy_class

SIZES = (20, 64)  # S3-FIFO needs 10% of the frames to be at least 2
SEEDS = (1, 2)


def sequences(frames: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    n = 30 * frames
    return {
        "uniform": [rng.randrange(3 * frames) for _ in range(n)],
        "skewed": [min(int(rng.paretovariate(0.7)), 20 * frames) for _ in range(n)],
        "loop-and-hot-set": [i % (frames + frames // 3) if rng.random() < 0.6 else rng.randrange(frames // 4)
                             for i in range(n)],
    }


def table(name: str, frames: int, params=None) -> FrameTable:
    order = policy_class(name).eviction
    return FrameTable(frames, eviction=lambda capacity: order(capacity, params))


def run_table(t: FrameTable, seq: list[int]) -> tuple[list[bool], list[int]]:
    """Hit per access and the victims in order, the device's way: lookup, touch on a hit, insert on a miss."""
    hits, victims = [], []
    for page in seq:
        frame = t.lookup(page)
        hits.append(frame is not None)
        if frame is not None:
            t.touch(frame)
        else:
            victim = t.insert(page).victim_page
            if victim is not None:
                victims.append(victim)
    return hits, victims


def run_libcachesim(make, seq: list[int]) -> tuple[list[bool], list[int]]:
    """Hits from libCacheSim's own get(); victims from a second cache driven as get() drives it
    (find, evict while full, insert), each victim being the page that is no longer there."""
    import libcachesim as lcs

    def req(page):
        return lcs.Request(obj_id=page, obj_size=1)

    cache = make()
    hits = [cache.get(req(page)) for page in seq]
    cache, held, victims = make(), set(), []
    for page in seq:
        if cache.find(req(page), True) is not None:
            continue
        while cache.get_n_obj() >= cache.cache_size:
            cache.evict(req(page))  # S3FIFO's may only move pages from its small queue to its main queue
        gone = [p for p in held if cache.find(req(p), False) is None]
        assert len(gone) <= 1
        victims += gone
        held.difference_update(gone)
        cache.insert(req(page))
        held.add(page)
    return hits, victims


HASHPOWER = 12  # the binding's default hash table (2**24 buckets) takes 0.2 s to set up
CASES = {  # name: (our params, libCacheSim cache for N frames)
    "lru": (None, lambda lcs, n: lcs.LRU(cache_size=n, hashpower=HASHPOWER)),
    "fifo": (None, lambda lcs, n: lcs.FIFO(cache_size=n, hashpower=HASHPOWER)),
    "clock": (None, lambda lcs, n: lcs.Clock(cache_size=n, hashpower=HASHPOWER)),
    "clock-2bit": (SimpleNamespace(n_bit_counter=2),
                   lambda lcs, n: lcs.Clock(cache_size=n, hashpower=HASHPOWER, n_bit_counter=2)),
    "sieve": (None, lambda lcs, n: lcs.Sieve(cache_size=n, hashpower=HASHPOWER)),
    "s3fifo": (None, lambda lcs, n: lcs.S3FIFO(cache_size=n, hashpower=HASHPOWER)),
    "s3fifo-tuned": (SimpleNamespace(small_size_ratio=0.25, ghost_size_ratio=0.5, move_to_main_threshold=1),
                     lambda lcs, n: lcs.S3FIFO(cache_size=n, hashpower=HASHPOWER, small_size_ratio=0.25,
                                               ghost_size_ratio=0.5, move_to_main_threshold=1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("frames", SIZES)
def test_hits_and_victims_equal_libcachesim(case, frames):
    lcs = require_oracle("libcachesim")
    name = case.split("-")[0]
    params, make = CASES[case]
    for seed in SEEDS:
        for kind, seq in sequences(frames, seed).items():
            hits, victims = run_table(table(name, frames, params), seq)
            want_hits, want_victims = run_libcachesim(lambda: make(lcs, frames), seq)
            where = f"{case}, {frames} frames, {kind} sequence (seed {seed})"
            assert sum(hits) == sum(want_hits), f"{where}: {sum(hits)} hits, libCacheSim {sum(want_hits)}"
            assert hits == want_hits, f"{where}: first difference at access {_first_difference(hits, want_hits)}"
            assert victims == want_victims, f"{where}: victims differ from #{_first_difference(victims, want_victims)}"


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# Golden miss counts on one fixed sequence (from libCacheSim 0.3.5, as the test above checks): they hold
# without libcachesim installed, and pin the policies against an unnoticed change.
GOLDEN_FRAMES = 64
GOLDEN_MISSES = {"lru": 153, "fifo": 193, "clock": 147, "sieve": 151, "s3fifo": 147}


@pytest.mark.parametrize("name", sorted(GOLDEN_MISSES))
def test_golden_miss_counts(name):
    seq = sequences(GOLDEN_FRAMES, 7)["skewed"]
    hits, _ = run_table(table(name, GOLDEN_FRAMES), seq)
    assert len(hits) - sum(hits) == GOLDEN_MISSES[name]


# ---- the op table's contract -----------------------------------------------------------------------

NAMES = ("lru", "fifo", "clock", "sieve", "s3fifo")


@pytest.mark.parametrize("name", NAMES)
def test_to_evict_names_what_evict_takes_and_changes_nothing(name):
    """``FrameTable.victim`` (to_evict) predicts the next insert's victim, pins included, without a side effect."""
    rng = random.Random(3)
    t = table(name, 32)
    pinned_frames: list[int] = []
    for step in range(3000):
        page = rng.randrange(96)
        frame = t.lookup(page)
        if frame is not None:
            t.touch(frame)
        else:
            predicted = t.victim(page)
            predicted_page = None if predicted is None else t.page_of[predicted]
            ins = t.insert(page)
            assert ins.victim_page == predicted_page, f"{name}: step {step}"
        if rng.random() < 0.05 and len(pinned_frames) < 24:
            frame = rng.randrange(32)
            if t.page_of[frame] is not None:
                t.pin(frame)
                pinned_frames.append(frame)
        elif rng.random() < 0.05 and pinned_frames:
            t.unpin(pinned_frames.pop(rng.randrange(len(pinned_frames))))


@pytest.mark.parametrize("name", NAMES)
def test_pinned_pages_are_never_victims_and_all_pinned_refuses(name):
    rng = random.Random(4)
    t = table(name, 24)
    for step in range(4000):
        page = rng.randrange(80)
        frame = t.lookup(page)
        if frame is not None:
            t.touch(frame)
            if rng.random() < 0.3 and t.pins[frame] < 2:
                t.pin(frame)
            continue
        pinned_pages = {t.page_of[f] for f in range(24) if t.pins[f]}
        ins = t.insert(page)
        if ins is None:
            assert len(pinned_pages) == 24, f"{name}: refused with a way unpinned (step {step})"
            for f in range(24):
                while t.pins[f]:
                    t.unpin(f)
            continue
        assert ins.victim_page not in pinned_pages, f"{name}: evicted pinned page {ins.victim_page} (step {step})"
        if rng.random() < 0.2:
            f = rng.randrange(24)
            if t.pins[f]:
                t.unpin(f)


@pytest.mark.parametrize("name", NAMES)
def test_a_set_with_every_way_pinned_refuses_and_recovers(name):
    t = table(name, 20)
    for page in range(20):
        t.insert(page)
    for frame in range(20):
        t.pin(frame)
    assert t.insert(100) is None and t.victim(100) is None and len(t) == 20
    t.unpin(t.lookup(7))
    assert t.victim(100) == t.lookup(7) and t.insert(100).victim_page == 7  # the one unpinned way


@pytest.mark.parametrize("name", NAMES)
def test_invalidate_removes_without_a_trace(name):
    """A page dropped by invalidate is simply gone: no victim is reported for it, and it comes back as new."""
    t = table(name, 20)
    for page in range(20):
        t.insert(page)
    t.invalidate(t.lookup(5))
    assert t.insert(100).victim_page is None  # the freed way
    victims = [t.insert(200 + i).victim_page for i in range(19)]
    assert 5 not in victims and None not in victims


def test_lru_and_fifo_skip_pinned_pages_in_place():
    for name, touched_first in (("lru", 1), ("fifo", 0)):
        t = table(name, 4)
        for page in range(4):
            t.insert(page)
        t.touch(t.lookup(0))  # lru: 0 becomes most recent; fifo: no change
        t.pin(t.lookup(touched_first))
        first = t.insert(10).victim_page
        t.unpin(t.lookup(touched_first))
        # the pinned page kept its place: once unpinned, it is the very next victim
        assert t.insert(11).victim_page == touched_first, name
        assert first != touched_first


def test_clock_and_sieve_pass_pinned_pages_keeping_their_bit():
    for name in ("clock", "sieve"):
        t = table(name, 3)
        for page in range(3):
            t.insert(page)
        t.touch(t.lookup(0))  # page 0 referenced
        t.pin(t.lookup(1))
        t.touch(t.lookup(1))  # page 1 referenced and pinned
        assert t.insert(10).victim_page == 2, name  # the hand clears 0's bit, passes pinned 1, takes 2
        t.unpin(t.lookup(1))
        # 0 lost its bit on that pass; 1 kept its bit while pinned, so it gets its second chance only now
        assert [t.insert(11).victim_page, t.insert(12).victim_page] == [0, 10], name


def test_s3fifo_takes_from_the_main_queue_when_the_small_queue_is_all_pinned():
    frames = 20  # small queue: 2 frames
    t = table("s3fifo", frames)
    for page in range(frames):
        t.insert(page)  # the first 2 go to the small queue, the rest (small queue full) to the main queue
    for page in (0, 1):
        t.pin(t.lookup(page))
    ins = t.insert(100)
    assert ins.victim_page not in (0, 1) and ins.victim_page is not None


@pytest.mark.parametrize("ratio,frames,ok", [(0.1, 20, True), (0.1, 19, False), (0.5, 4, True), (0.9, 2, False)])
def test_s3fifo_refuses_a_small_queue_under_two_frames(ratio, frames, ok):
    params = SimpleNamespace(small_size_ratio=ratio, ghost_size_ratio=0.9, move_to_main_threshold=2)
    problem = policy_class("s3fifo").eviction.capacity_problem(frames, params)
    assert (problem is None) == ok, problem
    if not ok:
        assert "policy.s3fifo.small_size_ratio" in problem and str(frames) in problem


def test_a_victim_that_is_pinned_or_not_resident_is_refused():
    """A plug-in that breaks the contract stops the device instead of evicting a page in use."""
    from emulator.policies.fifo import FifoOrder

    class Careless(FifoOrder):
        def evict(self, pinned, incoming=None):
            return self.order.popitem(last=False)[0]  # the oldest, pinned or not

    t = FrameTable(2, eviction=Careless)
    t.insert(1)
    t.insert(2)
    t.pin(t.lookup(1))
    with pytest.raises(RuntimeError, match="Careless chose page 1, which is pinned"):
        t.insert(3)

    class Inventive(FifoOrder):
        def evict(self, pinned, incoming=None):
            return 99

    t = FrameTable(1, eviction=Inventive)
    t.insert(1)
    with pytest.raises(RuntimeError, match="Inventive chose page 99, which is not resident"):
        t.insert(2)
