"""``s3fifo``: a transparent cache evicting by S3-FIFO (libCacheSim's S3FIFO)."""

from __future__ import annotations

from collections import OrderedDict

from . import EvictionPolicy, param, register

MAIN_MAX_FREQ = 3  # libCacheSim's main queue is a CLOCK with a 2-bit counter
MIN_SMALL_FRAMES = 2  # libCacheSim admits no object as large as the small queue: with 1 frame nothing enters


class S3FifoOrder(EvictionPolicy):
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

    config_fields = (
        param("small_size_ratio", float, 0.001, 0.9, default=0.1, doc="share of the frames in the small FIFO queue"),
        param("ghost_size_ratio", float, 0.0, 8.0, default=0.9,
              doc="ghost FIFO length (page numbers evicted from the small queue), as a share of the frames"),
        param("move_to_main_threshold", int, 1, 64, default=2,
              doc="hits in the small queue that move a page to the main queue instead of evicting it"),
    )

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

    @classmethod
    def capacity_problem(cls, capacity, params):
        small = int(capacity * params.small_size_ratio)
        if small < MIN_SMALL_FRAMES or small >= capacity:
            return (f"policy.s3fifo.small_size_ratio = {params.small_size_ratio:g} gives a small queue of {small} "
                    f"of the {capacity} frames; S3-FIFO needs at least {MIN_SMALL_FRAMES} there (libCacheSim admits "
                    f"no page into a 1-page small queue) and at least 1 in the main queue")
        return None

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


register("s3fifo", S3FifoOrder)
