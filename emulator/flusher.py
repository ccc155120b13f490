"""The flusher: the dirty queue, flush writes in flight, and what happens when the media fail.

Background work is event-driven: it is due when a flush lands or when the policy's flush rule starts
to grant (``next_event_ns``); ``run_until`` does each at its own virtual time, so idle spans cost
nothing. Every command also ticks at its start.

Media errors. A flush write that fails (ENOSPC, EIO) leaves its pages dirty,
queued and pinned in DRAM (reads keep being served from there); the device
enters a media-error state: new writes are refused with ENOSPC and the
background flusher retries after a wall-time backoff (``MEDIA_RETRY_FIRST_S``,
doubling, at most ``MEDIA_RETRY_MAX_S``). A successful flush clears the state.
Each episode and its recovery is logged once.

Native mode. With data off and a policy whose flush rule and write path the native core has (the built-in
frame-table caches: ``CachePolicy``'s rule; ``hymcache``: ``FlushArbiter``'s), the controller hands the
flusher's state to C (``go_native``: ``struct chm_flusher`` of emulator/native/chm_core.h, which the
controller's data-off writes and reads use too): the dirty queue, the flights, their counters. The methods
below then run there (``tick``, ``run_until``, ``next_event_ns``, ``quiet_until``, ``flush``,
``complete_flights``, ``write_back``), and ``dirty_entries``/``flight_entries``/``flight_counts`` show the
state; ``queued`` is shared. Native or Python is chosen once, when the controller is built (``dev``); a
test that watches or replaces a method builds the Python path explicitly (``to_python``, before its first
operation). A call from outside into the Python-only steps (``enqueue``, ``start_flush``) brings the state back
to Python for good.
"""

from __future__ import annotations

import errno
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

from .config import Config
from .dram import Frames
from .errors import ChmError
from .media_io import MediaIO
from .native import ffi, lib
from .policies import Policy
from .ssd import MediaIOError
from .timing import TimingModel

MEDIA_RETRY_FIRST_S = 1.0  # wall time before the flusher retries after a media error; doubles per failure
MEDIA_RETRY_MAX_S = 30.0  # ... up to this


def utc(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))


@dataclass
class Flight:
    """A flush write in flight: frames written, the seq each had, when it lands."""

    frames: list[int]
    seqs: list[int]
    token: int | None
    finish: float
    since: list[float] = field(default_factory=list)  # each frame's write time, to requeue it if the write fails
    error: ChmError | None = None  # the media error the write completed with
    generation: int = 0  # Flusher._generation when issued: only a retry's failure doubles the backoff



def no_flush_granted(policy: str, due: float) -> RuntimeError:
    """A policy whose flush rule said a flush is due at ``due`` but granted none: run_until would loop there."""
    return RuntimeError(f"policy {policy!r}: next_flush_at said a flush is due at {due!r} ns "
                        f"but flush_grant granted none (and no flush landed)")

class Flusher:
    """Owns the dirty queue (``dirty``, ``queued``), the flush writes in flight (``flights``), the background
    clock (``background_ns``, ``events_run``) and the media-error state (``media_error``, the backoff).

    The policy decides when and how much to flush (``flush_grant``, ``next_flush_at``, its bound on pages in
    flight); the writes go through ``MediaIO``; a flush that lands marks its frames clean in the policy unless
    a newer write came (``Frames.write_seq``)."""

    def __init__(self, cfg: Config, policy: Policy, timing: TimingModel, media: MediaIO, frames: Frames,
                 stats: dict, log):
        self.data = cfg.emulation.data  # real media writes to wait for
        self.page = cfg.device.page_size_bytes
        self.policy, self.timing, self.media, self.frames, self.stats, self.log = \
            policy, timing, media, frames, stats, log
        self.read_error = frames.read_error  # the same dict: tick drops failed reads' frames
        self.queued = bytearray(len(frames.ready_at))  # frame is in the dirty queue
        self.dirty: deque[tuple[int, float]] = deque()  # (frame, write time), oldest first
        self.flights: list[tuple[float, int, Flight]] = []  # min-heap of (finish, issue order, flight)
        self._flight_order = 0
        self._flushing_pages = 0  # pages in self.flights
        self._flight_room: tuple[tuple[int, int], float] = ((-1, -1), 0.0)  # _flight_room_at's cache
        self.background_ns = 0.0  # virtual time up to which run_until has done the background work
        self.events_run = 0  # background events run_until has run (flush landings, flush grants)
        self.media_error: ChmError | None = None  # set while flushes fail; new writes are refused
        self.media_error_since = 0.0  # wall time (time.time()) the episode began
        self._retry_delay_s = MEDIA_RETRY_FIRST_S
        self._retry_at = 0.0  # time.monotonic() before which the background flusher does not retry
        self._held_dirty: set[int] = set()  # dirty frames kept pinned while the media fail, until flushed
        self._failed_frames: set[int] = set()  # frames whose last flush failed; the error clears when none is left
        self._generation = 0  # bumped at each backoff step
        self.dev = None  # native mode: the controller's struct chm_dev, whose flusher holds the state (go_native)
        self._native = None  # native mode: (struct chm_flusher, fold, the buffers it points into)
        self._due, self._ran = ffi.new("double *"), ffi.new("uint64_t *")  # the native calls' results

    # ---- native mode (module docstring) ----------------------------------------------
    def go_native(self, dev, fold) -> None:
        """Hand the (empty) state to C: ``dev`` is the controller's ``struct chm_dev``; ``fold()`` adds what
        the native core counted to ``stats``."""
        policy = self.policy
        out = ffi.new("struct chm_flusher **")
        queued = ffi.from_buffer("uint8_t[]", self.queued)
        if lib.chm_flusher_new(len(self.queued), queued, out):
            raise MemoryError("native flusher")
        fl = ffi.gc(out[0], lib.chm_flusher_free)
        keep = [queued]
        from .policies.hymcache import HymCachePolicy
        if isinstance(policy, HymCachePolicy):
            arbiter = policy.arbiter
            fl.rule, fl.batch_pages = lib.CHM_FLUSH_ARBITER, arbiter.batch_pages
            fl.max_reads_in_flight, fl.max_delay_ns = arbiter.max_reads_in_flight, arbiter.max_delay_ns
            write, copy = policy.write_area, policy.read_area
            fl.copy_area.table, fl.copy_area.base = copy.table._c, copy.base
            fl.admission = policy.admission._c
            fwu = ffi.from_buffer("uint8_t[]", policy._free_when_unpinned)
            keep.append(fwu)
            fl.free_when_unpinned = fwu
        else:
            fl.rule, fl.writeback_delay_ns = lib.CHM_FLUSH_AFTER_DELAY, policy.cfg.policy.lru_writeback_delay_ns
            write = policy.read_area
        limit = policy.flush_pages_in_flight
        fl.pages_in_flight_limit = -1 if limit is None else limit
        fl.write_area.table, fl.write_area.base = write.table._c, write.base
        fl.write_area_frames = write.end - write.base
        fl.write_buffer_frames = policy.cfg.write_buffer_frames
        fl.drops_staged_on_release = policy.drops_staged_on_release
        dev.flusher = fl
        self.dev = dev
        self._native = (fl, fold, keep)

    def to_python(self) -> None:
        """The state back to Python, for good (a no-op there)."""
        if self.dev is None:
            return
        fl, fold = self._native[0], self._native[1]
        fold()
        dirty, flights = self.dirty_entries(), self.flight_entries()
        self.dev.flusher = ffi.NULL
        self.dev = None
        self.dirty, self.flights = dirty, flights
        self._flight_order, self._flushing_pages = fl.flight_order, fl.flushing_pages
        self._flight_room = ((-1, -1), 0.0)
        self._native = None

    def _fold(self) -> None:
        self._native[1]()

    def dirty_entries(self) -> deque:
        """The dirty queue: (frame, write time), oldest first."""
        if self.dev is None:
            return self.dirty
        fl = self._native[0]
        entry_frame, entry_since = ffi.new("uint32_t *"), ffi.new("double *")
        out = deque()
        for i in range(fl.n_dirty):
            lib.chm_flusher_dirty_at(fl, i, entry_frame, entry_since)
            out.append((entry_frame[0], entry_since[0]))
        return out

    def flight_entries(self) -> list:
        """The flush writes in flight: (finish, issue order, Flight), a heap."""
        if self.dev is None:
            return self.flights
        fl = self._native[0]
        out = [(f.finish, f.order, Flight(list(range(f.frame, f.frame + f.pages)), ffi.unpack(f.seqs, f.pages),
                                          None, f.finish, ffi.unpack(f.since, f.pages)))
               for f in (fl.flights[i] for i in range(fl.n_flights))]
        heapq.heapify(out)
        return out

    def pending(self) -> tuple[int, int]:
        """(dirty pages queued, flush writes in flight)."""
        if self.dev is None:
            return len(self.dirty), len(self.flights)
        fl = self._native[0]
        return fl.n_dirty, fl.n_flights

    def flight_counts(self) -> tuple[int, int]:
        """(flush writes issued so far, pages in flight): ``_flight_order``, ``_flushing_pages``."""
        if self.dev is None:
            return self._flight_order, self._flushing_pages
        fl = self._native[0]
        return fl.flight_order, fl.flushing_pages

    # ---- the dirty queue ---------------------------------------------------------
    def enqueue(self, frame: int, now: float) -> None:
        """``frame`` was written at ``now``: queue it for flushing, unless it waits already."""
        if self.dev is not None:  # the state's own calls are native: one from outside brings it back here
            self.to_python()
        if not self.queued[frame]:
            self.queued[frame] = 1
            self.dirty.append((frame, now))

    def _unqueue(self, frame: int) -> None:
        if self.dev is not None:
            self.to_python()
        if self.queued[frame]:
            self.queued[frame] = 0
            self.dirty = deque(e for e in self.dirty if e[0] != frame)

    def unflushed(self) -> tuple[int, int]:
        """(pages, bytes) acknowledged but not yet on the media."""
        pages = self.pending()[0]
        return pages, pages * self.page

    def write_back(self, frame: int, victim_page: int, now: float) -> float:
        """An evicted page was dirty (lru): write it to flash before its frame is reused; returns when done."""
        dev = self.dev
        if dev is not None:
            done = lib.chm_dev_write_back(dev, frame, victim_page, now)
            self._fold()
            return done
        self.stats["dirty_evictions"] += 1
        self._unqueue(frame)
        done, token = self.media.write(frame, victim_page, 1, now)
        if token is not None:
            try:
                self.media.wait(token)
            except MediaIOError as exc:  # the frame is already the new page's: the victim's data is gone
                self.stats["lost_pages"] += 1
                self.log(f"media error writing back evicted dirty page {victim_page}: its data is lost: {exc.message}")
                self._media_failed(exc)
        return done

    # ---- background work -----------------------------------------------------------
    def tick(self, now: float, force: bool = False) -> None:
        """Background work at virtual time ``now``: retire finished flushes, start new ones."""
        dev = self.dev
        if dev is not None:
            rc = lib.chm_dev_tick(dev, now, force)
            if rc:
                if rc < 0:
                    raise MemoryError("native flusher: no memory")
                self._fold()
            return
        self.complete_flights(now)
        if self.read_error:
            self.frames.drop_failed_reads(self.queued)
        if not force and self._held():
            return
        while self.dirty:
            n = self.policy.flush_grant(self.dirty, now, self.timing.reads_in_flight(now), force)
            if n == 0:
                return
            self.start_flush([self.dirty.popleft() for _ in range(n)], now)
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

    def _held(self) -> bool:
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
        dev = self.dev
        if dev is not None:
            due_p = self._due
            if not lib.chm_dev_next_event(dev, now, due_p):
                return None
            due = due_p[0]
            if due != due:
                raise MemoryError("native flusher: no memory")
            return due
        due = None
        if self.data and self.flights:
            due = self.flights[0][0]
        elif self.dirty and self._at_flight_limit():
            due = self._flight_room_at()
        if self.dirty and not self._held():
            timing = self.timing
            grant = self.policy.next_flush_at(self.dirty, now, lambda n: timing.reads_idle_at(now, n))
            if grant is not None and (due is None or grant < due):
                due = grant
        return None if due is None else max(now, due)

    def run_until(self, until: float) -> int:
        """Do the background work due up to virtual time ``until``, each event at its own time, from where
        the background clock stands (it only moves forward); returns how many events ran.

        The replay driver calls it before each command, ``chm serve`` after each idle sleep."""
        dev = self.dev
        if dev is not None:
            ran_p, t_p = self._ran, self._due
            rc = lib.chm_dev_run_until(dev, self.background_ns, until, ran_p, t_p)
            ran, t = ran_p[0], t_p[0]
            if ran:
                self._fold()
            if rc == lib.CHM_E_INTERNAL:
                raise no_flush_granted(self.policy.name, t)
            if rc:
                raise MemoryError("native flusher: no memory")
            self.background_ns = max(t, until)
            self.events_run += ran
            return ran
        t, ran = self.background_ns, 0
        while (due := self.next_event_ns(t)) is not None and due <= until:
            before = (self.stats["flush_batches"], len(self.flights))
            self.tick(due)
            if (self.stats["flush_batches"], len(self.flights)) == before:  # would loop forever at `due`
                raise no_flush_granted(self.policy.name, due)
            t, ran = due, ran + 1
        self.background_ns = max(t, until)
        self.events_run += ran
        return ran

    def quiet_until(self, now: float) -> float:
        """A virtual time before which ``tick`` has nothing to do, from ``now`` on, as long as only DRAM-hit
        reads run (they start no media I/O, dirty no page and land no flush): a command starting in
        [now, quiet_until) may skip its tick, as ``chm serve``'s native hit path does. -inf: ``tick`` may
        act at any time (staging reads that failed wait to be dropped, or the media fail)."""
        if self.read_error or self.media_error is not None:
            return -math.inf
        dev = self.dev
        if dev is not None:
            return lib.chm_dev_quiet_until(dev, now)
        until = self.flights[0][0] if self.flights else math.inf  # a flush lands: tick retires it
        if self.dirty and not self._at_flight_limit():  # at the limit, nothing starts before a flush lands
            timing = self.timing
            grant = self.policy.next_flush_at(self.dirty, now, lambda n: timing.reads_idle_at(now, n))
            if grant is not None and grant < until:
                until = grant
        return until

    # ---- flush writes ----------------------------------------------------------------
    def start_flush(self, entries: list[tuple[int, float]], now: float) -> None:
        """Write the dirty ``entries`` ((frame, write time)) to the media."""
        if self.dev is not None:
            self.to_python()
        self.stats["flush_batches"] += 1
        since = dict(entries)
        page_of = self.policy.page_of
        frames = sorted(since, key=page_of)
        run: list[int] = []
        before_snapshot = self.frames.before_snapshot
        for frame in frames:
            self.queued[frame] = 0
            if before_snapshot is not None:
                before_snapshot(frame)
            if frame in self._held_dirty:  # pinned since its last flush failed: the flight takes that pin over
                self._held_dirty.discard(frame)
            else:
                self.policy.pin(frame)
            if run and not (frame == run[-1] + 1 and self.media.contiguous(page_of(run[-1]), page_of(frame))):
                self._write_run(run, now, since)  # the next frame is elsewhere in DRAM or on the media
                run = []
            run.append(frame)
        if run:
            self._write_run(run, now, since)

    def _write_run(self, run: list[int], now: float, since: dict[int, float]) -> None:
        finish, token = self.media.write(run[0], self.policy.page_of(run[0]), len(run), now)
        self._flight_order += 1
        self._flushing_pages += len(run)
        write_seq = self.frames.write_seq
        flight = Flight(run, [write_seq[f] for f in run], token, finish, [since[f] for f in run],
                        generation=self._generation)
        heapq.heappush(self.flights, (finish, self._flight_order, flight))
        self.stats["flushed_pages"] += len(run)

    def complete_flights(self, now: float) -> float:
        """Retire flushes that have landed by ``now``; returns the latest finish retired."""
        dev = self.dev
        if dev is not None:
            latest = lib.chm_dev_complete_flights(dev, now)
            if latest != latest:
                raise MemoryError("native flusher: no memory")
            return latest
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
                write_seq = self.frames.write_seq
                for frame, seq in zip(flight.frames, flight.seqs):
                    self.policy.unpin(frame)
                    if write_seq[frame] == seq and not self.queued[frame]:
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
                self.media.wait(token)
            except MediaIOError as exc:
                flight.error = exc

    def wait_flush_of(self, frame: int) -> None:
        """A write to a frame whose flush is in flight: the bytes must not change under the media write."""
        if not self.data:  # no media writes to wait for
            return
        for _, _, flight in self.flights:
            if frame in flight.frames:
                self._land(flight)

    def flush(self, now: float) -> float:
        """Drain everything written to the media; returns when it is there (virtual time).

        Tries at once, whatever the media-error backoff says; raises the media error (ENOSPC, EIO, with
        the file) if pages remain unflushed -- they stay dirty in DRAM and are retried."""
        dev = self.dev
        if dev is not None:
            done = lib.chm_dev_flush(dev, now)
            self._fold()
            if done != done:
                raise MemoryError("native flusher: no memory")
            return done
        self.stats["flush_calls"] += 1
        self.tick(now, force=True)
        done = max([now] + [entry[0] for entry in self.flights])
        self.complete_flights(float("inf"))
        if self.dirty and self.media_error is not None:
            pages, nbytes = self.unflushed()
            raise ChmError(self.media_error.errno, f"flush incomplete: {pages} pages ({nbytes} bytes) are not on the "
                                                   f"media (they stay in device DRAM and are retried): "
                                                   f"{self.media_error.message}")
        self.media.sync()
        return done

    def drain(self, now: float, timeout_s: float | None) -> tuple[float, ChmError | None]:
        """Flush, retrying (with the backoff's delays) while the media fail, for at most ``timeout_s`` seconds
        of wall time (None: until it succeeds); returns (when the last flush finished, the error that was left
        or None)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return self.flush(now), None
            except ChmError as exc:
                if not self.pending()[0]:  # fdatasync failed: nothing to retry here
                    return now, exc
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return now, exc
                time.sleep(self._retry_delay_s if remaining is None else min(self._retry_delay_s, remaining))

    # ---- media errors ------------------------------------------------------------------
    def refuse_write(self, what: str) -> ChmError:
        """The error refusing ``what`` (a write) while the media fail."""
        pages, nbytes = self.unflushed()
        return ChmError(errno.ENOSPC, f"{what} refused: the media are full or failing since "
                                      f"{utc(self.media_error_since)} ({self.media_error.message}); {pages} pages "
                                      f"({nbytes} bytes) wait in device DRAM to be flushed; writes resume when "
                                      f"space returns and a flush retry succeeds")

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
            pages, nbytes = self.unflushed()
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
