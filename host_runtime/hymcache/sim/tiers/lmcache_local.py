"""``lmcache-local``: LMCache's local CPU DRAM backend on each worker."""

from __future__ import annotations

from collections import OrderedDict

from ..events import Env
from .base import CopiedOffGpu, RemoteTier, blocks_per_chunk, chunk_key
from .host import Host


class LMCacheLocal(CopiedOffGpu, RemoteTier):
    """LMCache's local CPU backend on each worker: ``dram_bytes`` of pinned host memory, LRU, chunks of
    ``chunk_tokens`` tokens. A request reuses the chunks present as one unbroken chain from the first:
    once LRU has evicted an early chunk, nothing after it is reusable (LMCache looks up prefixes).
    Retrieved chunks are touched (most recently used); a store skips chunks already present (not
    touched) and inserts the rest, evicting from the LRU head. Loads and stores cross PCIe."""

    name = "lmcache-local"

    def __init__(self, env: Env, host: Host, block_bytes: int, tokens_per_block: int, dram_bytes: int,
                 chunk_tokens: int):
        super().__init__(env, host, block_bytes)
        self.per_chunk = blocks_per_chunk(chunk_tokens, tokens_per_block)
        self.chunk_bytes = self.per_chunk * block_bytes
        self.capacity = dram_bytes // self.chunk_bytes
        if self.capacity < 1:
            raise ValueError(f"dram = {dram_bytes} bytes holds no LMCache chunk of {self.chunk_bytes} bytes")
        self.lru: OrderedDict = OrderedDict()   # (conversation, chunk) -> None; head evicted first
        self.pinned: dict = {}                   # chunk -> lookups holding it (never evicted meanwhile)
        self._pins: dict[str, list] = {}
        self.evictions = 0
        self._pending: dict[str, tuple[list, float]] = {}

    def _ckey(self, req, c: int) -> tuple[int, int]:
        return chunk_key(req, c, self.per_chunk)

    def _chain(self, req, limit_blocks: int) -> int:
        c = 0
        while c * self.per_chunk < limit_blocks and self._ckey(req, c) in self.lru:
            c += 1
        return min(c * self.per_chunk, limit_blocks)

    def lookup(self, req) -> int:
        """The chain beyond the GPU hit; its chunks are pinned until loaded (LMCache's lookup pins its hits)."""
        n = max(0, self._chain(req, req.lookup_blocks) - req.gpu_hit)
        if n:
            g = req.gpu_hit
            self._pin(req, [self._ckey(req, c) for c in range(g // self.per_chunk, (g + n - 1) // self.per_chunk + 1)])
        return n

    def _pin(self, req, keys: list) -> None:
        for k in keys:
            self.pinned[k] = self.pinned.get(k, 0) + 1
        self._pins[req.rid] = keys

    def _unpin(self, req) -> None:
        for k in self._pins.pop(req.rid, ()):
            left = self.pinned[k] - 1
            if left:
                self.pinned[k] = left
            else:
                del self.pinned[k]

    def finish(self, req) -> None:
        self._unpin(req)

    def _evict_one(self) -> bool:
        for k in self.lru:
            if k not in self.pinned:
                del self.lru[k]
                self.evictions += 1
                return True
        return False

    def load(self, req, n: int):
        if n <= 0:
            return 0
        for k in self._pins.get(req.rid, ()):
            self.lru.move_to_end(k)
        self._unpin(req)
        nbytes = n * self.block_bytes
        done = self.host.h2d.transfer(self.env.now, nbytes)
        req.read_bytes += nbytes
        yield done
        return n

    def reserve_store(self, req) -> None:
        full = req.full_blocks // self.per_chunk
        self._copy_off_gpu(req, [self._ckey(req, c) for c in range(full) if self._ckey(req, c) not in self.lru])

    def store(self, req):
        new = yield from self._copied(req)
        for key in new:
            if key in self.lru:
                continue  # present: not touched, not written again
            if not self.insert(key):
                break  # everything is pinned by lookups in flight: the rest is not stored
            req.write_bytes += self.chunk_bytes

    def insert(self, key) -> bool:
        """Put chunk ``key`` at the LRU tail, evicting from the head; False if everything is pinned."""
        if key in self.lru:
            self.lru.move_to_end(key)
            return True
        if len(self.lru) >= self.capacity and not self._evict_one():
            return False
        self.lru[key] = None
        return True

    def describe(self) -> dict:
        return {"tier": self.name, "chunk_blocks": self.per_chunk, "capacity_chunks": self.capacity,
                "chunks": len(self.lru), "evictions": self.evictions}
