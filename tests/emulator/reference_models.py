"""The Python implementations the native core replaced (emulator/native/), kept as the
models the property tests (test_native_core.py) compare it with: the frame table and LRU
(emulator/frame_table.py), FIFO, CLOCK, SIEVE and S3-FIFO (emulator/policies/), the prefetch engine
(emulator/prefetch.py) and write admission (emulator/write_buffer.py), as of the commit before the native
core. Each was checked against libCacheSim (test_policy_eviction.py) and the RTL (rtl_model/) then.
Not used by the product."""

from __future__ import annotations

import copy
import errno
import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import filterfalse
from types import SimpleNamespace

from emulator.errors import ChmError
from emulator.frame_table import Inserted


class Model:
    """The former ``EvictionPolicy`` base: the op table's defaults."""

    DEFAULTS: dict = {}  # the policy's parameters (its config section's defaults)

    def __init__(self, capacity, params=None):
        self.capacity = capacity

    @classmethod
    def default_params(cls):
        return SimpleNamespace(**cls.DEFAULTS)

    def hit(self, page):
        self.find(page, True)

    def to_evict(self, pinned):
        return copy.deepcopy(self).evict(pinned)

    def counters(self):
        return {}


class LruOrder(Model):
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


class FrameTableModel:
    def __init__(self, frames: int, ways: int | None = None,
                 eviction=LruOrder):
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


class FifoOrder(Model):
    """First in, first out: a hit changes nothing. Pinned pages are skipped where they stand (they keep
    their place, and go first once unpinned)."""

    def __init__(self, capacity, params=None):
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()  # oldest first (a dict would rescan its deleted head)

    def find(self, page, update=True):
        return page in self.order

    def insert(self, page):
        self.order[page] = None

    def to_evict(self, pinned):
        return next(filterfalse(pinned, self.order))

    def evict(self, pinned, incoming=None):
        victim = next(filterfalse(pinned, self.order))
        del self.order[victim]
        return victim

    def remove(self, page):
        del self.order[page]


class ClockOrder(Model):
    """CLOCK as libCacheSim's ``Clock`` (``init_freq=0``): a queue, new pages at the head with counter 0; a
    hit adds 1 up to ``2**n_bit_counter - 1``. The hand looks at the tail: a page with a nonzero counter
    loses 1 and goes to the head, the first page at 0 is the victim. Pinned pages are passed over like
    a hand passes a page it may not take: they go to the head with their counter unchanged."""

    DEFAULTS = {"n_bit_counter": 1}

    def __init__(self, capacity, params=None):
        super().__init__(capacity)
        params = params or self.default_params()
        self.max_freq = (1 << params.n_bit_counter) - 1
        self.freq: OrderedDict[int, int] = OrderedDict()  # the queue, tail (under the hand) first: page -> counter

    def find(self, page, update=True):
        f = self.freq.get(page)
        if f is None:
            return False
        if update and f < self.max_freq:
            self.freq[page] = f + 1
        return True

    def insert(self, page):
        self.freq[page] = 0

    def to_evict(self, pinned):
        # Each full turn of the hand takes 1 off every counter it passes, in queue order: the victim is
        # the first unpinned page (from the tail) with the smallest counter.
        victim, low = None, None
        for page, f in self.freq.items():
            if not pinned(page) and (low is None or f < low):
                victim, low = page, f
                if f == 0:
                    break
        return victim

    def evict(self, pinned, incoming=None):
        freq = self.freq
        while True:
            page = next(iter(freq))
            f = freq[page]
            if pinned(page):
                freq.move_to_end(page)
            elif f:
                freq[page] = f - 1
                freq.move_to_end(page)
            else:
                del freq[page]
                return page

    def remove(self, page):
        del self.freq[page]


class SieveOrder(Model):
    """SIEVE as libCacheSim's ``Sieve``: a queue with new pages at the head, a visited bit per page (set by a
    hit), and a hand that moves from the tail towards the head (wrapping to the tail), clearing visited
    bits, and evicts the first page not visited; the next eviction starts where the hand stopped.
    Pinned pages are passed over and keep their bit."""

    def __init__(self, capacity, params=None):
        super().__init__(capacity)
        self.visited: dict[int, bool] = {}
        self.newer: dict[int, int | None] = {}  # the neighbour towards the head (libCacheSim's queue.prev)
        self.older: dict[int, int | None] = {}
        self.head: int | None = None  # newest
        self.tail: int | None = None  # oldest
        self.hand: int | None = None  # the page the hand looks at next (None: the tail)

    def find(self, page, update=True):
        if page not in self.visited:
            return False
        if update:
            self.visited[page] = True
        return True

    def insert(self, page):
        self.visited[page] = False
        self.newer[page], self.older[page] = None, self.head
        if self.head is None:
            self.tail = page
        else:
            self.newer[self.head] = page
        self.head = page

    def _next(self, page: int) -> int:
        """Where the hand goes after ``page``: towards the head, then round to the tail."""
        newer = self.newer[page]
        return self.tail if newer is None else newer

    def to_evict(self, pinned):
        # One turn: the first unpinned page not visited; after a full turn every unpinned bit is clear and
        # the hand is back where it started, so it takes the first unpinned page it passed.
        page = self.tail if self.hand is None else self.hand
        first_unpinned = None
        for _ in range(len(self.visited)):
            if not pinned(page):
                if not self.visited[page]:
                    return page
                if first_unpinned is None:
                    first_unpinned = page
            page = self._next(page)
        return first_unpinned

    def evict(self, pinned, incoming=None):
        page = self.tail if self.hand is None else self.hand
        visited = self.visited
        while True:
            if pinned(page):
                pass
            elif visited[page]:
                visited[page] = False
            else:
                break
            page = self._next(page)
        self.hand = self.newer[page]
        self._unlink(page)
        return page

    def remove(self, page):
        if page == self.hand:
            self.hand = self.newer[page]
        self._unlink(page)

    def _unlink(self, page: int) -> None:
        newer, older = self.newer.pop(page), self.older.pop(page)
        del self.visited[page]
        if newer is None:
            self.head = older
        else:
            self.older[newer] = older
        if older is None:
            self.tail = newer
        else:
            self.newer[older] = newer


MAIN_MAX_FREQ = 3  # libCacheSim's main queue is a CLOCK with a 2-bit counter


class S3FifoOrder(Model):
    """S3-FIFO as libCacheSim's ``S3FIFO`` (its current version): a small FIFO queue
    (``small_size_ratio`` of the frames), a main queue (the rest) and a ghost FIFO of page numbers
    (``ghost_size_ratio``). A new page enters the small queue, or the main queue if it is in the ghost
    (or, before the first eviction, if the small queue is full). Each hit adds 1 to its counter. Evicting
    from the small queue (when the main queue is within its share): a page hit at least
    ``move_to_main_threshold`` times moves to the main queue, the first that was not is the victim and
    its number goes to the ghost. Evicting from the main queue: a page with a nonzero counter goes back
    to the head with ``min(counter, 3) - 1``, the first at 0 is the victim.

    Pinned pages are passed over: they go to the head of the queue they are in, counter unchanged. When
    every page left in the chosen queue is pinned, the victim comes from the other queue."""

    DEFAULTS = {"small_size_ratio": 0.1, "ghost_size_ratio": 0.9, "move_to_main_threshold": 2}

    def __init__(self, capacity, params=None):
        super().__init__(capacity)
        params = params or self.default_params()
        # integer parts as libCacheSim computes them (int64 times double, truncated)
        self.small_capacity = int(capacity * params.small_size_ratio)
        self.main_capacity = capacity - self.small_capacity
        self.ghost_capacity = int(capacity * params.ghost_size_ratio)
        self.threshold = params.move_to_main_threshold
        self.small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.ghost: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.freq: dict[int, int] = {}  # resident page -> hits counted
        self.has_evicted = False
        self.from_ghost: int | None = None  # the incoming page evict() took out of the ghost, for insert()

    def find(self, page, update=True):
        f = self.freq.get(page)
        if f is None:
            return False
        if update:
            self.freq[page] = f + 1
        return True

    def insert(self, page):
        # libCacheSim checks the ghost when the miss is looked up, before evicting: evict() did it then
        if self.from_ghost == page:
            self.from_ghost, in_ghost = None, True
        else:
            in_ghost = self._take_from_ghost(page)
        if in_ghost or (not self.has_evicted and len(self.small) >= self.small_capacity):
            self.main[page] = None
        else:
            self.small[page] = None
        self.freq[page] = 0

    def evict(self, pinned, incoming=None):
        if incoming is not None:
            self.from_ghost = incoming if self._take_from_ghost(incoming) else None
        self.has_evicted = True
        for _ in range(2):  # a second round after the small queue moved its pages to the main queue
            if len(self.main) > self.main_capacity or not self.small:
                victim = self._evict_main(pinned)
                if victim is None:
                    victim = self._evict_small(pinned)
            else:
                victim = self._evict_small(pinned)
                if victim is None:
                    victim = self._evict_main(pinned)
            if victim is not None:
                return victim
        raise RuntimeError("S3-FIFO asked for a victim while every resident page is pinned")

    def _evict_small(self, pinned) -> int | None:
        small, passed = self.small, 0
        while small and passed < len(small):  # passed == len: every page left is pinned
            page = next(iter(small))
            if pinned(page):
                small.move_to_end(page)
                passed += 1
                continue
            del small[page]
            if self.freq[page] >= self.threshold:
                self.main[page] = None
                self.freq[page] = 0
                continue
            del self.freq[page]
            if self.ghost_capacity:
                while len(self.ghost) >= self.ghost_capacity:
                    self.ghost.popitem(last=False)
                self.ghost[page] = None
            return page
        return None

    def _evict_main(self, pinned) -> int | None:
        main, freq, pinned_run = self.main, self.freq, 0
        while main and pinned_run < len(main):  # a whole turn of pinned pages: every page here is pinned
            page = next(iter(main))
            main.move_to_end(page)
            if pinned(page):
                pinned_run += 1
                continue
            pinned_run = 0
            f = freq[page]
            if not f:
                del main[page]
                del freq[page]
                return page
            freq[page] = min(f, MAIN_MAX_FREQ) - 1
        return None

    def remove(self, page):
        del self.freq[page]
        if page in self.small:
            del self.small[page]
        else:
            del self.main[page]

    def _take_from_ghost(self, page: int) -> bool:
        if page in self.ghost:
            del self.ghost[page]
            return True
        return False


@dataclass
class Staging:
    handle: int
    first_page: int
    pages: int
    arrived: int = 0

    @property
    def ready(self) -> bool:
        return self.arrived == self.pages


class PrefetchEngine:
    def __init__(self, window_pages: int, max_handles: int):
        self.window_pages, self.max_handles = window_pages, max_handles
        self.objects: dict[int, Staging] = {}
        self.pages_held = 0
        self.fetch_queue: deque[tuple[int, int]] = deque()  # (handle, page) in issue order

    def issue(self, handle: int, first_page: int, pages: int) -> None:
        """Accept a prefetch of ``pages`` pages from ``first_page`` under ``handle``."""
        if handle in self.objects:
            raise ChmError(errno.EINVAL, f"prefetch handle {handle} is already in use")
        if pages > self.window_pages:
            raise ChmError(errno.EINVAL, f"object of {pages} pages can never fit the prefetch window of {self.window_pages} pages")
        if len(self.objects) >= self.max_handles:
            raise ChmError(errno.EBUSY, f"the device's prefetch handles are all in use: {len(self.objects)} of "
                                        f"{self.max_handles} handles outstanding (policy.prefetch_max_handles)")
        if self.pages_held + pages > self.window_pages:
            raise ChmError(errno.EBUSY, f"the device's prefetch window is full: {self.pages_held} of "
                                        f"{self.window_pages} pages held, {pages} more requested "
                                        f"(policy.prefetch_window_bytes)")
        self.objects[handle] = Staging(handle, first_page, pages)
        self.pages_held += pages
        self.fetch_queue.extend((handle, first_page + i) for i in range(pages))

    def next_fetch(self) -> tuple[int, int] | None:
        """The next page fetch to send to the SSD side, in issue order."""
        return self.fetch_queue.popleft() if self.fetch_queue else None

    def arrived(self, handle: int) -> bool:
        """One page of ``handle`` has arrived; True when the object became ready."""
        obj = self.objects[handle]
        assert obj.arrived < obj.pages, f"handle {handle}: more arrivals than pages"
        obj.arrived += 1
        return obj.ready

    def get(self, handle: int) -> Staging:
        obj = self.objects.get(handle)
        if obj is None:
            raise ChmError(errno.EINVAL, f"unknown or released prefetch handle {handle}")
        return obj

    def release(self, handle: int) -> Staging:
        obj = self.get(handle)
        del self.objects[handle]
        self.pages_held -= obj.pages
        return obj


class WriteAdmission:
    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self.used_pages = 0

    @property
    def free_pages(self) -> int:
        return self.capacity_pages - self.used_pages

    def admit(self, pages: int) -> bool:
        """Reserve ``pages`` if all fit; otherwise reserve nothing and refuse."""
        if pages > self.free_pages:
            return False
        self.used_pages += pages
        return True

    def release(self, pages: int) -> None:
        assert 0 <= pages <= self.used_pages, f"release of {pages} pages with {self.used_pages} reserved"
        self.used_pages -= pages
