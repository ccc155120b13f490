"""``lmcache-redis`` and ``lmcache-local+redis``: LMCache's remote backend, one Redis over TCP."""

from __future__ import annotations

from collections import OrderedDict

from emulator.timing import Pipe

from ..events import Env
from .base import NS, CopiedOffGpu, RemoteTier, blocks_per_chunk, chunk_key
from .host import Host
from .lmcache_local import LMCacheLocal


REDIS_POLICIES = ("noeviction", "allkeys-lru")


class Redis:
    """One Redis server as LMCache's remote backend: one value per chunk, ``maxmemory`` = ``capacity`` bytes.

    * memory (redis.io, "OOM error" and "Key eviction"): before a write runs, Redis compares used memory with
      ``maxmemory``; above it, the default policy ``noeviction`` refuses the write (``OOM command not allowed
      when used memory > 'maxmemory'``) and keeps every key; ``allkeys-lru`` first evicts least recently used
      keys (a GET touches) until used memory is back under the limit. Reads always work.
    * time: Redis runs commands on one thread, so GETs and SETs of every client go through one pipe over TCP
      (``gbps``, ``latency_ns``), in the order they are sent.
    * a SET is decided when it is sent (the pipe is first in, first out: the order Redis runs it) and its value
      is readable once it has landed.
    """

    def __init__(self, env: Env, capacity_bytes: int, chunk_bytes: int, *, policy: str, gbps: float,
                 latency_ns: float):
        if policy not in REDIS_POLICIES:
            raise ValueError(f"redis policy {policy!r} is not one of {', '.join(REDIS_POLICIES)}")
        self.env, self.capacity, self.chunk_bytes, self.policy = env, capacity_bytes, chunk_bytes, policy
        self.pipe = Pipe("redis.tcp", latency_ns, gbps / 8)
        self.keys: OrderedDict = OrderedDict()  # accepted keys, least recently used first: True once readable
        self.used = 0                            # bytes of the accepted values
        self.counters = dict.fromkeys(("sets", "set_oom", "evictions", "gets"), 0)

    def __contains__(self, key) -> bool:
        """Readable: its SET has landed (and it has not been evicted)."""
        return self.keys.get(key, False)

    def pending(self, key) -> bool:
        """Its SET is on the way."""
        return self.keys.get(key) is False

    def readable(self) -> set:
        return {k for k, landed in self.keys.items() if landed}

    def set(self, key) -> bool:
        """Send a SET of one chunk now; False if Redis refuses it (OOM). Every earlier SET runs before it (the
        pipe's order), so the keys they wrote count, and can be evicted, when it runs."""
        self.counters["sets"] += 1
        if self.used > self.capacity and self.policy == "allkeys-lru":
            while self.used > self.capacity and self.keys:
                self.keys.popitem(last=False)
                self.used -= self.chunk_bytes
                self.counters["evictions"] += 1
        if self.used > self.capacity:
            self.counters["set_oom"] += 1
            return False
        self.used += self.chunk_bytes
        self.keys[key] = False
        landed = self.pipe.transfer(self.env.now, self.chunk_bytes)
        self.env.call_at(landed, lambda: self._land(key))
        return True

    def _land(self, key) -> None:
        if key in self.keys:  # not evicted meanwhile
            self.keys[key] = True

    def get(self, key) -> float:
        """Send a GET of one chunk now: when its value arrives."""
        self.counters["gets"] += 1
        self.keys.move_to_end(key)
        return self.pipe.transfer(self.env.now, self.chunk_bytes)


class LMCacheRedis(CopiedOffGpu, RemoteTier):
    """LMCache with a Redis remote backend, alone (``lmcache-redis``, ``local_cpu: False``) or behind its local
    CPU backend (``lmcache-local+redis``: ``local``, an ``LMCacheLocal``, looked up first).

    * lookup: the unbroken chain of chunks from chunk 0 that the local LRU or Redis holds (LMCache's
      ``contains`` asks each backend in order); the local ones are pinned until loaded;
    * load: per chunk, in order: a local chunk crosses PCIe; a Redis chunk is a GET over TCP, then PCIe, and is
      written back into the local LRU (the local backend is LMCache's hot cache). A chunk not in by the load
      timeout, or gone since the lookup, ends the load: it and the rest are recomputed;
    * store: the chunks no backend holds are copied out of the GPU (during the forward), then put into every
      backend (LMCache's ``batched_put`` writes through all of them): the local LRU at once, Redis by an
      asynchronous SET. A SET Redis refuses is skipped (``skipped_inserts``): with the local tier gone or
      evicted, the conversation's chain breaks at that chunk.
    """

    name = "lmcache-redis"

    def __init__(self, env: Env, host: Host, block_bytes: int, tokens_per_block: int, chunk_tokens: int,
                 redis: Redis, *, timeout_s: float, local: LMCacheLocal | None = None, name: str | None = None):
        super().__init__(env, host, block_bytes)
        if name:
            self.name = name
        self.per_chunk = blocks_per_chunk(chunk_tokens, tokens_per_block)
        self.chunk_bytes = self.per_chunk * block_bytes
        if redis.chunk_bytes != self.chunk_bytes:
            raise ValueError("Redis's values and this tier's chunks differ in size")
        self.redis, self.local, self.timeout_ns = redis, local, timeout_s * NS
        self._pending: dict[str, tuple[list, float]] = {}
        self.counters = dict.fromkeys(("loaded_local", "loaded_redis", "load_timeouts", "load_missing",
                                       "stores", "stored", "refused"), 0)

    def _has(self, key) -> bool:
        return (self.local is not None and key in self.local.lru) or key in self.redis

    def lookup(self, req) -> int:
        c, limit, P = 0, req.lookup_blocks, self.per_chunk
        while c * P < limit and self._has(chunk_key(req, c, P)):
            c += 1
        n = max(0, min(c * P, limit) - req.gpu_hit)
        if n and self.local is not None:
            g = req.gpu_hit
            keys = [chunk_key(req, c, P) for c in range(g // P, (g + n - 1) // P + 1)]
            self.local._pin(req, [k for k in keys if k in self.local.lru])
        return n

    def finish(self, req) -> None:
        if self.local is not None:
            self.local._unpin(req)

    def load(self, req, n: int):
        if n <= 0:
            return 0
        env, P, local = self.env, self.per_chunk, self.local
        deadline = env.now + self.timeout_ns
        first, end = req.gpu_hit, req.gpu_hit + n
        done, last = 0, env.now
        for c in range(first // P, (end - 1) // P + 1):
            key = chunk_key(req, c, P)
            if local is not None and key in local.lru:
                local.lru.move_to_end(key)
                ready = env.now
                self.counters["loaded_local"] += 1
            elif key in self.redis:
                ready = self.redis.get(key)
                if ready > deadline:  # not in within the timeout: the worker waited for it, then recomputes
                    last = max(last, deadline)
                    self.counters["load_timeouts"] += 1
                    req.timeouts += 1
                    break
                self.counters["loaded_redis"] += 1
                if local is not None:
                    local.insert(key)  # written back into the hot cache
            else:  # evicted since the lookup
                self.counters["load_missing"] += 1
                break
            part = min(end, (c + 1) * P) - max(first, c * P)
            last = max(last, self.host.h2d.transfer(ready, part * self.block_bytes))
            done += part
            req.read_bytes += part * self.block_bytes
        self.finish(req)
        if last > env.now:
            yield last
        return done

    def reserve_store(self, req) -> None:
        P = self.per_chunk
        new = [k for k in (chunk_key(req, c, P) for c in range(req.full_blocks // P))
               if not self._has(k) and not self.redis.pending(k)]
        self._copy_off_gpu(req, new)

    def store(self, req):
        new = yield from self._copied(req)
        local, redis = self.local, self.redis
        for key in new:
            if local is not None and key not in local.lru and local.insert(key):
                req.write_bytes += self.chunk_bytes
            if key in redis or redis.pending(key):
                continue
            self.counters["stores"] += 1
            if redis.set(key):
                self.counters["stored"] += 1
                req.write_bytes += self.chunk_bytes
            else:
                self.counters["refused"] += 1
                req.skipped_inserts += 1

    def describe(self) -> dict:
        d = {"tier": self.name, "chunk_blocks": self.per_chunk, "redis_capacity_bytes": self.redis.capacity,
             "redis_policy": self.redis.policy, "redis_keys": len(self.redis.readable()), "redis_used": self.redis.used,
             **{f"redis_{k}": v for k, v in self.redis.counters.items()}, **self.counters}
        if self.local is not None:
            d.update(local_capacity_chunks=self.local.capacity, local_chunks=len(self.local.lru),
                     local_evictions=self.local.evictions)
        return d
