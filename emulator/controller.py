"""The CXL-HM controller: one engine for live clients and trace replay.

Every operation takes the virtual time it arrives at and returns the virtual
time it finishes (read, write and prefetch: in their outcome, below); bytes
(when ``emulation.data`` is on) move for real between the DRAM region, the SSD
backing files and the caller's buffers. The policy decides what lives in DRAM;
the timing model says how long it took.

``Controller`` is the command layer (read, write, prefetch, wait, release, snapshot, close) over three parts:
* ``dram.Frames`` -- the DRAM region and each frame's state (ready time, outstanding staging read, write
  sequence, staging-read errors; the frame states are described there);
* ``media_io.MediaIO`` -- page transfers between frames and the media (modelled and real);
* ``flusher.Flusher`` -- the dirty queue, flush writes in flight, the background clock and the media-error
  state (described there); ``tick``, ``run_until``, ``next_event_ns``, ``quiet_until``, ``retry_wait_s``
  and ``flush`` are its methods.

Native hit path. A read whose every page is a DRAM hit (resident, ready, settled) is served by
``chm_dev_read_hit`` (emulator/native/read_hit.c) when the policy looks pages up and counts hits in
native frame tables: the same steps as ``read`` below, over the same state (``ready_at``,
``io_token``, the timing pipes and the read latency histogram are native memory both sides use).
``chm serve`` calls it straight from its C loop; its counts reach ``stats`` at the next read or
``snapshot``.

Native sequential path. ``run_sequential(kinds, addrs, lengths, now)`` runs a list of operations one after
another, as ``chm replay --sequential`` issues them: a read (``read(addr, length, now)``, then ``now`` is its
finish) or a write followed by a flush (``write(addr, None, length, now)``, then ``now = flush(finish)``).
With data off, a built-in frame-table policy without a write buffer (lru, fifo, clock, s3fifo, sieve) and the
device settled (nothing dirty or in flight, no frame pinned, no prefetch held, no media or staging-read
error), ``chm_dev_run_sequential`` (emulator/native/device_ops.c) runs them in C over the same state: the
frame table, ``ready_at``, ``write_seq``, the timing pipes and SSD models, the latency histograms, and the
counts it folds into ``stats`` at the end, so the device is left exactly as those calls would leave it.
Otherwise (hymcache, libcachesim:*, a plug-in; data on; an unsettled device, until a write's flush settles
it; an operation the device refuses, which then raises as its call does) the operations go through those
calls one by one, in Python.

Native data-off path (the replay's). With data off and a built-in policy whose flush rule and write path the
native core has (lru, fifo, clock, s3fifo, sieve; hymcache), the flusher's state lives in C
(emulator/flusher.py, "Native mode") and ``write``, ``read`` after the DRAM-hit attempt (one area: hymcache's
two-area staging stays here), ``prefetch``'s fetch loop, ``release``'s frames, ``tick``, ``run_until``,
``next_event_ns``, ``quiet_until`` and ``flush`` run as ``chm_dev_write``, ``chm_dev_read``,
``chm_dev_prefetch_fetch``, ``chm_dev_release_frames``, ``chm_dev_tick``, ... (emulator/native/;
``chm_dev_run_sequential`` is made of the same functions): the same steps over the same state as the Python
of read (below), write_path.py and prefetch_commands.py (tests/emulator/test_native_ops.py holds them to it);
what they count is folded into ``stats`` as each call returns. The choice is made once, when the controller is
built; ``Flusher.to_python()`` (for a test that watches or replaces a method) brings the state back to Python
for good.

Outcomes. ``read``, ``write`` and ``prefetch`` return what they did (``ReadOutcome``, ``WriteOutcome``,
``PrefetchOutcome``): the finish (or acknowledgement) time and the pages they counted in ``stats``, so a
caller never diffs ``stats`` nor looks into the policy or the prefetch engine. A refused write raises
``WriteBufferFull`` with ``new_pages``, the write-buffer pages it asked for.

Where it lives: this module is the command layer's core (construction, the parts' state, staging, read,
snapshot, close) and the facade every caller imports from; the rest are mixins of Controller in modules of
their own: native_paths.py (the native paths' setup, checks and counts), sequential.py (run_sequential),
write_path.py (write), prefetch_commands.py (prefetch, wait, release), with outcomes.py (the outcomes and
the errors they raise).
"""

from __future__ import annotations

import errno
import os
import sys

from driver.wire import STATS_COUNTERS

from .config import Config
from .dram import NO_TOKEN, DramRegion, Frames
from .errors import ChmError
from .flusher import Flusher, utc
from .media_io import MediaIO
from .native import ffi, lib
from .native_paths import NATIVE_READ_COUNTS, NATIVE_SEQ_COUNTS, NativePaths
from .outcomes import (PrefetchOutcome, ReadOutcome, SequentialOutcome, Staged, UnflushedData, WriteOutcome,
                       _all_pinned, _tuple_new)
from .policies import make_policy
from .prefetch import PrefetchEngine
from .prefetch_commands import PrefetchCommands
from .sequential import SEQ_READ, SEQ_WRITE, SequentialOps, sequential_ops
from .ssd import SsdBackend
from .timing import TimingModel
from .write_path import WritePath

__all__ = ["DRAIN_TIMEOUT_S", "MAX_CHUNK_PAGES", "NATIVE_READ_COUNTS", "NATIVE_SEQ_COUNTS", "SEQ_READ", "SEQ_WRITE",
           "UNCLEAN_SHUTDOWN_MESSAGE", "Controller", "PrefetchOutcome", "ReadOutcome", "SequentialOutcome", "Staged",
           "UnflushedData", "WriteOutcome", "sequential_ops"]

MAX_CHUNK_PAGES = 64  # a large read is staged and copied in chunks of at most this many pages
DRAIN_TIMEOUT_S = 30.0  # default bound on close()'s drain while the media fail (chm serve --drain-timeout)
UNCLEAN_SHUTDOWN_MESSAGE = "unclean shutdown: writes acknowledged but not flushed before it may be lost"
_read_hit = lib.chm_dev_read_hit  # looked up here at each read: a test may count its calls (tests/emulator/conftest.py)
_dev_read = lib.chm_dev_read


def _log_to_stderr(message: str) -> None:
    print(f"chm: {message}", file=sys.stderr, flush=True)


class Controller(NativePaths, SequentialOps, WritePath, PrefetchCommands):
    """The command layer. It owns the policy, the timing model, the prefetch engine and the stats, and
    composes ``frames`` (``Frames``), ``media`` (``MediaIO``) and ``flusher`` (``Flusher``), which share
    the policy, the timing model and ``stats``.

    The background-work calls (``tick``, ``run_until``, ``next_event_ns``, ``quiet_until``,
    ``retry_wait_s``, ``flush``) are the flusher's methods themselves, bound per instance: every command
    ticks, so no forwarding call sits on that path."""

    def __init__(self, cfg: Config, media_dir: str | os.PathLike | None = None, log=None, format_media: bool = False):
        """``log``: a callable taking one line (media errors, recoveries, unclean shutdown); default stderr.
        ``format_media``: erase the media directory first (else foreign, missing or truncated media are refused)."""
        self.cfg = cfg
        self.log = log or _log_to_stderr
        self.page = cfg.device.page_size_bytes
        self.capacity = cfg.capacity_bytes
        self.policy = make_policy(cfg)
        self.timing = TimingModel(cfg)
        self.engine = PrefetchEngine(-(-cfg.policy.prefetch_window_bytes // self.page), cfg.policy.prefetch_max_handles)
        # Pages a read pins at once: never more than the frames prefetches can leave unpinned.
        self.chunk_pages = max(1, min(MAX_CHUNK_PAGES, cfg.read_staging_frames - self.engine.window_pages))
        self.staged: dict[int, Staged] = {}
        self._next_handle = 1
        self.stats = self._stats = dict.fromkeys(STATS_COUNTERS, 0)  # the wire's counters (driver/include/chm_stats.h)
        self.data = cfg.emulation.data
        backend = region = None
        if self.data:
            if media_dir is None:
                raise ChmError(errno.EINVAL, "media_dir is required when emulation.data is on")
            backend = SsdBackend(cfg, media_dir, format_media)
            try:
                region = DramRegion(cfg.dram.size_bytes, backend.ffi)
            except BaseException:
                backend.close(clean=not backend.unclean_shutdown)
                raise
        self.media = MediaIO(cfg, self.timing, self._stats, backend, 0 if region is None else region.base_addr)
        self.frames = Frames(cfg.dram_frames, self.page, region, self.media, self.policy, self._stats, self.log)
        self.flusher = flusher = Flusher(cfg, self.policy, self.timing, self.media, self.frames, self._stats, self.log)
        self.tick, self.run_until, self.next_event_ns = flusher.tick, flusher.run_until, flusher.next_event_ns
        self.quiet_until, self.retry_wait_s, self.flush = flusher.quiet_until, flusher.retry_wait_s, flusher.flush
        self.ready_at, self.read_error = self.frames.ready_at, self.frames.read_error  # never rebound: read in place
        self.device_epoch = backend.meta.epoch if backend else 0
        self.unclean_shutdown = backend.unclean_shutdown if backend else False
        if self.unclean_shutdown:
            self.log(f"{UNCLEAN_SHUTDOWN_MESSAGE} (media {str(backend.media_dir)!r})")
        self._native_read_setup()
        self._native_ops_setup()

    # ---- the parts' state, as callers read it ------------------------------------
    @property
    def dram(self) -> DramRegion | None:
        return self.frames.region

    @property
    def dirty(self):
        return self.flusher.dirty_entries()

    @property
    def flights(self):
        return self.flusher.flight_entries()

    @property
    def media_error(self) -> ChmError | None:
        return self.flusher.media_error

    @property
    def prefetch_window_pages(self) -> int:
        """The device-wide prefetch window: the most pages its handles may hold at once."""
        return self.engine.window_pages

    @property
    def prefetch_max_handles(self) -> int:
        """The most prefetch handles the device holds at once."""
        return self.engine.max_handles

    @property
    def background_ns(self) -> float:
        return self.flusher.background_ns

    @property
    def events_run(self) -> int:
        return self.flusher.events_run

    # ---- helpers ---------------------------------------------------------------
    def _cycles(self, ready: float, cycles: int) -> float:
        return self.timing.controller.run(ready, cycles)

    def check_range(self, addr: int, length: int, what: str = "length") -> None:
        if not isinstance(addr, int) or isinstance(addr, bool) or addr < 0:
            raise ChmError(errno.ERANGE if isinstance(addr, int) else errno.EINVAL,
                           f"address {addr!r} is not a byte address in [0, {self.capacity})")
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ChmError(errno.EINVAL, f"{what} {length!r} must be a positive integer")
        if addr + length > self.capacity:
            raise ChmError(errno.ERANGE, f"range [{addr}, {addr + length}) is outside the device "
                                         f"(capacity {self.capacity} bytes)")

    def _pages(self, addr: int, length: int) -> range:
        return range(addr // self.page, (addr + length - 1) // self.page + 1)

    def _allocate(self, allocate, page: int, now: float, what: str):
        """``allocate(page)`` (the policy's allocate_clean or allocate_write) and ``now``; when every frame
        is pinned, once more after the flushes in flight have landed (and released theirs), ``now`` then."""
        ins = allocate(page)
        if ins is None:
            now = max(now, self.flusher.complete_flights(float("inf")))
            ins = allocate(page)
            if ins is None:
                raise _all_pinned(what, page)
        return ins, now

    def _take_frame(self, ins, now: float) -> float:
        """The policy gave frame ``ins.frame`` to a new page: write its dirty victim back, if any, and clear
        the frame's old state; returns when the frame is free."""
        ready = now
        if ins.victim_page is not None:
            self.stats["evictions"] += 1
            if ins.victim_dirty:
                if self.frames.before_snapshot is not None:
                    self.frames.before_snapshot(ins.frame)
                ready = self.flusher.write_back(ins.frame, ins.victim_page, now)
        self.frames.reuse(ins.frame)  # a frame is only reused once its earlier read has landed
        return ready

    # ---- staging ---------------------------------------------------------------
    def _stage(self, page: int, now: float) -> int:
        """Bring a non-resident page into a clean frame; returns the frame (data may still be in flight)."""
        ins, now = self._allocate(self.policy.allocate_clean, page, now, "stage")
        frame = ins.frame
        ready = self._take_frame(ins, now)
        # The SSD-to-DRAM DMA is not charged to the DRAM pipe: DRAM outruns the SSDs, and a
        # reservation at the future arrival time would hold up host accesses issued before it.
        done, token = self.media.read(frame, page, now)
        self.ready_at[frame] = max(done, ready)
        self.frames.io_token[frame] = NO_TOKEN if token is None else token
        return frame

    # ---- reads -------------------------------------------------------------------
    def read(self, addr: int, length: int, now: float, out: memoryview | None = None,
             whole: bool = True) -> ReadOutcome:
        """Copy ``length`` bytes at ``addr`` into ``out``; returns the finish time and its pages (ReadOutcome).

        ``whole=False``: this call is one piece of a larger command, which the caller counts once
        (``count_command``) when its last piece is done."""
        self.check_range(addr, length)
        self.tick(now)
        if self.native_read and not self.read_error:  # a failed staging read must raise: the frame is looked at here
            if out is None:
                hit = _read_hit(self.native_dev, addr, length, now, ffi.NULL, whole, self._native_finish)
            else:  # the export ends with the call (a cycle must not hold it)
                with ffi.from_buffer("uint8_t[]", out, require_writable=True) as buf:
                    hit = len(buf) >= length and _read_hit(self.native_dev, addr, length, now, buf, whole,
                                                          self._native_finish)
            if hit:  # every page a hit
                self.fold_native_counts()
                return _tuple_new(ReadOutcome, (self._native_finish[0], hit, 0, 0))
            if out is None and self._native_staging and (dev := self.flusher.dev) is not None:
                res = self._read_result  # data off, one area: the rest of this read in C
                n = _dev_read(dev, addr, length, now, whole, res)
                self._fold_ops()
                if n > 0:
                    return _tuple_new(ReadOutcome, (res[0], int(res[1]), int(res[2]), int(res[3])))
                self._native_read_failed(n, int(res[1]), addr, length)
        pages = self._pages(addr, length)
        stats = self.stats
        stats["read_bytes"] += length
        t = self._cycles(now, self.cfg.controller.cycles_per_command + len(pages) * self.cfg.controller.cycles_per_lookup)
        lookup = self.policy.lookup
        frames = [lookup(page) for page in pages]
        if None not in frames:  # all resident: nothing can be evicted under us, so nothing to pin
            ready_at, touch, merged = self.ready_at, self.policy.touch, 0
            for frame in frames:
                if ready_at[frame] > t:
                    merged += 1
                else:
                    touch(frame)
            hits, missed = len(frames) - merged, 0
            stats["page_hits"] += hits
            stats["merged_misses"] += merged
            finish = self._copy_out(addr, length, pages, frames, t, out)
        else:  # staging may evict: pin what a chunk uses until it is copied
            finish, hits, missed, merged = t, 0, 0, 0
            for chunk_start in range(0, len(pages), self.chunk_pages):
                chunk = pages[chunk_start: chunk_start + self.chunk_pages]
                frames, h, m, mm = self._lookup_or_stage(chunk, t)
                hits += h
                missed += m
                merged += mm
                try:
                    finish = max(finish, self._copy_out(addr, length, chunk, frames, t, out))
                finally:
                    for frame in frames:
                        self.policy.unpin(frame)
        if whole:
            self.count_command("read", finish - now)
        return _tuple_new(ReadOutcome, (finish, hits, missed, merged))

    def count_command(self, kind: str, latency_ns: float) -> None:
        """One host command (``read`` or ``write``) done: its count and its latency sample."""
        self.stats[kind + "s"] += 1
        self.timing.latencies.add(kind, latency_ns)

    def _lookup_or_stage(self, pages: range, t: float) -> tuple[list[int], int, int, int]:
        """Frames for ``pages``, staging the missing ones; each is pinned (staging may evict). Returns them
        with the pages hit, missed and merged (counted in ``stats`` too, even when staging fails)."""
        frames = []
        policy, ready_at = self.policy, self.ready_at
        hits = missed = merged = 0
        try:
            for page in pages:
                frame = policy.lookup(page)
                if frame is None:
                    missed += 1
                    frame = self._stage(page, t)
                elif ready_at[frame] > t:
                    merged += 1
                else:
                    hits += 1
                    policy.touch(frame)
                policy.pin(frame)
                frames.append(frame)
        finally:
            stats = self.stats
            if hits:
                stats["page_hits"] += hits
            if missed:
                stats["page_misses"] += missed
            if merged:
                stats["merged_misses"] += merged
        return frames, hits, missed, merged

    def _copy_out(self, addr: int, length: int, pages: range, frames: list[int], t: float, out: memoryview | None) -> float:
        """Move the requested bytes of ``pages`` (in ``frames``) to the host; returns when the last arrives.

        Frames that follow each other in DRAM are copied with one memcpy; time is charged page by page,
        so DRAM and the link pipeline at page granularity."""
        page_size, ready_at, read_error, state = self.page, self.ready_at, self.read_error, self.frames
        io_token, region = state.io_token, state.region
        readies, sizes = [], []
        run_src = run_dst = run_len = 0
        run_last = -2  # frame that ends the pending copy run
        first_page, end = addr // page_size, addr + length
        for page, frame in zip(pages, frames):
            base = page * page_size
            lo = addr - base if page == first_page else 0
            hi = end - base if end < base + page_size else page_size
            ready = ready_at[frame]
            if ready <= t:
                self.stats["hit_bytes"] += hi - lo
            if self.data:
                if io_token[frame] != NO_TOKEN:
                    state.settle(frame)
                if read_error and frame in read_error:
                    state.check_read(frame)
                if out is not None:
                    if frame == run_last + 1 and lo == 0:
                        run_len += hi
                    else:
                        if run_len:
                            out[run_dst: run_dst + run_len] = region.view[run_src: run_src + run_len]
                        run_src, run_dst, run_len = frame * page_size + lo, base + lo - addr, hi - lo
                    run_last = frame if hi == page_size else -2
            readies.append(ready if ready > t else t)
            sizes.append(hi - lo)
        if run_len:
            out[run_dst: run_dst + run_len] = region.view[run_src: run_src + run_len]
        # FIFO pipes: arrivals never decrease, so the last page's is the finish
        return self.timing.link_to_host.stream(self.timing.dram.stream(readies, sizes), sizes)[-1]

    @staticmethod
    def _native_read_failed(rc: int, page: int, addr: int, length: int):
        """Raise what ``read`` raises where ``chm_dev_read`` stopped with status ``rc`` (CHM_NO_FRAME: at ``page``)."""
        if rc == lib.CHM_NO_FRAME:
            raise _all_pinned("stage", page)
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(f"read of {length} bytes at {addr}: no memory for the native path's state")
        raise RuntimeError(f"read of {length} bytes at {addr}: native status {rc}")

    # ---- lifecycle -------------------------------------------------------------------
    def snapshot(self) -> dict:
        self.fold_native_counts()
        s = dict(self.stats)
        s["dirty_pages"], s["flushes_in_flight"] = self.flusher.pending()
        s["prefetch_pages_held"] = self.engine.pages_held
        s["busy_ns"] = self.timing.busy()
        s["latency"] = self.timing.latencies.summary()
        s["slowed_reads"] = sum(x.slowed_reads for x in self.timing.ssds)
        s["policy_counters"] = self.policy.counters()  # the policy's own events (libcachesim: its divergences)
        if self.media.backend is not None:
            s["direct_io"] = self.media.backend.direct
        s["device_epoch"] = self.device_epoch
        s["unclean_shutdown"] = self.unclean_shutdown
        err = self.flusher.media_error
        s["media_error"] = None if err is None else {"errno": err.errno, "message": err.message,
                                                     "since": utc(self.flusher.media_error_since)}
        return s

    def close(self, now: float, drain_timeout_s: float | None = DRAIN_TIMEOUT_S) -> float:
        """Drain the write buffer onto the media and release everything; returns the drain's finish.

        Bounded: while flushes fail it retries (backoff) for at most ``drain_timeout_s`` seconds of wall
        time (None: until they succeed), then raises UnflushedData naming the pages and bytes left and the
        media error -- after releasing everything. The media are marked cleanly shut down only when
        nothing was left."""
        done, left = self.flusher.drain(now, drain_timeout_s)
        pages, nbytes = self.flusher.unflushed()
        try:
            for handle in list(self.staged):
                self.release(handle, done)
            self.media.close(clean=left is None)
        finally:
            if self.frames.region is not None:
                self.native_dev.dram = ffi.NULL  # no read may reach the region once it is unmapped
                self.frames.close()
        if left is not None:
            raise UnflushedData(pages, nbytes, left) if pages else left
        return done
