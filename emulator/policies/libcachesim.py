"""``libcachesim:ALGORITHM``: an algorithm of the ``libcachesim`` binding chooses the DRAM victims.

``policy.name = "libcachesim:ARC"`` (or ``WTinyLFU``, ``LRU``, any cache class
the binding exposes; ``available()`` lists them) runs a transparent DRAM cache
whose eviction policy is the binding's cache object of that algorithm, sized
in frames (every page an object of size 1). The device drives it as
libCacheSim's own ``get`` does: ``find`` on every access (a miss too), then
``evict`` while full, then ``insert``.

Where the device must part from what the algorithm would do alone (each is
counted in the device's stats, ``policy_counters``):

* ``pinned_reinserts``: the algorithm's victim is pinned (a read is copying
  it, a prefetch holds it, a write-back is in flight). The page is back in
  the structure as a newly inserted (most recent) one, and the algorithm is
  asked again. This changes the algorithm's state (its ghost lists, its
  counters) compared with a run without pins.
* ``forced_victims``: the algorithm kept choosing pinned pages (as many times
  as it holds pages, e.g. LFU choosing a reinserted page again): the oldest
  unpinned page it holds is removed instead.
* ``bypassed_pages``: the algorithm did not admit a page, or let one go
  outside an eviction (SLRU and WTinyLFU move pages between their segments
  on a hit and may push one out). The page still fills its frame, unknown to
  the algorithm, and is the next victim.
* ``victim_scans``: the algorithm's ``to_evict`` did not name the page
  ``evict`` dropped (S3FIFO, WTinyLFU, TwoQ, ... do not implement it), or a
  page left outside an eviction, so the held pages were looked up, oldest
  first, to find which one left. Costly (a lookup per held page, at worst)
  but exact; an algorithm whose ``find`` still reports pages it dropped (its
  ghosts) cannot be followed this way and fails its trial.

Algorithms whose ``get`` is more than ``find`` + ``evict`` + ``insert`` (LIRS,
GDSF, LRUK in libcachesim 0.3.5) can miss differently than their own ``get``.

Some algorithms crash the process at some sizes or when driven by their op
table (S3FIFO aborts when its small queue has no room; ClockPro and Hyperbolic
segfault), so before its first use at a size an algorithm runs a trial in a
child process, and a profile naming one that fails it is refused with what
happened.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
from collections import OrderedDict
from itertools import filterfalse, islice
from pathlib import Path

from . import CachePolicy, EvictionPolicy, register_family

PREFIX = "libcachesim"
OFFLINE = "is an offline optimum: it needs each request's next access time, which a device does not know"
NOT_OFFERED = {
    "Belady": OFFLINE,
    "BeladySize": OFFLINE,
    "PluginCache": "is libCacheSim's way to write a policy in Python: write a chm.policies plug-in instead",
}
TRIAL_ACCESSES_PER_FRAME = 4
TRIAL_MAX_ACCESSES = 20_000
TRIAL_TIMEOUT_S = 120.0
TRIAL_SEED = 1
TRIAL_PINNED_SHARE = 0.25  # the trial keeps up to this share of the pages pinned, to exercise reinsertion
MIN_HASHPOWER = 10  # log2 of the hash table's buckets, at least (it grows with the frames)
EVENTS = ("pinned_reinserts", "forced_victims", "bypassed_pages", "victim_scans")


@functools.cache
def algorithms() -> tuple[str, ...]:
    """The binding's cache classes a device can run (ImportError if libcachesim is not installed)."""
    import libcachesim as lcs

    return tuple(sorted(name for name, obj in vars(lcs).items()
                        if isinstance(obj, type) and issubclass(obj, lcs.CacheBase) and obj is not lcs.CacheBase
                        and name not in NOT_OFFERED))


def why_not(algorithm: str) -> str | None:
    return NOT_OFFERED.get(algorithm)


class LibCacheSimOrder(EvictionPolicy):
    """A libCacheSim cache object as the eviction policy (see the module's documentation)."""

    algorithm = "LRU"  # set per algorithm by policy_for()

    def __init__(self, capacity, params=None):
        super().__init__(capacity)
        import libcachesim as lcs

        self._request = lcs.Request
        # a hash table sized to the frames: the binding's default (2**24 buckets) costs 0.2 s to set up
        hashpower = max(MIN_HASHPOWER, (2 * capacity).bit_length())
        self.cache = getattr(lcs, self.algorithm)(cache_size=capacity, hashpower=hashpower)
        self.held: OrderedDict[int, None] = OrderedDict()  # pages the algorithm holds, oldest arrival first
        self.bypassed: OrderedDict[int, None] = OrderedDict()  # resident pages it did not admit, oldest first
        self.looked_up: int | None = None  # the incoming page evict() already looked up as a miss
        self.events = dict.fromkeys(EVENTS, 0)

    def _req(self, page: int):
        return self._request(obj_id=page, obj_size=1)

    def counters(self):
        return dict(self.events)

    def find(self, page, update=True):
        if page in self.bypassed:
            return True
        if not update:
            return page in self.held
        hit = self.cache.find(self._req(page), True) is not None
        self._keep_dropped()
        return hit

    def _look_up_miss(self, page: int) -> None:
        """libCacheSim's get() looks every request up first; on a miss that updates ghosts, counters, ..."""
        if self.looked_up != page:
            self.cache.find(self._req(page), True)
            self.looked_up = page
            self._keep_dropped()

    def insert(self, page):
        self._look_up_miss(page)
        self.looked_up = None
        self._admit(page)

    def _admit(self, page: int) -> None:
        self.cache.insert(self._req(page))  # some algorithms return nothing from insert, admitted or not
        if self.cache.find(self._req(page), False) is not None:
            self.held[page] = None
        else:
            self.bypassed[page] = None
            self.events["bypassed_pages"] += 1
        self._keep_dropped()

    def _keep_dropped(self) -> None:
        """Pages the algorithm let go of outside an eviction (SLRU and WTinyLFU move pages between their
        segments on a hit or an insert and may push one out) stay in their frames, unknown to it, as
        bypassed pages: the next victims."""
        extra = len(self.held) - self.cache.get_n_obj()
        if extra:
            for page in self._dropped(extra):
                del self.held[page]
                self.bypassed[page] = None
                self.events["bypassed_pages"] += 1

    def _dropped(self, count: int) -> list[int]:
        """The ``count`` held pages the algorithm no longer has, oldest first."""
        if count < 0:
            raise RuntimeError(f"libCacheSim's {self.algorithm} counts {-count} more objects than the pages it "
                               f"was given and kept")
        self.events["victim_scans"] += 1
        find, req = self.cache.find, self._req
        dropped = list(islice((p for p in self.held if find(req(p), False) is None), count))
        if len(dropped) < count:
            raise RuntimeError(f"cannot tell which pages libCacheSim's {self.algorithm} let go of: its find() "
                               f"still reports pages it no longer counts (ghost entries)")
        return dropped

    def to_evict(self, pinned):
        # A best guess where the algorithm cannot say without evicting: what evict() would try first.
        victim = next(filterfalse(pinned, self.bypassed), None)
        if victim is not None:
            return victim
        hint = self.cache.to_evict(self._req(0))
        if hint is not None and hint.obj_id in self.held and not pinned(hint.obj_id):
            return hint.obj_id
        return next(filterfalse(pinned, self.held))

    def evict(self, pinned, incoming=None):
        if incoming is not None:
            self._look_up_miss(incoming)
        req = self._req(0 if incoming is None else incoming)
        for _ in range(len(self.held) + 1):
            victim = next(filterfalse(pinned, self.bypassed), None)
            if victim is not None:  # it holds a frame the algorithm does not count: it goes first
                del self.bypassed[victim]
                return victim
            victim = self._evict_one(req)
            if not pinned(victim):
                return victim
            self.events["pinned_reinserts"] += 1
            self._admit(victim)
        victim = next(filterfalse(pinned, self.held))
        self.cache.remove(victim)
        del self.held[victim]
        self.events["forced_victims"] += 1
        return victim

    def _evict_one(self, req) -> int:
        """Let the algorithm evict; returns the page it dropped (any other it dropped too is kept as bypassed)."""
        cache = self.cache
        hint = cache.to_evict(req)
        hint = None if hint is None else hint.obj_id
        cache.evict(req)
        gone = len(self.held) - cache.get_n_obj()
        if gone < 1:
            raise RuntimeError(f"libCacheSim's {self.algorithm} evicted no page when asked to")
        if gone == 1 and hint in self.held and cache.find(self._req(hint), False) is None:
            dropped = [hint]
        else:
            dropped = self._dropped(gone)
        victim = hint if hint in dropped else dropped[0]
        for page in dropped:
            del self.held[page]
            if page != victim:
                self.bypassed[page] = None
                self.events["bypassed_pages"] += 1
        return victim

    def remove(self, page):
        if page in self.bypassed:
            del self.bypassed[page]
        else:
            self.cache.remove(page)
            del self.held[page]


class LibCacheSimPolicy(CachePolicy):
    """A transparent DRAM cache whose victims a libCacheSim algorithm chooses."""

    @classmethod
    def describe(cls, cfg):
        return (f"{cls.name} (libCacheSim's {cls.eviction.algorithm} chooses the victims; a pinned victim is "
                f"reinserted as most recent and counted: stats policy_counters.pinned_reinserts)")

    @classmethod
    def check_config(cls, cfg, need):
        problem = trial_problem(cls.eviction.algorithm, cfg.read_staging_frames)
        need(problem is None, f"policy.name = {cls.name!r}: {problem}")


@functools.cache
def policy_for(algorithm: str) -> type[CachePolicy]:
    order = type(f"{algorithm}Order", (LibCacheSimOrder,), {"algorithm": algorithm})
    return type(f"{algorithm}Policy", (LibCacheSimPolicy,), {"name": f"{PREFIX}:{algorithm}", "eviction": order,
                                                             "__doc__": LibCacheSimPolicy.__doc__})


@functools.cache
def trial_problem(algorithm: str, capacity: int) -> str | None:
    """Drive ``algorithm`` with ``capacity`` frames through the op table in a child process (it may crash the
    process); None if it held up, else what went wrong."""
    accesses = min(TRIAL_MAX_ACCESSES, TRIAL_ACCESSES_PER_FRAME * capacity)
    code = f"from emulator.policies.libcachesim import trial; trial({algorithm!r}, {capacity}, {accesses})"
    root = str(Path(__file__).resolve().parents[2])  # the child imports this package from where we did
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    what = f"libCacheSim's {algorithm} failed a trial run of {accesses} accesses with {capacity} frames"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=TRIAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{what}: it did not finish within {TRIAL_TIMEOUT_S:g} s"
    if proc.returncode == 0:
        return None
    said = " / ".join(line.strip() for line in proc.stderr.splitlines()[-3:] if line.strip()) or "no message"
    if proc.returncode < 0:
        return f"{what}: it crashed the process ({signal.Signals(-proc.returncode).name}; {said})"
    return f"{what}: {said}"


def trial(algorithm: str, capacity: int, accesses: int) -> None:
    """The trial run itself (in the child); exits with a one-line message if the algorithm does not hold up."""
    try:
        _trial_run(algorithm, capacity, accesses)
    except Exception as exc:  # whatever went wrong, the parent shows it as the reason
        raise SystemExit(f"{type(exc).__name__}: {exc}") from None


def _trial_run(algorithm: str, capacity: int, accesses: int) -> None:
    """Random and skewed pages, some pinned, some removed; the algorithm's count must follow the pages."""
    rng = random.Random(TRIAL_SEED)
    order = policy_for(algorithm).eviction(capacity)
    resident: list[int] = []
    where: dict[int, int] = {}
    pinned: set[int] = set()
    for _ in range(accesses):
        page = rng.randrange(capacity) if rng.random() < 0.5 else rng.randrange(4 * capacity)
        if page in where:
            order.find(page)
        else:
            if len(resident) == capacity:
                victim = order.evict(pinned.__contains__, page)
                if victim not in where or victim in pinned:
                    raise SystemExit(f"evict() gave page {victim}, which is not resident or is pinned")
                _drop(resident, where, victim)
            order.insert(page)
            where[page] = len(resident)
            resident.append(page)
        roll = rng.random()
        if roll < 0.05 and len(pinned) < TRIAL_PINNED_SHARE * capacity:
            pinned.add(rng.choice(resident))
        elif roll < 0.10 and pinned:
            pinned.discard(rng.choice(tuple(pinned)))
        elif roll < 0.12 and len(resident) > 1:
            page = rng.choice(resident)
            if page not in pinned:
                order.remove(page)
                _drop(resident, where, page)
        if order.cache.get_n_obj() != len(order.held):
            raise SystemExit(f"its object count ({order.cache.get_n_obj()}) does not follow the pages it was given "
                             f"and kept ({len(order.held)})")
    if order.events["bypassed_pages"] and not order.held:
        raise SystemExit("it admitted none of the pages")


def _drop(resident: list[int], where: dict[int, int], page: int) -> None:
    i = where.pop(page)
    last = resident.pop()
    if last != page:
        resident[i] = last
        where[last] = i


register_family(PREFIX, algorithms, policy_for, why_not)
