"""``sieve``: a transparent cache evicting by SIEVE (libCacheSim's Sieve)."""

from __future__ import annotations

from . import EvictionPolicy, register


class SieveOrder(EvictionPolicy):
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


register("sieve", SieveOrder)
