"""The DRAM frame table: which device page lives in which DRAM frame, and the
op table of the eviction policy that chooses victims.

The frame table keeps the bookkeeping (page <-> frame, dirty bits, pin counts,
free ways); *what to evict* is asked of an ``EvictionPolicy`` (one per set),
the small table of operations libCacheSim's caches have (``find``, ``insert``,
``to_evict``, ``evict``, ``remove``). With the default policy, ``LruOrder``,
this class is the reference model that ``rtl_model/chm_frame_table`` is
checked against, so its decisions are fully specified:

* ``frames`` frames in ``sets = frames // ways`` sets of ``ways`` ways
  (``ways == frames``: fully associative). Page ``p`` maps to set
  ``p % sets``; frame index = ``set * ways + way``.
* ``insert`` takes the lowest-numbered free way of the set; if none is free,
  the victim the set's eviction policy chooses among the ways that are not
  pinned (LRU: the least recently used; its page and dirty bit are reported
  as the victim). If every way is pinned it returns None.
* ``lookup`` does not change the eviction order; ``touch`` counts a hit
  (LRU: makes the frame most recently used); ``insert`` tells the policy the
  page arrived (LRU: the new frame is the most recently used).
* ``victim`` (the RTL bench's ``lru_victim``) says which frame ``insert``
  would evict, changing nothing.
"""

from __future__ import annotations

import copy
import heapq
from collections import OrderedDict
from itertools import filterfalse
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

Pinned = Callable[[int], bool]  # is this resident page pinned (never a victim)?


class Inserted(NamedTuple):
    frame: int
    victim_page: int | None  # page evicted to make room, or None
    victim_dirty: bool


class EvictionPolicy:
    """What to evict: one set's replacement state, keyed by page (libCacheSim's op table).

    The frame table calls, for a set of ``capacity`` ways:

    * ``find(page, update=True) -> bool``: is ``page`` tracked here; ``update``: count a hit on it
      (the frame table calls ``hit(page)`` for that: ``find`` with ``update``, the answer unused);
    * ``insert(page)``: ``page`` became resident (the set has room for it);
    * ``evict(pinned, incoming) -> page``: choose a victim among the resident pages for which
      ``pinned(page)`` is false, drop it and return it, to make room for ``incoming`` (not
      resident). Called only when the set is full and at least one resident page is not pinned;
    * ``to_evict(pinned) -> page``: the page ``evict`` would return now, changing nothing
      (default: ``evict`` on a copy; override it where that is cheaper);
    * ``remove(page)``: ``page`` left the set without an eviction (invalidated); no ghost entry.

    How pinned pages affect the order is each policy's own choice, documented on the class.
    ``params`` is the policy's own config section ``[policy.NAME]`` (a namespace of the fields in
    ``config_fields``), or None: then ``default_params()``.
    """

    config_fields: tuple = ()  # emulator.policies.param(...) fields of its section [policy.NAME]

    def __init__(self, capacity: int, params: Any = None):
        self.capacity = capacity

    @classmethod
    def default_params(cls) -> SimpleNamespace:
        return SimpleNamespace(**{f.name: f.default for f in cls.config_fields})

    @classmethod
    def capacity_problem(cls, capacity: int, params: Any) -> str | None:
        """None if a set of ``capacity`` ways suits this policy with ``params``, else why not (a profile error)."""
        return None

    def find(self, page: int, update: bool = True) -> bool:
        raise NotImplementedError

    def hit(self, page: int) -> None:
        self.find(page, True)

    def insert(self, page: int) -> None:
        raise NotImplementedError

    def evict(self, pinned: Pinned, incoming: int | None = None) -> int:
        raise NotImplementedError

    def to_evict(self, pinned: Pinned) -> int:
        return copy.deepcopy(self).evict(pinned)

    def remove(self, page: int) -> None:
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """Events worth reporting in the device's stats (e.g. divergences from the reference); default none."""
        return {}


class LruOrder(EvictionPolicy):
    """Least recently used. Pinned pages are skipped where they stand: they keep their place in the order."""

    def __init__(self, capacity: int, params=None):
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()  # least recent first
        # Called per page on the hot path of a replay: straight to the OrderedDict's C methods.
        self.hit = self.order.move_to_end
        self.insert = self.order.setdefault  # (page) -> order[page] = None

    def find(self, page, update=True):
        if update:
            try:
                self.order.move_to_end(page)
            except KeyError:
                return False
            return True
        return page in self.order

    def to_evict(self, pinned):
        # the scan runs in C: during write-back the LRU end can hold thousands of pinned pages
        return next(filterfalse(pinned, self.order))

    def evict(self, pinned, incoming=None):
        victim = next(filterfalse(pinned, self.order))
        del self.order[victim]
        return victim

    def remove(self, page):
        del self.order[page]


class FrameTable:
    def __init__(self, frames: int, ways: int | None = None,
                 eviction: Callable[[int], EvictionPolicy] = LruOrder):
        """``eviction(capacity)`` makes one set's eviction policy (default LRU, the RTL's)."""
        ways = frames if ways is None else ways
        if frames < 1 or ways < 1 or frames % ways:
            raise ValueError(f"frames={frames} must be a positive multiple of ways={ways}")
        self.frames, self.ways, self.sets = frames, ways, frames // ways
        self.page_of: list[int | None] = [None] * frames
        self.dirty = bytearray(frames)
        self.pins = [0] * frames
        self._where: dict[int, int] = {}
        self.orders = [eviction(ways) for _ in range(self.sets)]  # per set: what to evict
        self._free = [list(range(s * ways, (s + 1) * ways)) for s in range(self.sets)]  # heaps
        # Per set, the pages of its pinned frames: the eviction policy's test (a C-level one), and a set
        # whose every way is pinned is refused before its policy is asked.
        self._pinned: list[set[int]] = [set() for _ in range(self.sets)]

    def __len__(self) -> int:
        return len(self._where)

    def set_of(self, page: int) -> int:
        return page % self.sets

    def free_ways(self, page: int) -> int:
        return len(self._free[self.set_of(page)])

    def lookup(self, page: int) -> int | None:
        return self._where.get(page)

    def touch(self, frame: int) -> None:
        self.orders[frame // self.ways].hit(self.page_of[frame])

    def insert(self, page: int) -> Inserted | None:
        """Place ``page`` (not present) in its set; None if every way is pinned."""
        assert page not in self._where, f"page {page} already in frame {self._where[page]}"
        s = page % self.sets
        order = self.orders[s]
        victim_page, victim_dirty = None, False
        if self._free[s]:
            frame = heapq.heappop(self._free[s])
            if self.pins[frame]:  # pinned while empty: the page arrives pinned
                self._pinned[s].add(page)
        else:
            pinned = self._pinned[s]
            if len(pinned) == self.ways:
                return None
            victim_page = order.evict(pinned.__contains__, page)
            if victim_page in pinned or victim_page not in self._where:  # a plug-in's bug must not lose data
                raise RuntimeError(f"eviction policy {type(order).__name__} chose page {victim_page!r}, which is "
                                   f"{'pinned' if victim_page in pinned else 'not resident'}")
            frame = self._where.pop(victim_page)
            victim_dirty = bool(self.dirty[frame])
        self.page_of[frame] = page
        self.dirty[frame] = 0
        self._where[page] = frame
        order.insert(page)
        return Inserted(frame, victim_page, victim_dirty)

    def victim(self, page: int) -> int | None:
        """The frame ``insert(page)`` would evict, or None if a way is free or all are pinned."""
        s = self.set_of(page)
        pinned = self._pinned[s]
        if self._free[s] or len(pinned) == self.ways:
            return None
        return self._where[self.orders[s].to_evict(pinned.__contains__)]

    lru_victim = victim  # the name the RTL lockstep bench uses (its policy is LRU)

    def invalidate(self, frame: int) -> None:
        page = self.page_of[frame]
        assert page is not None and not self.pins[frame], f"frame {frame} is empty or pinned"
        del self._where[page]
        self.orders[frame // self.ways].remove(page)
        self.page_of[frame] = None
        self.dirty[frame] = 0
        heapq.heappush(self._free[frame // self.ways], frame)

    def mark_dirty(self, frame: int) -> None:
        self.dirty[frame] = 1

    def clear_dirty(self, frame: int) -> None:
        self.dirty[frame] = 0

    def pin(self, frame: int) -> None:
        pins = self.pins
        if not pins[frame]:
            page = self.page_of[frame]
            if page is not None:
                self._pinned[frame // self.ways].add(page)
        pins[frame] += 1

    def unpin(self, frame: int) -> None:
        pins = self.pins
        assert pins[frame] > 0, f"frame {frame} is not pinned"
        pins[frame] -= 1
        if not pins[frame]:
            page = self.page_of[frame]
            if page is not None:
                self._pinned[frame // self.ways].discard(page)

    def counters(self) -> dict[str, int]:
        """The eviction policies' event counters, summed over the sets."""
        total: dict[str, int] = {}
        for order in self.orders:
            for key, n in order.counters().items():
                total[key] = total.get(key, 0) + n
        return total
