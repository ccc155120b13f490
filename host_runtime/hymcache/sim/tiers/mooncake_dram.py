"""``mooncake-dram``: Mooncake Store's master over a DRAM pool, one segment per prefill node, over RDMA."""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from ..events import Env
from .base import NS, RemoteTier, blocks_per_chunk, chunk_key
from .host import Host, rdma


class MooncakePool:
    """Mooncake Store's master over a DRAM pool of ``segments`` equal segments (segment s lives on prefill
    node s), in chunk-sized objects.

    * ``put_start`` allocates an object in a segment picked at random among those with room (Mooncake's
      default ``allocation_strategy = random``); a key present or in flight gets None (not stored twice);
      no room anywhere: the put fails (``NO_SPACE``, -1);
    * eviction: when a put would take the pool past ``high_watermark`` of its capacity, the master evicts
      ``eviction_ratio`` of its objects, those whose lease ended longest ago first (here: least recently
      leased or stored); an object read in the last ``lease_s`` (its read lease) is not evicted;
    * ``put_end`` makes the object visible (complete); ``put_revoke`` drops an unfinished put.
    """

    def __init__(self, segments: int, capacity_bytes: int, chunk_bytes: int, *, high_watermark: float,
                 eviction_ratio: float, lease_s: float, seed: int = 0):
        self.segments, self.chunk_bytes = segments, chunk_bytes
        self.seg_cap = capacity_bytes // segments // chunk_bytes
        if self.seg_cap < 1:
            raise ValueError(f"mooncake.capacity = {capacity_bytes} bytes over {segments} segments holds no "
                             f"chunk of {chunk_bytes} bytes")
        self.seg_used = [0] * segments
        self.objects: OrderedDict = OrderedDict()  # complete: key -> segment, least recently leased/stored first
        self.pending: dict = {}                     # key -> segment, put_start .. put_end
        self.lease_until: dict = {}
        self.high_watermark, self.eviction_ratio, self.lease_ns = high_watermark, eviction_ratio, lease_s * NS
        self.rng = random.Random(seed)
        self.counters = dict.fromkeys(("puts", "put_ends", "put_no_space", "revoked", "evictions",
                                       "eviction_rounds"), 0)

    @property
    def capacity_chunks(self) -> int:
        return self.seg_cap * self.segments

    def where(self, key) -> int | None:
        return self.objects.get(key)

    def lease(self, key, now: float) -> None:
        if key in self.objects:
            self.lease_until[key] = now + self.lease_ns
            self.objects.move_to_end(key)

    def put_start(self, key, now: float) -> int | None:
        if key in self.objects or key in self.pending:
            return None
        self.counters["puts"] += 1
        if sum(self.seg_used) + 1 > self.high_watermark * self.capacity_chunks:
            self._evict(now)
        free = [i for i, used in enumerate(self.seg_used) if used < self.seg_cap]
        if not free:
            self.counters["put_no_space"] += 1
            return -1
        seg = free[self.rng.randrange(len(free))] if len(free) > 1 else free[0]
        self.seg_used[seg] += 1
        self.pending[key] = seg
        return seg

    def put_end(self, key) -> bool:
        seg = self.pending.pop(key, None)
        if seg is None:
            return False
        self.objects[key] = seg
        self.counters["put_ends"] += 1
        return True

    def put_revoke(self, key) -> None:
        seg = self.pending.pop(key, None)
        if seg is not None:
            self.seg_used[seg] -= 1
            self.counters["revoked"] += 1

    def _evict(self, now: float) -> None:
        target = max(1, math.ceil(self.eviction_ratio * len(self.objects)))
        victims = []
        for key in self.objects:
            if len(victims) >= target:
                break
            if self.lease_until.get(key, 0.0) <= now:
                victims.append(key)
        for key in victims:
            seg = self.objects.pop(key)
            self.lease_until.pop(key, None)
            self.seg_used[seg] -= 1
        self.counters["evictions"] += len(victims)
        self.counters["eviction_rounds"] += 1


class MooncakeTier(RemoteTier):
    """LMCache's Mooncake backend on one prefill node (``host``) over the shared ``MooncakePool``: chunks of
    ``chunk_tokens`` tokens, a prefix reusable only as an unbroken chain of complete objects from chunk 0.

    * lookup: the chain beyond the GPU hit; its objects get a read lease (no eviction meanwhile);
    * load: per chunk, in order: a slot of this node's transfer buffer (``host.staging``: Mooncake's
      registered local buffer; waits for room), the RDMA read from the segment's node (its port's tx and
      this node's rx; a chunk in this node's own segment is a local copy), then PCIe to the GPU, the slot
      freed when it lands. Reads are issued back to back (a batched get). A chunk not in by the load
      timeout, or evicted since the lookup, ends the load: it and the rest are recomputed;
    * store (``wait_for_save``): for each new chunk, ``put_start`` (a segment), then a transfer-buffer
      slot -- the worker waits for one (back-pressure on the step) at most until the insert's deadline,
      ``insert_timeout_s`` after the store began -- the copy out of the GPU into it, then the RDMA write
      to the segment's node, asynchronous: ``put_end`` and the slot freed when it lands. An insert that
      gets no slot, or whose write lands after its deadline, is dropped (``put_revoke``): that chunk is
      missing, and the prefix chain of its conversation breaks there until a later turn stores it.
    """

    name = "mooncake-dram"

    def __init__(self, env: Env, host: Host, block_bytes: int, tokens_per_block: int, chunk_tokens: int,
                 pool: MooncakePool, hosts: list, *, timeout_s: float, insert_timeout_s: float,
                 peer: "MooncakeTier | None" = None):
        super().__init__(env, host, block_bytes)
        self.per_chunk = blocks_per_chunk(chunk_tokens, tokens_per_block)
        self.chunk_bytes = self.per_chunk * block_bytes
        if pool.chunk_bytes != self.chunk_bytes:
            raise ValueError("the pool's objects and this tier's chunks differ in size")
        self.pool, self.hosts = pool, hosts
        self.timeout_ns, self.insert_timeout_ns = timeout_s * NS, insert_timeout_s * NS
        self._stores: dict[str, list] = {}
        self.counters = peer.counters if peer is not None else dict.fromkeys(("loaded_chunks", "load_timeouts", "load_evicted", "inserts", "inserted",
                                       "insert_buffer_timeouts", "insert_late", "insert_no_space"), 0)

    def _ckey(self, req, c: int) -> tuple[int, int]:
        return chunk_key(req, c, self.per_chunk)

    def _nic(self, seg: int):
        return self.hosts[seg].kv_nic

    def _read_arrival(self, seg: int, now: float, nbytes: int) -> float:
        if seg == self.host.index:
            return now  # this node's own segment: a local copy
        return rdma(self._nic(seg), self.host.kv_nic, now, nbytes)

    def _write_arrival(self, seg: int, now: float, nbytes: int) -> float:
        if seg == self.host.index:
            return now
        return rdma(self.host.kv_nic, self._nic(seg), now, nbytes)

    def lookup(self, req) -> int:
        c, limit = 0, req.lookup_blocks
        while c * self.per_chunk < limit and self._ckey(req, c) in self.pool.objects:
            c += 1
        n = max(0, min(c * self.per_chunk, limit) - req.gpu_hit)
        if n:
            now = self.env.now
            for c in range(req.gpu_hit // self.per_chunk, (req.gpu_hit + n - 1) // self.per_chunk + 1):
                self.pool.lease(self._ckey(req, c), now)
        return n

    def load(self, req, n: int):
        if n <= 0:
            return 0
        env, staging, cb, P = self.env, self.host.staging, self.chunk_bytes, self.per_chunk
        deadline = env.now + self.timeout_ns
        first, end = req.gpu_hit, req.gpu_hit + n
        done, last = 0, env.now
        for c in range(first // P, (end - 1) // P + 1):
            ok = yield from staging.take(cb, deadline)
            if not ok:
                self.counters["load_timeouts"] += 1
                req.timeouts += 1
                break
            seg = self.pool.where(self._ckey(req, c))
            if seg is None:  # evicted since the lookup (its lease ran out)
                staging.give(cb)
                self.counters["load_evicted"] += 1
                break
            arrive = self._read_arrival(seg, env.now, cb)
            if arrive > deadline:  # not in within the timeout: the worker waited for it, then recomputes
                env.call_at(arrive, lambda: staging.give(cb))
                last = max(last, deadline)
                self.counters["load_timeouts"] += 1
                req.timeouts += 1
                break
            h2d = self.host.h2d.transfer(arrive, cb)
            env.call_at(h2d, lambda: staging.give(cb))
            last = max(last, h2d)
            done += min(end, (c + 1) * P) - max(first, c * P)
            req.read_bytes += cb
            self.counters["loaded_chunks"] += 1
        if last > env.now:
            yield last
        return done

    def reserve_store(self, req) -> None:
        now = self.env.now
        todo = []
        for c in range(req.full_blocks // self.per_chunk):
            key = self._ckey(req, c)
            seg = self.pool.put_start(key, now)
            if seg is None:
                continue  # stored already (or in flight)
            self.counters["inserts"] += 1
            if seg < 0:
                self.counters["insert_no_space"] += 1
                req.skipped_inserts += 1
                continue
            todo.append((key, seg))
        if todo:
            self._stores[req.rid] = todo

    def store(self, req):
        todo = self._stores.pop(req.rid, None)
        if not todo:
            return
        env, staging, cb, pool = self.env, self.host.staging, self.chunk_bytes, self.pool
        deadline = env.now + self.insert_timeout_ns
        for i, (key, seg) in enumerate(todo):
            ok = yield from staging.take(cb, deadline)
            if not ok:  # the transfer buffer stayed full past the insert timeout: this and the rest are dropped
                for k, _ in todo[i:]:
                    pool.put_revoke(k)
                self.counters["insert_buffer_timeouts"] += len(todo) - i
                req.skipped_inserts += len(todo) - i
                return
            copied = self.host.d2h.transfer(env.now, cb)  # out of the GPU into the slot (wait_for_save)
            if copied > env.now:
                yield copied
            landed = self._write_arrival(seg, env.now, cb)
            env.call_at(landed, lambda: staging.give(cb))
            if landed > deadline:  # the put misses its timeout: dropped, the chain breaks at this chunk
                env.call_at(deadline, lambda k=key: pool.put_revoke(k))
                self.counters["insert_late"] += 1
                req.skipped_inserts += 1
            else:
                env.call_at(landed, lambda k=key: pool.put_end(k))
                self.counters["inserted"] += 1
                req.write_bytes += cb

    def describe(self) -> dict:
        return {"tier": self.name, "chunk_blocks": self.per_chunk, "capacity_chunks": self.pool.capacity_chunks,
                "chunks": len(self.pool.objects), "segments_used": list(self.pool.seg_used),
                **self.pool.counters, **self.counters}
