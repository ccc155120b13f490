"""Replay a workload on the emulator's own controller, in virtual time.

The controller runs with ``emulation.data = false``: no bytes move, only
frame state and modelled time. Concurrency is virtual: every stream is a
generator that performs one controller operation at its current virtual time
and yields the time its next operation starts; a heap always resumes the
stream with the earliest time, so the shared controller and timing model see
operations in time order, as the device would. Before each operation the
device's own background work that fell due meanwhile (flushes) runs, each at
its own time (``Controller.run_until``): virtual time jumps from event to
event, so idle spans cost nothing and replay cost follows the accesses.

How a request uses the device (its ``keys`` are the KV blocks of its context):

* the host side is the HyMCache runtime's Master (host_runtime/hymcache/master.py): its decisions, made by
  ``HOST_INDEX``, the native table of native_master.py (hymcache/native/mt_*.c), which
  tests/host_runtime/hymcache/test_native_master.py pins call for call to the Python Master (a whole replay
  through each gives the same calls and report). In process on the replay's virtual clock, with one node of
  one device (the Controller's capacity): it knows which
  blocks are stored and where (``master_key``: a replay key as the Master's 16-byte key). A request looks
  up its chain (the longest stored, complete prefix: a block is useless without its predecessors; the
  blocks found get read leases) and reads it; it asks ``put_start`` for the rest in one batch (the
  Master's placement gives each new block its address; None for a block stored or in flight), writes
  those, then ``put_end``s the written ones and ``put_revoke``s the refused ones. The Master evicts by
  its own rule (the least recently used complete, unleased blocks, from its high watermark down to its
  low one: ``master_options``) and expires leases and unfinished puts on the virtual clock: a read lease
  keeps a block from eviction for ``lease_s`` of virtual time (renewed up to ``lease_max_s``), so in a
  trace compressed to less than that, blocks read stay unevictable for the rest of the run and a put the
  Master cannot make room for fails whole (ENOSPC: not written, ``master.no_space_puts``); a put not
  ended within ``put_timeout_s`` is revoked (``master.put_timeouts``);
* ``lru``: demand reads of each block in prefix order, then writes;
* ``hymcache``: prefix blocks are prefetched in consumption order with at most
  ``window_blocks`` in flight per request (the KV Manager's window rule: ``window_blocks``;
  EBUSY from the device-wide window:
  retry after the next release, or read on demand if the request holds none);
  each is waited for, read, released. New blocks are offered to the write
  buffer and skipped (counted, not stored) when refused;
* ``hymcache-noprefetch``: hymcache's DRAM split and write path, demand reads.

The variant names the request behaviour and a default device DRAM policy (``VARIANTS``); the device
policy can be chosen separately (``replay_config(..., device_policy=)``, ``chm replay --device-policy``).

Sequential replay (``sequential=True``): requests run one after another in workload order (a trace's
file order), each starting when the previous one has finished (or at its own time, if later); one block
is in flight at a time (the prefetch window is one block) and every write is flushed before the next
access, so no frame is pinned when a victim is chosen. The DRAM then sees exactly the page sequence of the
requests, and its misses (read misses plus write allocations) equal a cache simulator's on that sequence
(tests/host_runtime/test_replay_oracle.py checks them against libCacheSim).

The cost of what was not served (every row and the total; prefill.py models the time). A block the device
does not serve is not free: the GPU recomputes its KV. Per request, when it looks up its chain:

* a position of its ``keys`` is *reusable* if its key was in the context of a request that looked up
  before it (or was populated): an earlier turn, an earlier request of the trace, a shared prefix. A
  block no earlier request had (this turn's new blocks) is computed whatever the device does and is
  never counted;
* ``recomputed_blocks`` = reusable positions minus the blocks read from the device (the read positions are
  a prefix of the reusable ones: what is stored was written by an earlier request). Everything the replay
  leaves unread counts: an earlier write the device refused, a block the Master evicted to make room (or
  could not place: ENOSPC), a block another request is still writing (not visible before its ``put_end``),
  a block stored after a gap in the chain (not read: the replay, like a prefix cache, reads only the
  unbroken prefix);
* ``recompute_s`` = the modelled prefill time of those blocks, each at its position in the context (its
  tokens attend to the whole prefix before it), on the GPU profile's FLOP/s; charged to the row of the
  request's lookup;
* ``read_s`` = the row's device read time: for a turn, from the turn's start to its last block read
  (the device delivering every prefix it serves); for a time window, first to last read in it;
* ``serve_s`` = ``read_s + recompute_s``: the turn served, with recomputation after the reads (one GPU
  doing it all, no overlap with the device's reads of other requests; an upper bound where overlap is
  possible, a lower bound per GPU FLOP as prefill.py explains). The total's ``read_s`` adds the turns'.

Why this is fair between variants: the reusable set depends only on the workload's request order, not on
what a variant stored, and every variant faces the same lookups (the microbenchmark's barrier makes the
order identical; a trace's order is its timestamps). ``lru`` never refuses, so its recomputation comes only
from the Master's evictions and overlap; ``hymcache``'s also from refused writes -- its reads look fast
because it reads less, and ``serve_s`` puts the unread blocks back on the bill. The new blocks of a turn
(written, or offered and refused) cost the same GPU time under every variant and are not counted.
"""

from __future__ import annotations

import errno
import heapq
import time
from typing import Any, Mapping

from emulator.config import Config
from emulator.controller import Controller
from emulator.errors import ChmError, WriteBufferFull
from host_runtime.hymcache.clock import ManualClock
from host_runtime.hymcache.window import WINDOW_BYTES, window_blocks
from host_runtime.hymcache.checks import MAX_BATCH
from host_runtime.hymcache.native_master import NativeMaster
from host_runtime.hymcache.messages import KEY_BYTES, DeviceInfo

from .bucket import Bucket
from .native_run import NativeRun
from .prefill import PrefillModel, prefill_for_block
from .result import ReplayResult
from .traces import WINDOW_S_RANGE, Workload
from .variants import VARIANTS, replay_config, replay_label  # noqa: F401 (re-exported)

DEFAULT_WINDOW_BYTES = WINDOW_BYTES  # the KV Manager's per-request window: ~128 MB of KV (8 x 16 MB, 4 x 32 MB)
NS_PER_S = 1e9
HOST_INDEX = NativeMaster  # the Master's decisions in C (module docstring); master.Master makes the same ones


def master_key(key: int) -> bytes:
    """A workload's block key (a non-negative int) as the Master's ``KEY_BYTES``-byte key: one to one."""
    return key.to_bytes(KEY_BYTES, "little")


class Replay(NativeRun, ReplayResult):
    """One request behaviour (variant) over one workload on a fresh controller running ``cfg.policy.name``."""

    def __init__(self, cfg: Config, variant: str, workload: Workload, window_bytes: int = DEFAULT_WINDOW_BYTES,
                 bucket_ns: float = 600e9, progress: bool = True, record_ops: bool = False,
                 sequential: bool = False, prefill: PrefillModel | None = None,
                 master_options: Mapping[str, Any] | None = None, native: bool | None = None):
        self._init = (cfg, variant, workload, dict(window_bytes=window_bytes, bucket_ns=bucket_ns, progress=progress,
                                                   record_ops=record_ops, sequential=sequential, prefill=prefill,
                                                   master_options=master_options, native=native))
        if variant not in VARIANTS:
            raise ValueError(f"policy = {variant!r} is not one of {', '.join(VARIANTS)}")
        if cfg.emulation.data:
            raise ValueError("replay needs a profile with emulation.data = false (use replay_config)")
        lo, hi = WINDOW_S_RANGE
        if not lo * NS_PER_S <= bucket_ns <= hi * NS_PER_S:  # NaN too
            raise ValueError(f"window = {bucket_ns / NS_PER_S!r} s must be in [{lo:g}, {hi:g}] s")
        self.cfg, self.variant, self.workload = cfg, variant, workload
        self.sequential = sequential
        self.prefetching = VARIANTS[variant][1]
        self.ctl = Controller(cfg, None)
        page = cfg.device.page_size_bytes
        self.block_bytes = workload.block_bytes
        # a block's extent on the device: its bytes in whole pages (no two blocks share a device page)
        self.slot_bytes = slot_bytes = -(-self.block_bytes // page) * page
        if slot_bytes > cfg.capacity_bytes:
            raise ValueError(f"the device of {cfg.capacity_bytes} bytes holds no block of {slot_bytes} bytes")
        # the host side: the runtime's Master in process, on the replay's virtual clock (seconds), with one node
        # of one device; ``master_options``: its keyword arguments (lease_s, high_watermark, ...), else its defaults
        self.clock = ManualClock()
        self.master_options = dict(master_options or {})
        self.master = HOST_INDEX(self.clock, **self.master_options)
        self.master.register_node(0, "replay", [DeviceInfo(0, "replay", cfg.capacity_bytes, 0)])
        self.requests = 0  # request ids for put_start
        self.revoked = 0  # refused writes given back (put_revoke); the Master's other revocations are put timeouts
        self.no_space_puts = 0  # put_starts refused whole (ENOSPC: no room even after evicting all it may): not written
        # sequential: one block in flight, so a prefetch never pins a frame while another page is staged
        self.window_blocks = 1 if sequential else window_blocks(window_bytes, self.block_bytes)
        self.window_bytes = window_bytes
        if self.prefetching and self.window_blocks * slot_bytes > cfg.policy.prefetch_window_bytes:
            raise ValueError(f"per-request window of {self.window_blocks} blocks of {slot_bytes} bytes exceeds the "
                             f"device's policy.prefetch_window_bytes = {cfg.policy.prefetch_window_bytes}")
        self.refusal_ns = 2 * cfg.host_link.latency_ns  # a refused write costs the host one round trip
        self.bucket_ns = bucket_ns
        self.by_time = workload.bucket_by == "time"
        self.buckets: dict[Any, Bucket] = {}
        self.bucket: Bucket | None = None
        self.progress = progress
        self.ops: list[tuple[str, int, int]] | None = [] if record_ops else None
        self.peak_staged_pages = 0
        self.peak_write_buffer_pages = 0
        self.pbar = None
        # recomputation (module docstring): keys some request has looked up, and their prefill cost
        self.prefill = prefill if prefill is not None else prefill_for_block(self.block_bytes)
        self.known: set[int] = set()
        # the request loop in C (native_replay.py) where it can run (None: wherever it can; False: never;
        # True: it must); the Python loop below is its specification
        self.native = native
        self.native_loop = None

    # ---- accounting ----------------------------------------------------------------
    def _bucket_at(self, now: float) -> Bucket:
        if not self.by_time:
            return self.bucket
        k = int(now // self.bucket_ns)
        b = self.buckets.get(k)
        if b is None:
            b = self.buckets[k] = self.window_bucket(k)
        return b

    def window_bucket(self, k: int) -> Bucket:
        """A new row for window ``k`` of virtual time (``bucket_ns`` wide), labelled by its start in seconds."""
        return Bucket(f"{k * self.bucket_ns / 1e9:g}", start_ns=k * self.bucket_ns)

    # ---- operations: each returns its finish time -------------------------------------
    def _read(self, addr: int, now: float, count_hits: bool) -> float:
        if self.ops is not None:
            self.ops.append(("read", addr, self.block_bytes))
        done = self.ctl.read(addr, self.block_bytes, now)
        finish = done.finish
        b = self._bucket_at(now)
        b.reads += 1
        b.read_bytes += self.block_bytes
        if count_hits:  # a merged miss found its page already allocated (being staged): a hit of the cache
            b.hit_pages += done.hit_pages + done.merged_pages
            b.miss_pages += done.missed_pages
        b.first_read = min(b.first_read, now)
        b.last_read = max(b.last_read, finish)
        return finish

    def _write(self, addr: int, now: float) -> tuple[float, bool]:
        """Write one block at ``addr``: (finish time, accepted)."""
        if self.ops is not None:
            self.ops.append(("write", addr, self.block_bytes))
        b = self._bucket_at(now)
        try:
            done = self.ctl.write(addr, None, self.block_bytes, now)
        except WriteBufferFull:
            b.refused_writes += 1
            return now + self.refusal_ns, False
        finish = done.finish
        b.writes += 1
        b.write_bytes += self.block_bytes
        b.write_miss_pages += done.new_pages
        b.write_hit_pages += done.overwritten_pages
        b.first_write = min(b.first_write, now)
        b.last_write = max(b.last_write, finish)
        if done.write_buffer_pages > self.peak_write_buffer_pages:  # 0 without a write buffer
            self.peak_write_buffer_pages = done.write_buffer_pages
        if self.sequential:  # drain the write-back: nothing stays pinned by a flush for the next access
            finish = self.ctl.flush(finish)
        return finish, True

    def _prefetch(self, addr: int, now: float) -> tuple[int, float] | None:
        try:
            issued = self.ctl.prefetch(addr, self.block_bytes, now)
        except ChmError as exc:
            if exc.errno != errno.EBUSY:
                raise
            self._bucket_at(now).prefetch_busy += 1
            return None
        if self.ops is not None:
            self.ops.append(("prefetch", addr, self.block_bytes))
        b = self._bucket_at(now)
        b.hit_pages += issued.resident_pages
        b.miss_pages += issued.staged_pages
        if issued.window_pages_held > self.peak_staged_pages:
            self.peak_staged_pages = issued.window_pages_held
        return issued.handle, issued.ack

    # ---- the Master, on the virtual clock -----------------------------------------------
    def _lookup(self, keys, now: float) -> list[int]:
        """Addresses of the longest stored prefix of ``keys`` (workload keys; the Master's lookup: leased,
        touched), one MAX_BATCH at a time up to the first miss."""
        self.clock.t = now / NS_PER_S
        lookup, addrs = self.master.lookup, []
        for i in range(0, len(keys), MAX_BATCH):
            chunk = [key.to_bytes(KEY_BYTES, "little") for key in keys[i:i + MAX_BATCH]]  # master_key, inline
            locs = lookup(chunk)
            addrs += [loc.offset for loc in locs]
            if len(locs) < len(chunk):
                break
        return addrs

    def _put_start(self, keys, now: float) -> list:
        """Where to write each of ``keys`` (workload keys; one put_start per MAX_BATCH keys); None: stored, in
        flight, or not placed (ENOSPC: the Master could not make room, the blocks are not written)."""
        self.clock.t = now / NS_PER_S
        self.requests += 1
        rid, master, locs = f"replay-{self.requests}", self.master, []
        for i in range(0, len(keys), MAX_BATCH):
            chunk = [key.to_bytes(KEY_BYTES, "little") for key in keys[i:i + MAX_BATCH]]  # master_key, inline
            try:
                locs += master.put_start(rid, chunk, [self.slot_bytes] * len(chunk))
            except ChmError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                self.no_space_puts += 1
                # The Master evicted all it could and still had no room: at this instant a chunk as large fails
                # the same way, after placing and taking back as many blocks again. So the request's later
                # chunks are not offered (it had more than MAX_BATCH new blocks; a smaller last chunk could
                # have fit). Offering each one cost ~10 us per block of a 10^7-block request.
                locs += [None] * (len(keys) - i)
                break
        return locs

    def _put_finish(self, written: list[bytes], refused: list[bytes], now: float) -> None:
        """Register the written blocks (put_end), give the refused ones back (put_revoke: offered again later)."""
        self.clock.t = now / NS_PER_S
        for i in range(0, len(refused), MAX_BATCH):
            self.revoked += self.master.put_revoke(refused[i:i + MAX_BATCH])
        for i in range(0, len(written), MAX_BATCH):
            chunk = written[i:i + MAX_BATCH]
            self.master.put_end(chunk, [0] * len(chunk))

    # ---- one request: a generator yielding the virtual time of its next operation ------
    def _request(self, keys, now: float):
        known = self.known
        reusable = [i for i, key in enumerate(keys) if key in known]  # positions an earlier request had
        known.update(keys)
        addrs = self._lookup(keys, now)
        unread = [i for i in reusable if i >= len(addrs)] if len(reusable) > len(addrs) else ()
        if unread:  # what was not read is recomputed
            bucket = self._bucket_at(now)
            bucket.recomputed_blocks += len(unread)
            bucket.recompute_flops += self.prefill.flops(len(unread), sum(unread))
        if self.prefetching:
            now = yield from self._read_prefetched(addrs, now)
        else:
            for addr in addrs:
                start = now
                now = self._read(addr, now, True)
                self._bucket_at(start).read_latency_ns.append(now - start)
                yield now
        if len(addrs) < len(keys):
            # the rest of the chain: stored after a gap, or in flight (another request's): None, kept as it is
            written, refused = [], []
            for loc in self._put_start(keys[len(addrs):], now):
                if loc is None:
                    continue
                now, accepted = self._write(loc.offset, now)
                (written if accepted else refused).append(loc.key)
                yield now
            if written or refused:
                self._put_finish(written, refused, now)
        return now

    def _read_prefetched(self, addrs: list[int], now: float):
        ctl, window, n = self.ctl, self.window_blocks, len(addrs)
        handles: dict[int, int] = {}
        nxt = 0  # next block to prefetch
        for i in range(n):
            nxt = max(nxt, i)
            while nxt < n and nxt < i + window:
                issued = self._prefetch(addrs[nxt], now)
                if issued is None:  # the device-wide window is full: retry after our next release
                    break
                handles[nxt] = issued[0]
                nxt += 1
                now = issued[1]
                yield now
            start = now
            handle = handles.pop(i, None)
            if handle is None:  # nothing of ours in flight to wait for: read on demand
                now = self._read(addrs[i], now, True)
                nxt = max(nxt, i + 1)
            else:
                now = ctl.wait(handle, now)
                yield now
                now = self._read(addrs[i], now, False)
                yield now
                now = ctl.release(handle, now)
            self._bucket_at(start).read_latency_ns.append(now - start)
            yield now
        return now

    def _stream(self, stream, t0: float):
        now = t0 + stream.start_ns
        for k, req in enumerate(stream.requests):
            if k and req.think_ns:
                now += req.think_ns
                yield now
            now = yield from self._request(req.keys, now)
            if self.pbar is not None:
                self.pbar.update(len(req.keys))
        self._phase_end = max(self._phase_end, now)

    def _sequential(self, phase, now: float) -> float:
        """The phase's requests one after another: streams in order, each stream's requests in turn."""
        t0 = now
        for stream in phase.streams:
            now = max(now, t0 + stream.start_ns)
            for k, req in enumerate(stream.requests):
                if k and req.think_ns:
                    now += req.think_ns
                request = self._request(req.keys, now)
                while True:
                    try:
                        next(request)
                    except StopIteration as done:
                        now = done.value
                        break
                self.pbar.update(len(req.keys))
        return now

    # ---- the run ------------------------------------------------------------------------
    def _populate(self, keys, now: float) -> float:
        """Store ``keys`` before the run, put through the Master as requests would, in batches of at most the
        Master's watermark band (high - low watermark of the device: what one eviction round frees), so that
        a populate larger than the device keeps the most recent blocks as one block at a time would."""
        self.known.update(keys)
        m = self.master
        batch = min(MAX_BATCH, max(1, int((m.high_watermark - m.low_watermark) * self.cfg.capacity_bytes
                                          // self.slot_bytes)))
        keys = list(keys)
        for i in range(0, len(keys), batch):
            written = []
            for loc in self._put_start(keys[i:i + batch], now):
                if loc is None:  # already stored (or no room)
                    continue
                while True:
                    try:
                        now = self.ctl.write(loc.offset, None, self.block_bytes, now).finish
                        break
                    except WriteBufferFull:
                        now = self.ctl.flush(now)
                written.append(loc.key)
            if written:
                self._put_finish(written, [], now)
        return self.ctl.flush(now)

    def _progress_bar(self, total: int | None):
        if not self.progress:
            return _NoProgress()
        from tqdm import tqdm

        return tqdm(total=total, unit="blk", unit_scale=True, desc=f"{self.workload.name}/{self.variant}",
                    mininterval=1.0, leave=False)

    def run(self) -> dict:
        if self.native is not False:
            from .native_replay import native_problem

            problem = native_problem(self)
            if problem is None:
                return self._run_native()
            if self.native:
                raise ValueError(f"the native replay loop cannot run this replay: {problem}")
        wall0, cpu0 = time.perf_counter(), time.process_time()
        phases = list(self.workload.phases())
        total_blocks = sum(len(r.keys) for p in phases for s in p.streams for r in s.requests)
        now = self._populate(self.workload.populate_keys(), 0.0)
        t_start = now
        self.pbar = self._progress_bar(total_blocks)
        try:
            for phase in phases:
                if not self.by_time:
                    self.bucket = self.buckets[phase.label] = Bucket(phase.label, start_ns=now)
                if self.sequential:
                    now = self._sequential(phase, now)
                    self.ctl.run_until(now)
                    continue
                self._phase_end = now
                heap = [(now + s.start_ns, i, self._stream(s, now)) for i, s in enumerate(phase.streams)]
                heapq.heapify(heap)
                run_until = self.ctl.run_until
                while heap:
                    t, i, gen = heap[0]
                    # the device's own clock: background work due before this command (a flush landing, a
                    # flush falling due) runs at its own time, even while no request calls in; asked anew
                    # before every command, so a command that dirtied pages re-arms it
                    run_until(t)
                    try:
                        heapq.heapreplace(heap, (next(gen), i, gen))
                    except StopIteration:
                        heapq.heappop(heap)
                now = self._phase_end
                self.ctl.run_until(now)
        finally:
            self.pbar.close()
        wall = time.perf_counter() - wall0
        return self._result(t_start, now, wall, time.process_time() - cpu0)

class _NoProgress:
    """The progress bar when none is shown."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def run_replay(workload: Workload, profile: str, variant: str, overrides: Mapping[str, Any] | None = None,
               device_policy: str | None = None, **kwargs) -> dict:
    """Convenience: config + fresh controller + run."""
    return Replay(replay_config(profile, variant, overrides, device_policy), variant, workload, **kwargs).run()
