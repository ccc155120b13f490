"""Remote KV tiers behind one interface, one class each.

A worker's step calls, for each request (``worker.py``; the order of vLLM's KV connector v1):

* ``lookup(req)`` when the scheduler first considers it: how many blocks beyond the GPU prefix
  cache hit (``req.gpu_hit``) the tier can load, as one unbroken run (prefetch hints go out now);
* ``load(req, n)`` in the step that schedules it, before the forward (``start_load_kv``): a
  process that returns how many of the ``n`` blocks it loaded (a prefix: a block that fails or times
  out is recomputed with the rest);
* ``reserve_store(req)`` before the forward of the step that completes its prefill (``_reserve``:
  what will be stored; the device-to-host copies run during the forward, as ``save_kv_layer``);
* ``store(req)`` after that forward (``wait_for_save``): a process; refused blocks are skipped;
* ``finish(req)`` when it leaves the engine.

Each tier counts per request what it moved (``req.read_bytes``, ``req.write_bytes``,
``req.skipped_inserts``, ``req.timeouts``); the report sums them per turn.

Tiers: ``recompute`` (no reuse at all, GPU prefix caching off), ``gpu-prefix`` (vLLM's prefix cache
only), ``lmcache-local`` (per-worker CPU DRAM, LRU, 256-token chunks, a prefix reusable only as an
unbroken chain from the first chunk), ``mooncake-dram`` (a DRAM pool over RDMA, one segment per
prefill node, Mooncake Store's master rules, per-node transfer buffers with insert timeouts),
``mooncake-nvmeof`` (Mooncake's rules over a private file-system volume per prefill node on NVMe-oF SSDs),
``lmcache-redis`` (LMCache's remote backend, one Redis over TCP, stores refused at ``maxmemory``),
``lmcache-local+redis`` (LMCache's local DRAM first, then that Redis),
``hymcache`` (the runtime's Master and KV Manager in process, the emulator's Controller as the
device, in virtual time), ``hymcache-noprefetch`` (the same device policy and Master, no KV Manager
window: demand reads in order, as ``chm replay``'s variant of that name) and ``cmm-h`` (the same Master
over a stock CMM-H: the Controller with policy ``lru``, demand reads, no prefetch window).

In the PD topology (``topology.py``) every prefill node has its own tier object (its host: PCIe,
staging/transfer buffer, its NIC ports) over one shared backend (the Mooncake pool; the HyMCache
Master, KV Manager and device), built with ``peer=`` the first node's tier.
"""

from __future__ import annotations

import errno
import math
import random
import struct
from collections import OrderedDict, deque

from driver.errors import ChmError, WriteBufferFull
from emulator.timing import Pipe

from .events import Env

TIERS = ("recompute", "gpu-prefix", "lmcache-local", "mooncake-dram", "mooncake-nvmeof", "lmcache-redis",
         "lmcache-local+redis", "hymcache", "hymcache-noprefetch", "cmm-h")
NS = 1e9


def blocks_per_chunk(chunk_tokens: int, tokens_per_block: int) -> int:
    """KV blocks in one chunk of a chunked tier (LMCache's, Mooncake's objects)."""
    if chunk_tokens % tokens_per_block:
        raise ValueError(f"lmcache.chunk_tokens = {chunk_tokens} must be a multiple of model.tokens_per_block "
                         f"= {tokens_per_block}")
    return chunk_tokens // tokens_per_block


def chunk_key(req, c: int, per_chunk: int) -> tuple[int, int]:
    """Chunk ``c``'s key in a chunked tier: (-1, c) inside the shared prefix, else (conversation, c); a trace's
    request: (-2, the key of the chunk's first block), which names the chunk's prefix because a chunk lies
    inside one hash block (``config.check_settings``)."""
    if req.keys:
        return -2, req.keys[c * per_chunk]
    return (-1 if (c + 1) * per_chunk <= req.shared_blocks else req.conv), c


class Staging:
    """The host's staging buffer (bytes): transfer space between the remote tier and the GPU.

    ``take`` waits for room (back-pressure, first come first served), until an optional deadline: past
    it, it gives up (False) and leaves the queue. The HyMCache connector's stores take what is free now
    and skip the rest (transfer space, not a cache); Mooncake's inserts wait up to their timeout."""

    def __init__(self, env: Env, capacity: int):
        self.env, self.capacity, self.used, self.peak = env, capacity, 0, 0
        self.waiters: deque = deque()
        self.waits = 0
        self.timeouts = 0

    def free(self) -> int:
        return self.capacity - self.used

    def take(self, n: int, deadline: float = math.inf):
        """Process: wait until ``n`` bytes are free, then hold them (True); False if ``deadline`` passes first."""
        if n > self.capacity:
            raise ValueError(f"a block of {n} bytes can never fit the staging buffer of {self.capacity} bytes")
        if self.waiters or self.used + n > self.capacity:
            if deadline <= self.env.now:
                self.timeouts += 1
                return False
            self.waits += 1
            ev = self.env.event()
            w = (n, ev)
            self.waiters.append(w)
            if deadline < math.inf:
                self.env.call_at(deadline, lambda: self._expire(w))
            return (yield ev)  # True: give() has taken the bytes for us
        self.hold(n)
        return True

    def _expire(self, w) -> None:
        if w[1].fired:
            return
        self.waiters.remove(w)
        self.timeouts += 1
        w[1].succeed(False)
        self._grant()  # a smaller waiter behind it may fit now

    def hold(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self.waiters and self.waiters[0][0] <= self.capacity - self.used:
            m, ev = self.waiters.popleft()
            self.hold(m)  # taken now, on the waiter's behalf: nobody can overtake it before it resumes
            ev.succeed(True)


class Nic:
    """One RDMA port of a node: a pipe per direction (full duplex), bandwidth in Gbit/s."""

    def __init__(self, name: str, gbps: float, latency_ns: float):
        self.gbps = gbps
        self.rx = Pipe(f"{name}.rx", latency_ns, gbps / 8)
        self.tx = Pipe(f"{name}.tx", latency_ns, gbps / 8)


def rdma(src: "Nic | None", dst: "Nic | None", now: float, nbytes: int) -> float:
    """Arrival of ``nbytes`` sent at ``now`` out of ``src``'s port into ``dst``'s (either may be absent: a link
    modelled elsewhere, or none): both ports are reserved from ``now``; the slower one decides (cut-through)."""
    t = now
    if src is not None:
        t = max(t, src.tx.transfer(now, nbytes))
    if dst is not None:
        t = max(t, dst.rx.transfer(now, nbytes))
    return t


class Host:
    """One serving node's host side: the PCIe link to its GPU (one pipe per direction), its staging buffer and,
    in the PD topology, its NIC ports: ``kv_nic`` (the remote KV tier's traffic) and ``pd_nic`` (P->D)."""

    def __init__(self, env: Env, pcie_gbps: float, pcie_latency_ns: float, staging_bytes: int, *, index: int = 0,
                 kv_nic: Nic | None = None, pd_nic: Nic | None = None):
        self.index = index
        self.h2d = Pipe("pcie.h2d", pcie_latency_ns, pcie_gbps)
        self.d2h = Pipe("pcie.d2h", pcie_latency_ns, pcie_gbps)
        self.staging = Staging(env, staging_bytes)
        self.kv_nic, self.pd_nic = kv_nic, pd_nic


class RemoteTier:
    """The interface (module docstring). The base class is the ``gpu-prefix`` tier: nothing remote."""

    name = "gpu-prefix"
    gpu_prefix_caching = True

    def __init__(self, env: Env, host: Host, block_bytes: int):
        self.env, self.host, self.block_bytes = env, host, block_bytes

    def lookup(self, req) -> int:
        return 0

    def load(self, req, n: int):
        return n
        yield  # a process

    def reserve_store(self, req) -> None:
        pass

    def store(self, req):
        return None
        yield

    def finish(self, req) -> None:
        pass

    def describe(self) -> dict:
        return {"tier": self.name}


class GpuPrefixTier(RemoteTier):
    name = "gpu-prefix"


class RecomputeTier(RemoteTier):
    name = "recompute"
    gpu_prefix_caching = False


# ---------------------------------------------------------------------------------------- LMCache, local DRAM
class _CopiedOffGpu:
    """A chunked host-side tier's stores: the chunks a request will store are copied off the GPU during its
    forward (``reserve_store``, as ``save_kv_layer``); ``store`` waits for the last copy to land."""

    def _copy_off_gpu(self, req, new: list) -> None:
        if new:
            arrivals = self.host.d2h.stream([self.env.now] * len(new), [self.chunk_bytes] * len(new))
            self._pending[req.rid] = (new, arrivals[-1])

    def _copied(self, req):
        """Process: the chunks ``req`` reserved, once they are in host memory ([] if none)."""
        pending = self._pending.pop(req.rid, None)
        if pending is None:
            return []
        new, done = pending
        if done > self.env.now:
            yield done
        return new


class LMCacheLocal(_CopiedOffGpu, RemoteTier):
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


# ---------------------------------------------------------------------------------------- Mooncake, DRAM pool
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


# ---------------------------------------------------------------------------------------- Mooncake, NVMe-oF
class FsPath:
    """One prefill node's file-system path to its private volume (XFS on an LVM volume of the storage node's
    RAID, over NVMe-oF): one pipe, shared by reads and writes, at the file system's sequential ceiling
    ``gb_per_s`` (GB/s); every chunk is one file operation, which occupies the path for ``op_ns`` of software
    time (open / extent lookup / close) on top of its bytes."""

    def __init__(self, name: str, gb_per_s: float, op_ns: float):
        self.pipe = Pipe(name, 0.0, gb_per_s)
        self.op_bytes = int(op_ns * gb_per_s)  # op_ns of occupancy, as bytes at the path's rate (bytes/ns = GB/s)
        self.ops = 0

    def transfer(self, now: float, nbytes: int) -> float:
        self.ops += 1
        return self.pipe.transfer(now, nbytes + self.op_bytes)


class MooncakeNvmeofTier(MooncakeTier):
    """Mooncake over NVMe-oF: Mooncake's chunked objects and its load / insert rules (``MooncakeTier``: transfer
    buffer, load timeout -> the rest recomputed, insert timeout -> dropped), but each prefill node's objects
    live in its own volume (a one-segment ``MooncakePool`` of ``capacity / prefill nodes``: nothing is shared
    between workers), and every read or write crosses the node's ``FsPath`` (the file system's ceiling and
    per-operation cost), the storage node's NIC (``storage_nic``, shared by all nodes) and this node's KV port;
    the slowest decides."""

    name = "mooncake-nvmeof"

    def __init__(self, env: Env, host: Host, block_bytes: int, tokens_per_block: int, chunk_tokens: int,
                 volume: MooncakePool, fs: FsPath, storage_nic: Nic | None, *, timeout_s: float,
                 insert_timeout_s: float, peer: "MooncakeNvmeofTier | None" = None):
        super().__init__(env, host, block_bytes, tokens_per_block, chunk_tokens, volume, [host], timeout_s=timeout_s,
                         insert_timeout_s=insert_timeout_s, peer=peer)
        self.fs, self.storage_nic = fs, storage_nic
        self.nodes = peer.nodes if peer is not None else []
        self.nodes.append(self)

    def _read_arrival(self, seg: int, now: float, nbytes: int) -> float:
        return max(self.fs.transfer(now, nbytes), rdma(self.storage_nic, self.host.kv_nic, now, nbytes))

    def _write_arrival(self, seg: int, now: float, nbytes: int) -> float:
        return max(self.fs.transfer(now, nbytes), rdma(self.host.kv_nic, self.storage_nic, now, nbytes))

    def describe(self) -> dict:
        pools = [t.pool for t in self.nodes]
        counts = {k: sum(p.counters[k] for p in pools) for k in pools[0].counters}
        return {"tier": self.name, "chunk_blocks": self.per_chunk,
                "capacity_chunks": sum(p.capacity_chunks for p in pools), "chunks": sum(len(p.objects) for p in pools),
                "fs_ops": sum(t.fs.ops for t in self.nodes), **counts, **self.counters}


# ---------------------------------------------------------------------------------------- LMCache, Redis
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


class LMCacheRedis(_CopiedOffGpu, RemoteTier):
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


# ---------------------------------------------------------------------------------------- HyMCache
class ControllerDevice:
    """What the KV Manager calls on a libchm device handle, served by the emulator's ``Controller`` in
    virtual time (data off). Every call happens at the simulation's now (``clock``), after the device's
    background work due by then (``run_until``, as the replayer does). ``wait`` records when the host
    learns the block is staged (``ready_ns``): the Manager only needs it to be staged, the simulation
    needs the time."""

    def __init__(self, ctl, env: Env):
        self.ctl, self.env = ctl, env
        self.ready_ns: dict[int, float] = {}
        self.node = ""

    def _now(self) -> float:
        self.ctl.run_until(self.env.now)
        return self.env.now

    def info(self) -> dict:
        return {"capacity_bytes": self.ctl.capacity, "device_epoch": self.ctl.device_epoch, "server_pid": 0,
                "page_size": self.ctl.page, "prefetch_limit_pages": self.ctl.prefetch_window_pages}

    def prefetch(self, offset: int, length: int) -> int:
        return self.ctl.prefetch(offset, length, self._now()).handle

    def wait(self, handle: int) -> None:
        self.ready_ns[handle] = self.ctl.wait(handle, self._now())

    def release(self, handle: int) -> None:
        self.ready_ns.pop(handle, None)
        self.ctl.release(handle, self._now())

    def close(self) -> None:
        pass


def sim_manager(node: int, devices: list[ControllerDevice], master, clock, **kwargs):
    """The runtime's ``KVManager`` (its window, EBUSY queueing and release logic unchanged) over
    ``ControllerDevice`` handles, which it opens in device order in place of libchm devices."""
    from host_runtime.hymcache.manager import KVManager

    unopened = list(devices)

    def open_device(path: str) -> ControllerDevice:
        dev = unopened.pop(0)
        dev.node = path
        return dev

    return KVManager(node, [f"sim-node{node}-dev{i}" for i in range(len(devices))], master, clock,
                     open_device=open_device, **kwargs)


class HyMCacheTier(RemoteTier):
    """The runtime's Master and KV Manager in process, over one emulated device (``Controller``, data off),
    all on the simulation's clock.

    * lookup: the Manager's ``hint`` (it resolves the keys beyond the GPU hit against the Master in
      batches of 32, in order, and starts staging them, a window per request);
    * load: per block, in order (the connector's ``_load``): a staging-buffer slot, the Manager's
      ``acquire`` (not staged yet and queued behind a window: ask again after a pause, as the
      ManagerClient polls), the device read over its host link (the Controller's RDMA pipe), the
      Manager's ``release`` (the window moves on), the copy to the GPU over PCIe; a block not staged
      by ``timeout`` after the load began is a load error: it and the rest are recomputed;
    * store: ``put_start`` for the full prompt blocks (the Master answers None for those stored), the
      staging room now (what does not fit is skipped), the copies during the forward, then one
      device write per block, in order; a write the device refuses (write buffer full) is skipped,
      counted and revoked, so the next turn offers it again; one ``put_end``.

    ``prefetch=False`` (the ``hymcache-noprefetch`` tier, policy ``hymcache``; the ``cmm-h`` tier, policy
    ``lru``): no Manager window; demand reads in order, each block looked up in the Master at the load.
    """

    name = "hymcache"

    def __init__(self, env: Env, host: Host, block_bytes: int, cfg, *, window_bytes: int, timeout_s: float,
                 prefetch: bool = True, name: str | None = None, peer: "HyMCacheTier | None" = None):
        from emulator.controller import Controller
        from host_runtime.hymcache.clock import ManualClock
        from host_runtime.hymcache.manager import FIRST_POLL_S
        from host_runtime.hymcache.master import Master

        super().__init__(env, host, block_bytes)
        if name:
            self.name = name
        self.timeout_ns = timeout_s * NS
        if peer is not None:  # another prefill node of the same deployment: one Master, Manager and device
            for a in self._SHARED:
                setattr(self, a, getattr(peer, a))
            return
        self.cfg, self.prefetch = cfg, prefetch
        self.ctl = Controller(cfg, None)
        self.dev = ControllerDevice(self.ctl, env)
        self.clock = ManualClock()
        self.master = Master(self.clock)
        self.manager = sim_manager(0, [self.dev], self.master, self.clock, window_bytes=window_bytes)
        self.poll_ns = FIRST_POLL_S * NS
        self.poll_max_ns = 1e-3 * NS  # ManagerClient's default poll_s
        self.refusal_ns = 2 * cfg.host_link.latency_ns  # a refused write costs one round trip
        self._keys: dict[int, list[bytes]] = {}
        self._hinted: set[str] = set()  # requests the Manager has a hint of
        self._stores: dict[str, tuple[list, list[float]]] = {}
        self.counters = dict.fromkeys(("hinted_blocks", "loaded_blocks", "timeouts", "load_errors", "put_blocks",
                                       "written_blocks", "refused_writes", "staging_skips", "put_no_space"), 0)

    _SHARED = ("cfg", "prefetch", "ctl", "dev", "clock", "master", "manager", "poll_ns", "poll_max_ns", "refusal_ns",
               "_keys", "_hinted", "_stores", "counters", "name")

    def _sync(self) -> float:
        self.clock.t = self.env.now / NS  # the simulation owns this clock
        return self.env.now

    def keys(self, conv: int, n: int) -> list[bytes]:
        """The Master's 16-byte keys of a conversation's first ``n`` blocks (a block's key names its whole
        prefix: the conversation and its position)."""
        ks = self._keys.setdefault(conv, [])
        while len(ks) < n:
            ks.append(struct.pack("<QQ", conv + 1, len(ks)))
        return ks[:n]

    def req_keys(self, req, n: int) -> list[bytes]:
        """A request's first ``n`` block keys: the shared prefix's (owner -1) then its conversation's; a trace's
        request: its own keys (first word all ones: no conversation's)."""
        if req.keys:
            return [struct.pack("<QQ", (1 << 64) - 1, k) for k in req.keys[:n]]
        shared = min(n, req.shared_blocks)
        if not shared:
            return self.keys(req.conv, n)
        return self.keys(-1, shared) + self.keys(req.conv, n)[shared:]

    def lookup(self, req) -> int:
        first, last = req.gpu_hit, req.lookup_blocks
        if last <= first:
            return 0
        keys = self.req_keys(req, last)[first:]
        self._sync()
        if self.prefetch:
            n = self.manager.hint(req.rid, keys)
            self._hinted.add(req.rid)
        else:
            n = len(self.master.lookup(keys))
        self.counters["hinted_blocks"] += n
        return n

    def load(self, req, n: int):
        if n <= 0:
            return 0
        env, staging, B = self.env, self.host.staging, self.block_bytes
        start = env.now
        deadline = start + self.timeout_ns
        keys = self.req_keys(req, req.gpu_hit + n)[req.gpu_hit:]
        locs = None if self.prefetch else self.master.lookup(keys)  # demand reads: where each block is
        done, last = 0, start
        for i, key in enumerate(keys):
            yield from staging.take(B)
            ok = yield from (self._acquire(req, key, keys[i:], deadline) if self.prefetch else self._demand(req, locs, i))
            if not ok:
                staging.give(B)
                break
            arrive = self.host.h2d.transfer(env.now, B)
            env.call_at(arrive, lambda: staging.give(B))
            last = max(last, arrive)
            done += 1
            req.read_bytes += B
        self.finish(req)  # the Manager cancels what it still stages for the request
        self.counters["loaded_blocks"] += done
        if last > env.now:
            yield last
        return done

    def _acquire(self, req, key: bytes, rest: list[bytes], deadline: float):
        """Process: one block through the Manager; True once read into the staging buffer."""
        env, manager = self.env, self.manager
        pause, rehinted = self.poll_ns, False
        while True:
            self._sync()
            try:
                token = manager.acquire(req.rid, key, 0.0)
                break
            except ChmError as exc:
                if exc.errno == errno.ETIMEDOUT and env.now < deadline:  # queued behind a window or EBUSY
                    yield min(env.now + pause, deadline)
                    pause = min(2 * pause, self.poll_max_ns)
                    continue
                if exc.errno == errno.ENOENT and not rehinted:  # the hint was cancelled: hint the rest again
                    rehinted = True
                    manager.hint(req.rid, rest)
                    continue
                self._fail(req, exc.errno == errno.ETIMEDOUT)
                return False
        ready = self.dev.ready_ns.get(token.handle, env.now)
        if ready > deadline:  # not staged within the timeout: the worker waited for it, then recomputes
            yield max(deadline, env.now)
            self._sync()
            manager.release(req.rid, key)
            self._fail(req, True)
            return False
        if ready > env.now:
            yield ready
        finish = self.ctl.read(token.offset, token.length, self.dev._now()).finish
        finish = max(finish, rdma(None, self.host.kv_nic, env.now, token.length))  # this node's port
        yield finish
        self._sync()
        manager.release(req.rid, key)
        return True

    def _demand(self, req, locs, i: int):
        if i >= len(locs):  # evicted from the Master since the lookup
            self._fail(req, False)
            return False
        loc = locs[i]
        finish = self.ctl.read(loc.offset, loc.length, self.dev._now()).finish
        finish = max(finish, rdma(None, self.host.kv_nic, self.env.now, loc.length))
        if finish > self.env.now + self.timeout_ns:
            yield self.env.now + self.timeout_ns
            self._fail(req, True)
            return False
        yield finish
        return True

    def _fail(self, req, timeout: bool) -> None:
        self.counters["timeouts" if timeout else "load_errors"] += 1
        req.timeouts += timeout

    def finish(self, req) -> None:
        """The connector's ``_finish_on``: after the load, or at once when nothing is loaded (a hint with no
        hits, or a request the GPU prefix cache served) -- the Manager forgets the request."""
        if req.rid in self._hinted:
            self._hinted.discard(req.rid)
            self._sync()
            self.manager.finish(req.rid)

    def reserve_store(self, req) -> None:
        keys = self.req_keys(req, req.full_blocks)
        if not keys:
            return
        self._sync()
        try:
            locs = self.master.put_start(req.rid, keys, [self.block_bytes] * len(keys))
        except ChmError as exc:  # ENOSPC: nothing evictable (all leased); offered again next turn
            if exc.errno != errno.ENOSPC:
                raise
            self.counters["put_no_space"] += 1
            return
        todo = [loc for loc in locs if loc is not None]
        if not todo:
            return
        self.counters["put_blocks"] += len(todo)
        room = max(0, self.host.staging.free() // self.block_bytes)
        if room < len(todo):
            skipped = todo[room:]
            todo = todo[:room]
            self.master.put_revoke([loc.key for loc in skipped])
            self.counters["staging_skips"] += len(skipped)
            req.skipped_inserts += len(skipped)
        if not todo:
            return
        self.host.staging.hold(len(todo) * self.block_bytes)
        arrivals = self.host.d2h.stream([self.env.now] * len(todo), [self.block_bytes] * len(todo))
        self._stores[req.rid] = (todo, arrivals)

    def store(self, req):
        pending = self._stores.pop(req.rid, None)
        if pending is None:
            return
        todo, arrivals = pending
        env, B = self.env, self.block_bytes
        written, refused = [], []
        for loc, arrived in zip(todo, arrivals):
            if arrived > env.now:
                yield arrived
            try:
                finish = self.ctl.write(loc.offset, None, loc.length, self.dev._now()).finish
            except WriteBufferFull:
                refused.append(loc.key)
                finish = env.now + self.refusal_ns
            else:
                written.append(loc.key)
                req.write_bytes += loc.length
                finish = max(finish, rdma(self.host.kv_nic, None, env.now, loc.length))  # this node's port
            yield finish
            self.host.staging.give(B)
        self._sync()
        if refused:
            self.master.put_revoke(refused)
            self.counters["refused_writes"] += len(refused)
            req.skipped_inserts += len(refused)
        if written:
            self.master.put_end(written, [0] * len(written))
            self.counters["written_blocks"] += len(written)

    def describe(self) -> dict:
        snap = self.ctl.snapshot()
        m = self.master.stats()
        return {"tier": self.name, "device_policy": self.cfg.policy.name, "dram_bytes": self.cfg.dram.size_bytes,
                "write_buffer_bytes": self.cfg.write_buffer_frames * self.cfg.device.page_size_bytes,
                **self.counters,
                "device": {k: snap[k] for k in ("page_hits", "page_misses", "prefetch_staged_pages",
                                                "prefetch_resident_pages", "refused_writes", "flushed_pages",
                                                "slowed_reads", "ssd_read_bytes", "ssd_write_bytes")},
                "master": {k: m[k] for k in ("blocks", "evictions", "revoked_blocks", "registered_blocks",
                                             "lookup_hits", "put_no_space")},
                "manager": {k: self.manager.counters[k] for k in ("hints", "hint_hits", "prefetches", "ebusy",
                                                                  "releases", "finished",
                                                                  "num_timeouts_recompute")}}
