"""The GPU's KV cache with vLLM's automatic prefix caching (v1 ``BlockPool``), in KV blocks.

* Full blocks are cached by key (the key names the block and, being per conversation and position,
  its whole prefix). A request's longest cached prefix is a hit: those blocks are shared, not
  recomputed.
* Blocks no running request holds are *free but cached*, in a queue: the head is evicted first when
  a block is needed. A finished request's blocks join the tail in reverse order (vLLM
  ``KVCacheManager.free``: "free blocks in reverse order so that the tail blocks are evicted first"),
  so a conversation's early blocks outlive its late ones. A hit takes a block out of the queue.
* Blocks of a running request that are not full (the partial last block, decode tokens) are held,
  never cached.

Granularity: the tier's block (128 tokens), not vLLM's 16-token block: what is reused remotely is
reused in these units, and the capacity in tokens is the same.
"""

from __future__ import annotations

from collections import OrderedDict


class GpuPrefixCache:
    def __init__(self, capacity_blocks: int, caching: bool = True):
        if capacity_blocks < 1:
            raise ValueError(f"GPU KV capacity = {capacity_blocks} blocks must be >= 1")
        self.capacity, self.caching = capacity_blocks, caching
        self.free_cached: OrderedDict = OrderedDict()  # key -> None; head evicted first
        self.refs: dict = {}                             # cached key -> running requests holding it
        self.held_uncached = 0                           # partial / not-yet-cached blocks of running requests
        self.evictions = 0

    @property
    def used(self) -> int:
        return len(self.free_cached) + len(self.refs) + self.held_uncached

    def match(self, keys) -> int:
        """Length of the longest cached prefix of ``keys``."""
        if not self.caching:
            return 0
        n = 0
        for key in keys:
            if key in self.refs or key in self.free_cached:
                n += 1
            else:
                break
        return n

    def allocate(self, hit_keys, new_blocks: int) -> bool:
        """Hold ``hit_keys`` (cached) and ``new_blocks`` more, evicting free cached blocks as needed;
        False (nothing changed) if they do not fit."""
        evictable = len(self.free_cached) - sum(1 for k in hit_keys if k in self.free_cached)
        need = new_blocks - (self.capacity - self.used)
        if need > evictable:
            return False
        for k in hit_keys:
            if k in self.free_cached:
                del self.free_cached[k]
            self.refs[k] = self.refs.get(k, 0) + 1
        while need > 0:
            self.free_cached.popitem(last=False)
            self.evictions += 1
            need -= 1
        self.held_uncached += new_blocks
        return True

    def cache(self, keys) -> None:
        """Blocks of a running request became full and computed (or loaded): cached under their keys.
        Each was counted in ``held_uncached``; a key cached meanwhile by another request is shared."""
        for k in keys:
            self.held_uncached -= 1
            if k in self.refs:
                self.refs[k] += 1
            elif k in self.free_cached:  # computed twice (raced): keep one copy
                del self.free_cached[k]
                self.refs[k] = 1
            else:
                self.refs[k] = 1

    def free(self, cached_keys, uncached: int) -> None:
        """A request finished: its cached blocks (in context order) go free, tail first; the rest is dropped."""
        self.held_uncached -= uncached
        for k in reversed(cached_keys):
            n = self.refs[k] - 1
            if n:
                self.refs[k] = n
            else:
                del self.refs[k]
                self.free_cached[k] = None
