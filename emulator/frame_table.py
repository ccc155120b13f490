"""The DRAM frame table: which device page lives in which DRAM frame.

This class is both what the emulator's policies use and the reference model
that ``rtl_model/chm_frame_table`` is checked against, so its decisions are
fully specified:

* ``frames`` frames in ``sets = frames // ways`` sets of ``ways`` ways
  (``ways == frames``: fully associative). Page ``p`` maps to set
  ``p % sets``; frame index = ``set * ways + way``.
* ``insert`` takes the lowest-numbered free way of the set; if none is free,
  the least recently used way that is not pinned (its page and dirty bit are
  reported as the victim). If every way is pinned it returns None.
* ``lookup`` does not change the LRU order; ``touch`` makes a frame most
  recently used; ``insert`` makes the new frame most recently used.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import filterfalse
from typing import NamedTuple


class Inserted(NamedTuple):
    frame: int
    victim_page: int | None  # page evicted to make room, or None
    victim_dirty: bool


class FrameTable:
    def __init__(self, frames: int, ways: int | None = None):
        ways = frames if ways is None else ways
        if frames < 1 or ways < 1 or frames % ways:
            raise ValueError(f"frames={frames} must be a positive multiple of ways={ways}")
        self.frames, self.ways, self.sets = frames, ways, frames // ways
        self.page_of: list[int | None] = [None] * frames
        self.dirty = bytearray(frames)
        self.pins = [0] * frames
        self._where: dict[int, int] = {}
        self._lru = [OrderedDict() for _ in range(self.sets)]  # per set: frames, least recent first
        self._free = [list(range(s * ways, (s + 1) * ways)) for s in range(self.sets)]  # heaps

    def __len__(self) -> int:
        return len(self._where)

    def set_of(self, page: int) -> int:
        return page % self.sets

    def free_ways(self, page: int) -> int:
        return len(self._free[self.set_of(page)])

    def lookup(self, page: int) -> int | None:
        return self._where.get(page)

    def touch(self, frame: int) -> None:
        self._lru[frame // self.ways].move_to_end(frame)

    def insert(self, page: int) -> Inserted | None:
        """Place ``page`` (not present) in its set; None if every way is pinned."""
        assert page not in self._where, f"page {page} already in frame {self._where[page]}"
        s = self.set_of(page)
        victim_page, victim_dirty = None, False
        if self._free[s]:
            frame = heapq.heappop(self._free[s])
        else:
            frame = self._first_unpinned(s)
            if frame is None:
                return None
            victim_page, victim_dirty = self.page_of[frame], bool(self.dirty[frame])
            del self._where[victim_page]
            del self._lru[s][frame]
        self.page_of[frame] = page
        self.dirty[frame] = 0
        self._where[page] = frame
        self._lru[s][frame] = None
        return Inserted(frame, victim_page, victim_dirty)

    def lru_victim(self, page: int) -> int | None:
        """The frame ``insert(page)`` would evict, or None if a way is free or all are pinned."""
        s = self.set_of(page)
        if self._free[s]:
            return None
        return self._first_unpinned(s)

    def _first_unpinned(self, s: int) -> int | None:
        """The least recently used frame of set ``s`` that is not pinned (the scan runs in C: during
        write-back the LRU end can hold thousands of pinned frames)."""
        return next(filterfalse(self.pins.__getitem__, self._lru[s]), None)

    def invalidate(self, frame: int) -> None:
        page = self.page_of[frame]
        assert page is not None and not self.pins[frame], f"frame {frame} is empty or pinned"
        del self._where[page]
        del self._lru[frame // self.ways][frame]
        self.page_of[frame] = None
        self.dirty[frame] = 0
        heapq.heappush(self._free[frame // self.ways], frame)

    def mark_dirty(self, frame: int) -> None:
        self.dirty[frame] = 1

    def clear_dirty(self, frame: int) -> None:
        self.dirty[frame] = 0

    def pin(self, frame: int) -> None:
        self.pins[frame] += 1

    def unpin(self, frame: int) -> None:
        assert self.pins[frame] > 0, f"frame {frame} is not pinned"
        self.pins[frame] -= 1
