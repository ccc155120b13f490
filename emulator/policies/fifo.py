"""``fifo``: a transparent cache evicting in arrival order (libCacheSim's FIFO)."""

from __future__ import annotations

from collections import OrderedDict
from itertools import filterfalse

from . import EvictionPolicy, register


class FifoOrder(EvictionPolicy):
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


register("fifo", FifoOrder)
