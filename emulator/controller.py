"""The CXL-HM controller: one engine for live clients and trace replay.

Every operation takes the virtual time it arrives at and returns the virtual
time it finishes; bytes (when ``emulation.data`` is on) move for real between
the DRAM region, the SSD backing files and the caller's buffers. The policy
decides what lives in DRAM; the timing model says how long it took.

Frame states (per DRAM frame):
* ``ready_at[f]`` -- virtual time the frame's data is in DRAM (later than now:
  the page is still being staged; a second access then is a merged miss);
* ``io_token[f]`` -- the real media read filling the frame, until settled (``NO_TOKEN``: settled);
* ``write_seq[f]`` -- bumped by every write, so a flush that completes after a
  newer write does not mark the frame clean;
* a frame being flushed is pinned until its flush completes;
* ``read_error[f]`` -- the media error of a staging read that failed: reads of
  the frame raise it until the frame is dropped (once nobody pins it).

Media errors. A flush write that fails (ENOSPC, EIO) leaves its pages dirty,
queued and pinned in DRAM (reads keep being served from there); the device
enters a media-error state: new writes are refused with ENOSPC and the
background flusher retries after a wall-time backoff (``MEDIA_RETRY_FIRST_S``,
doubling, at most ``MEDIA_RETRY_MAX_S``). A successful flush clears the state.
Each episode and its recovery is logged once.

Native hit path. A read whose every page is a DRAM hit (resident, ready, settled) is served by
``chm_dev_read_hit`` (emulator/native/chm_core.c) when the policy looks pages up and counts hits in
native frame tables: the same steps as ``read`` below, over the same state (``ready_at``,
``io_token``, the timing pipes and the read latency histogram are native memory both sides use).
``chm serve`` calls it straight from its C loop; its counts reach ``stats`` at the next read or
``snapshot``.
"""

from __future__ import annotations

import errno
import heapq
import math
import mmap
import os
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field

from driver.wire import STATS_COUNTERS

from .config import Config
from .errors import ChmError, WriteBufferFull
from .native import ffi, lib
from .policies import Area, Policy, make_policy
from .policies.hymcache import HymCachePolicy
from .prefetch import PrefetchEngine
from .ssd import MediaIOError, SsdBackend, locate
from .timing import TimingModel

MAX_CHUNK_PAGES = 64  # a large read is staged and copied in chunks of at most this many pages
MEDIA_RETRY_FIRST_S = 1.0  # wall time before the flusher retries after a media error; doubles per failure
MEDIA_RETRY_MAX_S = 30.0  # ... up to this
DRAIN_TIMEOUT_S = 30.0  # default bound on close()'s drain while the media fail (chm serve --drain-timeout)
UNCLEAN_SHUTDOWN_MESSAGE = "unclean shutdown: writes acknowledged but not flushed before it may be lost"
NO_TOKEN = lib.CHM_NO_TOKEN  # io_token of a frame with no media read outstanding
# The stats the native hit read counts: struct chm_read_counts's fields, in its order.
NATIVE_READ_COUNTS = tuple(name for name, _ in ffi.typeof("struct chm_read_counts").fields)
_ZERO_COUNTS = memoryview(array("Q", bytes(8 * len(NATIVE_READ_COUNTS))))
_read_hit = lib.chm_dev_read_hit


def _log_to_stderr(message: str) -> None:
    print(f"chm: {message}", file=sys.stderr, flush=True)


def _utc(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))


def native_lookup_areas(policy: Policy) -> list[Area] | None:
    """The areas ``policy.lookup`` asks for a page, in its order, when its lookup and touch are the built-in
    ones over native frame tables (then a DRAM-hit read can run in C); None when either runs in Python
    (a plug-in's lookup, touch or eviction order)."""
    cls = type(policy)
    if cls.touch is not Policy.touch:
        return None
    if cls.lookup is Policy.lookup:
        areas = [policy.read_area]
    elif cls.lookup is HymCachePolicy.lookup:
        areas = [policy.write_area, policy.read_area]  # the newest copy of a written page is in the write buffer
    else:
        return None
    table = policy.read_area.table
    for name in ("lookup", "touch"):  # CachePolicy binds the read area's table methods to the instance
        own = vars(policy).get(name)
        if own is not None and own != getattr(table, name):
            return None
    return None if any(area.table.plugin for area in areas) else areas


class UnflushedData(ChmError):
    """close() gave up draining: ``pages`` pages (``nbytes`` bytes) acknowledged but never flushed are lost;
    ``error`` is the media error that kept them off the media."""

    def __init__(self, pages: int, nbytes: int, error: ChmError):
        super().__init__(error.errno, f"{pages} pages ({nbytes} bytes) of acknowledged writes were left unflushed "
                                      f"(lost): {error.message}")
        self.pages, self.nbytes, self.error = pages, nbytes, error


class DramRegion:
    """The device DRAM: one shared-memory region (a memfd, so other processes
    can map it), page-aligned so media I/O can land in it with O_DIRECT."""

    def __init__(self, size: int, ffi):
        self.size = size
        self.fd = os.memfd_create("chm-dram", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.view = memoryview(self.map)
        self._cdata = ffi.from_buffer(self.map)
        self.base_addr = int(ffi.cast("uintptr_t", self._cdata))

    def close(self) -> None:
        self.view.release()
        del self._cdata
        self.map.close()
        os.close(self.fd)


@dataclass
class Flight:
    """A flush write in flight: frames written, the seq each had, when it lands."""

    frames: list[int]
    seqs: list[int]
    token: int | None
    finish: float
    since: list[float] = field(default_factory=list)  # each frame's write time, to requeue it if the write fails
    error: ChmError | None = None  # the media error the write completed with
    generation: int = 0  # Controller._generation when issued: only a retry's failure doubles the backoff


@dataclass
class Staged:
    """What the controller keeps per prefetch handle (the engine keeps the window)."""

    frames: list[int]  # pinned read frames, in page order
    ready_at: float


class Controller:
    def __init__(self, cfg: Config, media_dir: str | os.PathLike | None = None, log=None, format_media: bool = False):
        """``log``: a callable taking one line (media errors, recoveries, unclean shutdown); default stderr.
        ``format_media``: erase the media directory first (else foreign, missing or truncated media are refused)."""
        self.cfg = cfg
        self.log = log or _log_to_stderr
        self.page = cfg.device.page_size_bytes
        self.capacity = cfg.capacity_bytes
        self.policy = make_policy(cfg)
        self.timing = TimingModel(cfg)
        frames = cfg.dram_frames
        # Arrays, not lists: the native hit read reads them in place (so they never change size).
        self.ready_at = array("d", bytes(8 * frames))
        self.io_token = array("q", bytes(8 * frames))  # all NO_TOKEN
        self.write_seq = [0] * frames
        self.queued = bytearray(frames)  # frame is in the dirty queue
        self.dirty: deque[tuple[int, float]] = deque()  # (frame, write time), oldest first
        self.flights: list[tuple[float, int, Flight]] = []  # min-heap of (finish, issue order, flight)
        self._flight_order = 0
        self._flushing_pages = 0  # pages in self.flights
        self._flight_room: tuple[tuple[int, int], float] = ((-1, -1), 0.0)  # _flight_room_at's cache
        self.background_ns = 0.0  # virtual time up to which run_until has done the background work
        self.events_run = 0  # background events run_until has run (flush landings, flush grants)
        self.engine = PrefetchEngine(-(-cfg.policy.prefetch_window_bytes // self.page), cfg.policy.prefetch_max_handles)
        # Pages a read pins at once: never more than the frames prefetches can leave unpinned.
        self.chunk_pages = max(1, min(MAX_CHUNK_PAGES, cfg.read_staging_frames - self.engine.window_pages))
        self.staged: dict[int, Staged] = {}
        self._next_handle = 1
        self.stats = dict.fromkeys(STATS_COUNTERS, 0)  # the wire's counters (driver/include/chm_stats.h)
        self.media_error: ChmError | None = None  # set while flushes fail; new writes are refused
        self.media_error_since = 0.0  # wall time (time.time()) the episode began
        self._retry_delay_s = MEDIA_RETRY_FIRST_S
        self._retry_at = 0.0  # time.monotonic() before which the background flusher does not retry
        self.read_error: dict[int, ChmError] = {}
        self._held_dirty: set[int] = set()  # dirty frames kept pinned while the media fail, until flushed
        self._failed_frames: set[int] = set()  # frames whose last flush failed; the error clears when none is left
        self._generation = 0  # bumped at each backoff step
        self._read_error_logged: tuple | None = None
        self.data = cfg.emulation.data
        self.backend = self.dram = None
        if self.data:
            if media_dir is None:
                raise ChmError(errno.EINVAL, "media_dir is required when emulation.data is on")
            self.backend = SsdBackend(cfg, media_dir, format_media)
            try:
                self.dram = DramRegion(cfg.dram.size_bytes, self.backend.ffi)
            except BaseException:
                self.backend.close(clean=not self.backend.unclean_shutdown)
                raise
        self.device_epoch = self.backend.meta.epoch if self.backend else 0
        self.unclean_shutdown = self.backend.unclean_shutdown if self.backend else False
        if self.unclean_shutdown:
            self.log(f"{UNCLEAN_SHUTDOWN_MESSAGE} (media {str(self.backend.media_dir)!r})")
        self._native_read_setup()

    def _native_read_setup(self) -> None:
        """The native DRAM-hit read's view of this controller (``native_read``, ``native_dev``)."""
        dev = self.native_dev = ffi.new("struct chm_dev *")
        timing, ctl = self.timing, self.cfg.controller
        self._native_keep = [ffi.from_buffer("double[]", self.ready_at), ffi.from_buffer("int64_t[]", self.io_token)]
        dev.page_size, dev.capacity = self.page, self.capacity
        dev.cycles_per_command, dev.cycles_per_lookup = ctl.cycles_per_command, ctl.cycles_per_lookup
        dev.ready_at, dev.io_token = self._native_keep
        dev.dram = ffi.NULL if self.dram is None else ffi.cast("uint8_t *", self.dram.base_addr)
        dev.controller, dev.dram_pipe, dev.link_to_host = timing.controller._c, timing.dram._c, timing.link_to_host._c
        dev.read_latency = timing.latencies.histogram("read")._c
        areas = native_lookup_areas(self.policy) or []
        for i, area in enumerate(areas):
            dev.areas[i].table, dev.areas[i].base = area.table._c, area.base
        dev.n_areas = len(areas)
        self.native_read = bool(areas)  # DRAM-hit reads run in C
        self._native_counts = memoryview(ffi.buffer(ffi.addressof(dev, "counts"))).cast("Q")
        self._native_finish = ffi.new("double *")

    # ---- helpers ---------------------------------------------------------------
    def _cycles(self, ready: float, cycles: int) -> float:
        return self.timing.controller.run(ready, cycles)

    def _frame_view(self, frame: int, start: int = 0, end: int | None = None) -> memoryview:
        base = frame * self.page
        return self.dram.view[base + start: base + (self.page if end is None else end)]

    def _media_io(self, opcode: int, frame: int, page: int) -> int | None:
        """Start a real page transfer between ``frame`` and the page's media location."""
        if not self.data:
            return None
        ssd, offset = locate(self.cfg, page * self.page)
        return self.backend.submit(opcode, ssd, offset, self.dram.base_addr + frame * self.page, self.page)

    def _settle(self, frame: int) -> None:
        """Make sure a frame's staging read has really landed (a failure is kept in ``read_error``)."""
        token = self.io_token[frame]
        if token != NO_TOKEN:
            self.io_token[frame] = NO_TOKEN
            try:
                self.backend.wait(token)
            except MediaIOError as exc:
                self.read_error[frame] = exc
                self.stats["read_failures"] += 1
                if self._read_error_logged != (exc.errno, exc.path):
                    self._read_error_logged = (exc.errno, exc.path)
                    self.log(f"media error on a staging read: {exc.message}")

    def _check_read(self, frame: int) -> None:
        """Raise the media error of the frame's staging read, if it failed."""
        exc = self.read_error.get(frame)
        if exc is not None:
            raise ChmError(exc.errno, exc.message)

    def _drop_failed_reads(self) -> None:
        """Frames whose staging read failed leave DRAM once nobody pins them, so a later read retries the media."""
        for frame in list(self.read_error):
            page = self.policy.page_of(frame)
            if page is None:
                del self.read_error[frame]
            elif self.policy.pins(frame) == 0 and not self.queued[frame] and not self.policy.is_dirty(frame):
                self.policy.drop(frame)
                del self.read_error[frame]

    def _ssd_of(self, page: int):
        return self.timing.ssds[locate(self.cfg, page * self.page)[0]]

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

    # ---- staging ---------------------------------------------------------------
    def _stage(self, page: int, now: float) -> int:
        """Bring a non-resident page into a clean frame; returns the frame (data may still be in flight)."""
        ins = self.policy.allocate_clean(page)
        if ins is None:  # every frame pinned: wait for in-flight flushes to release theirs
            now = max(now, self._complete_flights(float("inf")))
            ins = self.policy.allocate_clean(page)
            if ins is None:
                raise ChmError(errno.EBUSY, f"no DRAM frame can be evicted to stage page {page}: all are pinned")
        frame, ready = ins.frame, now
        if ins.victim_page is not None:
            self.stats["evictions"] += 1
            if ins.victim_dirty:
                ready = self._write_back_victim(frame, ins.victim_page, now)
        self._settle(frame)  # a frame is only reused once its earlier read has landed
        self.read_error.pop(frame, None)
        # The SSD-to-DRAM DMA is not charged to the DRAM pipe: DRAM outruns the SSDs, and a
        # reservation at the future arrival time would hold up host accesses issued before it.
        self.ready_at[frame] = max(self._ssd_of(page).read(now, self.page), ready)
        token = self._media_io(SsdBackend.READ, frame, page)
        self.io_token[frame] = NO_TOKEN if token is None else token
        self.stats["ssd_read_bytes"] += self.page
        return frame

    def _write_back_victim(self, frame: int, victim_page: int, now: float) -> float:
        """An evicted page was dirty (lru): write it to flash before its frame is reused."""
        self.stats["dirty_evictions"] += 1
        self._unqueue(frame)
        done = self._ssd_of(victim_page).write(now, self.page)
        token = self._media_io(SsdBackend.WRITE, frame, victim_page)
        if token is not None:
            try:
                self.backend.wait(token)
            except MediaIOError as exc:  # the frame is already the new page's: the victim's data is gone
                self.stats["lost_pages"] += 1
                self.log(f"media error writing back evicted dirty page {victim_page}: its data is lost: {exc.message}")
                self._media_failed(exc)
        self.stats["ssd_write_bytes"] += self.page
        return done

    def _unqueue(self, frame: int) -> None:
        if self.queued[frame]:
            self.queued[frame] = 0
            self.dirty = deque(e for e in self.dirty if e[0] != frame)

    # ---- flusher ---------------------------------------------------------------
    # Background work is event-driven: it is due when a flush lands or when the policy's flush rule
    # starts to grant (next_event_ns); run_until does each at its own virtual time, so idle spans cost
    # nothing. Every command also ticks at its start.
    def tick(self, now: float, force: bool = False) -> None:
        """Background work at virtual time ``now``: retire finished flushes, start new ones."""
        self._complete_flights(now)
        if self.read_error:
            self._drop_failed_reads()
        if not force and self._flusher_held():
            return
        while self.dirty:
            n = self.policy.flush_grant(self.dirty, now, self.timing.reads_in_flight(now), force)
            if n == 0:
                return
            self._start_flush([self.dirty.popleft() for _ in range(n)], now)
            if not force:
                return

    def _backing_off(self) -> bool:
        """After a media error the background flusher waits (wall time) before it retries."""
        return self.media_error is not None and time.monotonic() < self._retry_at

    def _at_flight_limit(self) -> bool:
        """The policy's bound on flushed pages in flight is reached: the next flush waits for one to land."""
        limit = self.policy.flush_pages_in_flight
        return limit is not None and self._flushing_pages >= limit

    def _flight_room_at(self) -> float:
        """When enough flushes have landed to bring the pages in flight under the policy's bound (cached:
        asked before every command, it changes only when a flush starts or lands)."""
        key = (self._flight_order, self._flushing_pages)  # a start bumps the order, a landing lowers the pages
        if self._flight_room[0] != key:
            must_land = self._flushing_pages - self.policy.flush_pages_in_flight + 1
            landed, at = 0, 0.0
            for at, _, flight in sorted(self.flights):
                landed += len(flight.frames)
                if landed >= must_land:
                    break
            self._flight_room = (key, at)
        return self._flight_room[1]

    def _flusher_held(self) -> bool:
        """The background flusher may start no flush now."""
        return self._backing_off() or self._at_flight_limit()

    def retry_wait_s(self) -> float | None:
        """Wall seconds until the flusher retries after a media error (the backoff is in wall time, so it is
        no virtual-time event); None when not backing off."""
        return max(0.0, self._retry_at - time.monotonic()) if self._backing_off() else None

    def next_event_ns(self, now: float) -> float | None:
        """The earliest virtual time >= ``now`` at which background work falls due if no command comes
        meanwhile; None when nothing is pending. Events: the next time the policy grants a flush (for
        hymcache possibly when the SSD reads in flight have landed); a flush landing, where that matters
        before the next command: its real I/O (a media error) is to be collected, or enough have landed to
        bring the pages in flight under the policy's bound while dirty pages wait. (Otherwise the next tick
        retires it: nothing between looks.) A flusher backing off after a media error counts no flush grant
        (see ``retry_wait_s``)."""
        due = None
        if self.data and self.flights:
            due = self.flights[0][0]
        elif self.dirty and self._at_flight_limit():
            due = self._flight_room_at()
        if self.dirty and not self._flusher_held():
            timing = self.timing
            grant = self.policy.next_flush_at(self.dirty, now, lambda n: timing.reads_idle_at(now, n))
            if grant is not None and (due is None or grant < due):
                due = grant
        return None if due is None else max(now, due)

    def run_until(self, until: float) -> int:
        """Do the background work due up to virtual time ``until``, each event at its own time, from where
        the background clock stands (it only moves forward); returns how many events ran.

        The replay driver calls it before each command, ``chm serve`` after each idle sleep."""
        t, ran = self.background_ns, 0
        while (due := self.next_event_ns(t)) is not None and due <= until:
            before = (self.stats["flush_batches"], len(self.flights))
            self.tick(due)
            if (self.stats["flush_batches"], len(self.flights)) == before:  # would loop forever at `due`
                raise RuntimeError(f"policy {self.policy.name!r}: next_flush_at said a flush is due at {due!r} ns "
                                   f"but flush_grant granted none (and no flush landed)")
            t, ran = due, ran + 1
        self.background_ns = max(t, until)
        self.events_run += ran
        return ran

    def _start_flush(self, entries: list[tuple[int, float]], now: float) -> None:
        """Write the dirty ``entries`` ((frame, write time)) to the media."""
        self.stats["flush_batches"] += 1
        since = dict(entries)
        frames = sorted(since, key=lambda f: self.policy.page_of(f))
        run: list[int] = []
        for frame in frames:
            self.queued[frame] = 0
            if frame in self._held_dirty:  # pinned since its last flush failed: the flight takes that pin over
                self._held_dirty.discard(frame)
            else:
                self.policy.pin(frame)
            if run and not self._extends(run[-1], frame):
                self._write_run(run, now, since)
                run = []
            run.append(frame)
        if run:
            self._write_run(run, now, since)

    def _extends(self, prev: int, frame: int) -> bool:
        """Can ``frame`` join a media write ending with ``prev`` (adjacent in DRAM and on the same SSD file)?"""
        p, q = self.policy.page_of(prev), self.policy.page_of(frame)
        a, b = locate(self.cfg, p * self.page), locate(self.cfg, q * self.page)
        return frame == prev + 1 and a[0] == b[0] and b[1] == a[1] + self.page

    def _write_run(self, run: list[int], now: float, since: dict[int, float]) -> None:
        first_page = self.policy.page_of(run[0])
        nbytes = len(run) * self.page
        finish = self._ssd_of(first_page).write(now, nbytes)
        token = None
        if self.data:
            ssd, offset = locate(self.cfg, first_page * self.page)
            token = self.backend.submit(SsdBackend.WRITE, ssd, offset, self.dram.base_addr + run[0] * self.page, nbytes)
        self._flight_order += 1
        self._flushing_pages += len(run)
        flight = Flight(run, [self.write_seq[f] for f in run], token, finish, [since[f] for f in run],
                        generation=self._generation)
        heapq.heappush(self.flights, (finish, self._flight_order, flight))
        self.stats["ssd_write_bytes"] += nbytes
        self.stats["flushed_pages"] += len(run)

    def _complete_flights(self, now: float) -> float:
        """Retire flushes that have landed by ``now``; returns the latest finish retired."""
        latest = 0.0
        landed = []
        while self.flights and self.flights[0][0] <= now:
            landed.append(heapq.heappop(self.flights))
        landed.sort(key=lambda entry: entry[1])  # retired in issue order, as they were issued
        failed: Flight | None = None
        requeue: list[tuple[int, float]] = []
        for _, _, flight in landed:
            self._flushing_pages -= len(flight.frames)
            self._land(flight)
            if flight.error is not None:  # the pages stay dirty, pinned and queued: nothing acknowledged is dropped
                if failed is None or flight.generation > failed.generation:
                    failed = flight
                self.stats["flush_failures"] += 1
                self._failed_frames.update(flight.frames)
                for frame, since in zip(flight.frames, flight.since):
                    self._held_dirty.add(frame)
                    if not self.queued[frame]:
                        self.queued[frame] = 1
                        requeue.append((frame, since))
            else:
                self._failed_frames.difference_update(flight.frames)
                for frame, seq in zip(flight.frames, flight.seqs):
                    self.policy.unpin(frame)
                    if self.write_seq[frame] == seq and not self.queued[frame]:
                        self.policy.flushed(frame)
            latest = max(latest, flight.finish)
        if requeue:
            self.dirty.extendleft(reversed(sorted(requeue, key=lambda e: e[1])))  # oldest first, ahead of newer writes
        if failed is not None:
            self._media_failed(failed.error, failed.generation)
        elif self.media_error is not None and not self._failed_frames:
            self._media_recovered()  # every page whose flush failed has been flushed since
        return latest

    def _land(self, flight: Flight) -> None:
        """Wait for a flush write's real I/O; a media error is kept on the flight."""
        if flight.token is not None:
            token, flight.token = flight.token, None
            try:
                self.backend.wait(token)
            except MediaIOError as exc:
                flight.error = exc

    def _unflushed(self) -> tuple[int, int]:
        pages = len(self.dirty)
        return pages, pages * self.page

    def _media_failed(self, exc: ChmError, generation: int | None = None) -> None:
        """A media write failed (``generation``: of the flight that failed; None: not a flush)."""
        for frame, _ in self.dirty:  # no dirty page may be evicted (and its write-back fail) while the media fail
            if frame not in self._held_dirty:
                self._held_dirty.add(frame)
                self.policy.pin(frame)
        if self.media_error is None:
            self.media_error, self.media_error_since = exc, time.time()
            self._generation += 1
            self._retry_delay_s = MEDIA_RETRY_FIRST_S
            self.stats["media_errors"] += 1
            pages, nbytes = self._unflushed()
            self.log(f"media error: {exc.message}; {pages} pages ({nbytes} bytes) stay dirty in DRAM and are retried "
                     f"every {MEDIA_RETRY_FIRST_S:g} s (doubling, at most {MEDIA_RETRY_MAX_S:g} s); new writes are "
                     f"refused (ENOSPC) until a retry succeeds")
        elif generation == self._generation:  # a retry failed: back off further
            self.media_error = exc
            self._generation += 1
            self._retry_delay_s = min(2 * self._retry_delay_s, MEDIA_RETRY_MAX_S)
        else:
            return  # a write issued before the last backoff step: it changes nothing
        self._retry_at = time.monotonic() + self._retry_delay_s

    def _media_recovered(self) -> None:
        lasted = time.time() - self.media_error_since
        self.log(f"media recovered: a flush succeeded after {lasted:.1f} s of media errors ({self.media_error.message}); "
                 f"writes are accepted again")
        self.media_error = None
        self._retry_delay_s = MEDIA_RETRY_FIRST_S

    def flush(self, now: float) -> float:
        """Drain everything written to the media; returns when it is there (virtual time).

        Tries at once, whatever the media-error backoff says; raises the media error (ENOSPC, EIO, with
        the file) if pages remain unflushed -- they stay dirty in DRAM and are retried."""
        self.stats["flush_calls"] += 1
        self.tick(now, force=True)
        done = max([now] + [entry[0] for entry in self.flights])
        self._complete_flights(float("inf"))
        if self.dirty and self.media_error is not None:
            pages, nbytes = self._unflushed()
            raise ChmError(self.media_error.errno, f"flush incomplete: {pages} pages ({nbytes} bytes) are not on the "
                                                   f"media (they stay in device DRAM and are retried): "
                                                   f"{self.media_error.message}")
        if self.data:
            self.backend.sync()
        return done

    # ---- reads -------------------------------------------------------------------
    def read(self, addr: int, length: int, now: float, out: memoryview | None = None, whole: bool = True) -> float:
        """Copy ``length`` bytes at ``addr`` into ``out``; returns the finish time.

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
            if hit:
                self.fold_native_counts()
                return self._native_finish[0]
        pages = self._pages(addr, length)
        stats = self.stats
        stats["read_bytes"] += length
        t = self._cycles(now, self.cfg.controller.cycles_per_command + len(pages) * self.cfg.controller.cycles_per_lookup)
        frames = [self.policy.lookup(page) for page in pages]
        if None not in frames:  # all resident: nothing can be evicted under us, so nothing to pin
            for frame in frames:
                if self.ready_at[frame] > t:
                    stats["merged_misses"] += 1
                else:
                    stats["page_hits"] += 1
                    self.policy.touch(frame)
            finish = self._copy_out(addr, length, pages, frames, t, out)
        else:  # staging may evict: pin what a chunk uses until it is copied
            finish = t
            for chunk_start in range(0, len(pages), self.chunk_pages):
                chunk = pages[chunk_start: chunk_start + self.chunk_pages]
                frames = self._lookup_or_stage(chunk, t)
                try:
                    finish = max(finish, self._copy_out(addr, length, chunk, frames, t, out))
                finally:
                    for frame in frames:
                        self.policy.unpin(frame)
        if whole:
            self.count_command("read", finish - now)
        return finish

    def fold_native_counts(self) -> None:
        """Add what native hit reads counted to ``stats``."""
        counts, stats = self._native_counts, self.stats
        for name, n in zip(NATIVE_READ_COUNTS, counts.tolist()):
            if n:
                stats[name] += n
        counts[:] = _ZERO_COUNTS

    def quiet_until(self, now: float) -> float:
        """A virtual time before which ``tick`` has nothing to do, from ``now`` on, as long as only DRAM-hit
        reads run (they start no media I/O, dirty no page and land no flush): a command starting in
        [now, quiet_until) may skip its tick, as ``chm serve``'s native hit path does. -inf: ``tick`` may
        act at any time (staging reads that failed wait to be dropped, or the media fail)."""
        if self.read_error or self.media_error is not None:
            return -math.inf
        until = self.flights[0][0] if self.flights else math.inf  # a flush lands: tick retires it
        if self.dirty and not self._at_flight_limit():  # at the limit, nothing starts before a flush lands
            timing = self.timing
            grant = self.policy.next_flush_at(self.dirty, now, lambda n: timing.reads_idle_at(now, n))
            if grant is not None and grant < until:
                until = grant
        return until

    def count_command(self, kind: str, latency_ns: float) -> None:
        """One host command (``read`` or ``write``) done: its count and its latency sample."""
        self.stats[kind + "s"] += 1
        self.timing.latencies.add(kind, latency_ns)

    def _lookup_or_stage(self, pages: range, t: float) -> list[int]:
        """Frames for ``pages``, staging the missing ones; each is pinned (staging may evict)."""
        frames = []
        for page in pages:
            frame = self.policy.lookup(page)
            if frame is None:
                self.stats["page_misses"] += 1
                frame = self._stage(page, t)
            elif self.ready_at[frame] > t:
                self.stats["merged_misses"] += 1
            else:
                self.stats["page_hits"] += 1
                self.policy.touch(frame)
            self.policy.pin(frame)
            frames.append(frame)
        return frames

    def _copy_out(self, addr: int, length: int, pages: range, frames: list[int], t: float, out: memoryview | None) -> float:
        """Move the requested bytes of ``pages`` (in ``frames``) to the host; returns when the last arrives.

        Frames that follow each other in DRAM are copied with one memcpy; time is charged page by page,
        so DRAM and the link pipeline at page granularity."""
        page_size, ready_at, io_token, read_error = self.page, self.ready_at, self.io_token, self.read_error
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
                    self._settle(frame)
                if read_error and frame in read_error:
                    self._check_read(frame)
                if out is not None:
                    if frame == run_last + 1 and lo == 0:
                        run_len += hi
                    else:
                        if run_len:
                            out[run_dst: run_dst + run_len] = self.dram.view[run_src: run_src + run_len]
                        run_src, run_dst, run_len = frame * page_size + lo, base + lo - addr, hi - lo
                    run_last = frame if hi == page_size else -2
            readies.append(ready if ready > t else t)
            sizes.append(hi - lo)
        if run_len:
            out[run_dst: run_dst + run_len] = self.dram.view[run_src: run_src + run_len]
        # FIFO pipes: arrivals never decrease, so the last page's is the finish
        return self.timing.link_to_host.stream(self.timing.dram.stream(readies, sizes), sizes)[-1]

    # ---- writes ------------------------------------------------------------------
    def write(self, addr: int, data: memoryview | None, length: int, now: float, whole: bool = True) -> float:
        """Write ``length`` bytes (``data``, or nothing when data is off) at ``addr``; returns the finish time.

        Raises WriteBufferFull, having written nothing, when the policy refuses. ``whole`` as for ``read``.
        """
        self.check_range(addr, length)
        self.tick(now)
        if self.media_error is not None:
            self.stats["media_refused_writes"] += 1
            pages, nbytes = self._unflushed()
            raise ChmError(errno.ENOSPC, f"write of {length} bytes at {addr} refused: the media are full or failing "
                                         f"since {_utc(self.media_error_since)} ({self.media_error.message}); "
                                         f"{pages} pages ({nbytes} bytes) wait in device DRAM to be flushed; writes "
                                         f"resume when space returns and a flush retry succeeds")
        pages = self._pages(addr, length)
        new_pages = sum(1 for p in pages if self.policy.write_lookup(p) is None)
        if new_pages > self.cfg.write_buffer_frames > 0:
            raise ChmError(errno.EINVAL, f"write of {length} bytes at {addr} spans {new_pages} pages, more than the whole "
                                         f"write buffer ({self.cfg.write_buffer_frames} pages): split it")
        if not self.policy.admit_writes(new_pages):
            self.stats["refused_writes"] += 1
            self.stats["refused_write_bytes"] += length
            raise WriteBufferFull(f"write of {length} bytes at {addr} needs {new_pages} write-buffer pages; "
                                  f"the buffer has no room until a flush completes")
        self.stats["write_bytes"] += length
        arrived = self.timing.link_to_device.transfer(now, length)  # a refused write moves no payload
        t = self._cycles(arrived, self.cfg.controller.cycles_per_command + len(pages) * self.cfg.controller.cycles_per_admission)
        finish = t
        for page in pages:
            lo = max(addr, page * self.page) - page * self.page
            hi = min(addr + length, (page + 1) * self.page) - page * self.page
            src = None if data is None else data[page * self.page + lo - addr: page * self.page + hi - addr]
            finish = max(finish, self._write_page(page, lo, hi, src, t))
        if whole:
            self.count_command("write", finish - now)
        return finish

    def _write_page(self, page: int, lo: int, hi: int, src: memoryview | None, now: float) -> float:
        frame = self.policy.write_lookup(page)
        ready = now
        if frame is None:
            ins = self.policy.allocate_write(page)
            if ins is None:
                now = max(now, self._complete_flights(float("inf")))
                ins = self.policy.allocate_write(page)
                if ins is None:
                    raise ChmError(errno.EBUSY, f"no DRAM frame can be evicted to write page {page}: all are pinned")
            frame = ins.frame
            if ins.victim_page is not None:
                self.stats["evictions"] += 1
                if ins.victim_dirty:
                    ready = self._write_back_victim(frame, ins.victim_page, now)
            self._settle(frame)
            self.read_error.pop(frame, None)
            self.ready_at[frame] = now
            if hi - lo < self.page:  # partial page: the rest must come from DRAM's staged copy or the media
                ready = max(ready, self._fill_partial(frame, page, now))
        else:
            self._settle(frame)
            if frame in self.read_error:
                if hi - lo < self.page:
                    self._check_read(frame)  # the rest of the page could not be read: nothing to merge with
                del self.read_error[frame]  # the write supplies every byte
            self._wait_flush_of(frame)
            self.policy.touch(frame)
        copy = self.policy.read_copy(page)
        for target in {frame, copy} - {None}:
            self._settle(target)
            if src is not None:
                self._frame_view(target, lo, hi)[:] = src
        self.write_seq[frame] += 1
        self.policy.mark_dirty(frame)
        if not self.queued[frame]:
            self.queued[frame] = 1
            self.dirty.append((frame, now))
        return self.timing.dram.transfer(max(ready, self.ready_at[frame]), hi - lo)

    def _fill_partial(self, frame: int, page: int, now: float) -> float:
        copy = self.policy.read_copy(page)
        if copy is not None and copy != frame:
            self._settle(copy)
            if self.data:
                self._frame_view(frame)[:] = self._frame_view(copy)
            return max(now, self.ready_at[copy])
        self.stats["rmw_reads"] += 1
        done = self._ssd_of(page).read(now, self.page)
        self.stats["ssd_read_bytes"] += self.page
        token = self._media_io(SsdBackend.READ, frame, page)
        if token is not None:
            try:
                self.backend.wait(token)
            except MediaIOError as exc:  # the frame holds no valid copy of the page: give it up, fail the write
                self.stats["read_failures"] += 1
                self.policy.flushed(frame)  # not dirty; hymcache returns the write-buffer frame
                if self.policy.page_of(frame) is not None:
                    self.read_error[frame] = exc  # lru: dropped once unpinned
                raise ChmError(exc.errno, f"write needs the rest of page {page} from the media: {exc.message}") from None
        return done

    def _wait_flush_of(self, frame: int) -> None:
        """A write to a frame whose flush is in flight: the bytes must not change under the media write."""
        if not self.data:  # no media writes to wait for
            return
        for _, _, flight in self.flights:
            if frame in flight.frames:
                self._land(flight)

    # ---- prefetch ----------------------------------------------------------------
    def prefetch(self, addr: int, size: int, now: float) -> tuple[int, float]:
        """Stage an object; returns (handle, time the command is acknowledged)."""
        self.check_range(addr, size, "size")
        self.tick(now)
        pages = self._pages(addr, size)
        handle = self._next_handle
        self.engine.issue(handle, pages.start, len(pages))
        self._next_handle += 1
        self.stats["prefetches"] += 1
        self.stats["prefetch_bytes"] += size
        t = self._cycles(now, self.cfg.controller.cycles_per_command)
        frames, ready_at = [], t
        while (fetch := self.engine.next_fetch()) is not None:
            page = fetch[1]
            t = self._cycles(t, self.cfg.controller.cycles_per_prefetch_page)
            frame = self.policy.staged_lookup(page)
            if frame is None and self.policy.lookup(page) is not None:
                self.stats["prefetch_resident_pages"] += 1  # newest data sits in the write buffer
                continue
            if frame is None:
                self.stats["prefetch_staged_pages"] += 1
                frame = self._stage(page, t)
            else:
                self.stats["prefetch_resident_pages"] += 1
                self.policy.touch(frame)
            self.policy.pin(frame)
            frames.append(frame)
            ready_at = max(ready_at, self.ready_at[frame])
        self.staged[handle] = Staged(frames, ready_at)
        if self.data:
            self.backend.poll()  # get the reads going now
        return handle, t + self.cfg.host_link.latency_ns

    def wait(self, handle: int, now: float, timeout_ns: float | None = None) -> float:
        """Until the object is staged; returns when the host learns it (virtual time)."""
        obj = self.engine.get(handle)
        staged = self.staged[handle]
        if timeout_ns is not None and staged.ready_at > now + timeout_ns:
            raise ChmError(errno.ETIMEDOUT, f"prefetch handle {handle} not staged within {timeout_ns / 1e6:g} ms "
                                            f"(ready in {(staged.ready_at - now) / 1e6:.3f} ms of modelled time)")
        for frame in staged.frames:
            self._settle(frame)
        for frame in staged.frames:
            self._check_read(frame)
        while obj.arrived < obj.pages:
            self.engine.arrived(handle)
        self.tick(now)
        return max(now, staged.ready_at) + self.cfg.host_link.latency_ns

    def release(self, handle: int, now: float) -> float:
        self.engine.release(handle)
        self.stats["releases"] += 1
        for frame in self.staged.pop(handle).frames:
            self._settle(frame)
            self.policy.unpin(frame)
            self.policy.released(frame)
        self.tick(now)
        return self._cycles(now, self.cfg.controller.cycles_per_command) + self.cfg.host_link.latency_ns

    # ---- lifecycle -------------------------------------------------------------------
    def snapshot(self) -> dict:
        self.fold_native_counts()
        s = dict(self.stats)
        s["dirty_pages"] = len(self.dirty)
        s["flushes_in_flight"] = len(self.flights)
        s["prefetch_pages_held"] = self.engine.pages_held
        s["busy_ns"] = self.timing.busy()
        s["latency"] = self.timing.latencies.summary()
        s["slowed_reads"] = sum(x.slowed_reads for x in self.timing.ssds)
        s["policy_counters"] = self.policy.counters()  # the policy's own events (libcachesim: its divergences)
        if self.backend is not None:
            s["direct_io"] = self.backend.direct
        s["device_epoch"] = self.device_epoch
        s["unclean_shutdown"] = self.unclean_shutdown
        err = self.media_error
        s["media_error"] = None if err is None else {"errno": err.errno, "message": err.message,
                                                     "since": _utc(self.media_error_since)}
        return s

    def close(self, now: float, drain_timeout_s: float | None = DRAIN_TIMEOUT_S) -> float:
        """Drain the write buffer onto the media and release everything; returns the drain's finish.

        Bounded: while flushes fail it retries (backoff) for at most ``drain_timeout_s`` seconds of wall
        time (None: until they succeed), then raises UnflushedData naming the pages and bytes left and the
        media error -- after releasing everything. The media are marked cleanly shut down only when
        nothing was left."""
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        done, left = now, None
        while True:
            try:
                done, left = self.flush(now), None
                break
            except ChmError as exc:
                if not self.dirty:  # fdatasync failed: nothing to retry here
                    left = exc
                    break
                left = exc
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                time.sleep(self._retry_delay_s if remaining is None else min(self._retry_delay_s, remaining))
        pages, nbytes = self._unflushed()
        try:
            for handle in list(self.staged):
                self.release(handle, done)
            if self.backend is not None:
                self.backend.close(clean=left is None)
        finally:
            if self.dram is not None:
                self.native_dev.dram = ffi.NULL  # no read may reach the region once it is unmapped
                self.dram.close()
                self.dram = None
        if left is not None:
            raise UnflushedData(pages, nbytes, left) if pages else left
        return done
