"""``clock``: a transparent cache evicting by CLOCK, second chance (libCacheSim's Clock)."""

from __future__ import annotations

from collections import OrderedDict

from . import EvictionPolicy, param, register


class ClockOrder(EvictionPolicy):
    """CLOCK as libCacheSim's ``Clock`` (``init_freq=0``): a queue, new pages at the head with counter 0; a
    hit adds 1 up to ``2**n_bit_counter - 1``. The hand looks at the tail: a page with a nonzero counter
    loses 1 and goes to the head, the first page at 0 is the victim. Pinned pages are passed over like
    a hand passes a page it may not take: they go to the head with their counter unchanged."""

    config_fields = (param("n_bit_counter", int, 1, 8, default=1,
                           doc="bits of each page's reference counter (libCacheSim's n-bit-counter)"),)

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


register("clock", ClockOrder)
