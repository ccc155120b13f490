"""The peer a replayed ``lru`` device is checked against: a plain LRU cache
(an ``OrderedDict``) over the same page stream, with no timing, pinning,
flushing or prefetch."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, NamedTuple


class LruCounts(NamedTuple):
    read_hits: int
    read_misses: int
    pages: int  # page accesses of every kind
    write_misses: int  # written pages that were not cached (the replay's write allocations)


def ordered_dict_lru(ops: Iterable[tuple[str, int, int]], page_bytes: int, frames: int) -> LruCounts:
    """Replay recorded ``(kind, addr, length)`` operations (``Replay(record_ops=True).ops``) through an
    LRU of ``frames`` pages of ``page_bytes``; hits and misses are counted for reads, misses for writes too."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = misses = pages = write_misses = 0
    for kind, addr, length in ops:
        for p in range(addr // page_bytes, (addr + length - 1) // page_bytes + 1):
            pages += 1
            if p in cache:
                cache.move_to_end(p)
                hits += kind == "read"
            else:
                misses += kind == "read"
                write_misses += kind == "write"
                cache[p] = None
                if len(cache) > frames:
                    cache.popitem(last=False)
    return LruCounts(hits, misses, pages, write_misses)
