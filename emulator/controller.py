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
``chm_dev_read_hit`` (emulator/native/chm_core.c) when the policy looks pages up and counts hits in
native frame tables: the same steps as ``read`` below, over the same state (``ready_at``,
``io_token``, the timing pipes and the read latency histogram are native memory both sides use).
``chm serve`` calls it straight from its C loop; its counts reach ``stats`` at the next read or
``snapshot``.

Native sequential path. ``run_sequential(kinds, addrs, lengths, now)`` runs a list of operations one after
another, as ``chm replay --sequential`` issues them: a read (``read(addr, length, now)``, then ``now`` is its
finish) or a write followed by a flush (``write(addr, None, length, now)``, then ``now = flush(finish)``).
With data off, a built-in frame-table policy without a write buffer (lru, fifo, clock, s3fifo, sieve) and the
device settled (nothing dirty or in flight, no frame pinned, no prefetch held, no media or staging-read
error), ``chm_dev_run_sequential`` (emulator/native/chm_core.c) runs them in C over the same state: the
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
``chm_dev_prefetch_fetch``, ``chm_dev_release_frames``, ``chm_dev_tick``, ... (emulator/native/chm_core.c;
``chm_dev_run_sequential`` is made of the same functions): the same steps over the same state as the Python
below (tests/emulator/test_native_ops.py holds them to it); what they count is folded into ``stats`` as
each call returns. A method of the flusher or the policy replaced on the instance, or a media or
staging-read error set by hand, brings the state back to Python for good (``Flusher._demote``).

Outcomes. ``read``, ``write`` and ``prefetch`` return what they did (``ReadOutcome``, ``WriteOutcome``,
``PrefetchOutcome``): the finish (or acknowledgement) time and the pages they counted in ``stats``, so a
caller never diffs ``stats`` nor looks into the policy or the prefetch engine. A refused write raises
``WriteBufferFull`` with ``new_pages``, the write-buffer pages it asked for.
"""

from __future__ import annotations

import errno
import os
import sys
from array import array
from dataclasses import dataclass
from typing import NamedTuple

from driver.wire import STATS_COUNTERS

from .config import Config
from .dram import NO_TOKEN, DramRegion, Frames
from .errors import ChmError, WriteBufferFull
from .flusher import Flusher, utc
from .media_io import MediaIO
from .native import ffi, lib
from .policies import make_policy
from .prefetch import PrefetchEngine
from .ssd import MediaIOError, SsdBackend
from .timing import TimingModel

MAX_CHUNK_PAGES = 64  # a large read is staged and copied in chunks of at most this many pages
DRAIN_TIMEOUT_S = 30.0  # default bound on close()'s drain while the media fail (chm serve --drain-timeout)
UNCLEAN_SHUTDOWN_MESSAGE = "unclean shutdown: writes acknowledged but not flushed before it may be lost"
# The stats the native hit read counts: struct chm_read_counts's fields, in its order.
NATIVE_READ_COUNTS = tuple(name for name, _ in ffi.typeof("struct chm_read_counts").fields)
_ZERO_COUNTS = memoryview(array("Q", bytes(8 * len(NATIVE_READ_COUNTS))))
_read_hit = lib.chm_dev_read_hit
_tuple_new = tuple.__new__  # an outcome made without NamedTuple.__new__'s Python frame: the hot path makes one per call


def _fold_counts(stats: dict, counts: memoryview, names: tuple, zero: memoryview) -> None:
    """Add native counters (``counts``, in the order of ``names``) to ``stats`` and zero them."""
    values = counts.tolist()
    if any(values):
        for name, n in zip(names, values):
            if n:
                stats[name] += n
        counts[:] = zero


def _all_pinned(what: str, page: int) -> ChmError:
    return ChmError(errno.EBUSY, f"no DRAM frame can be evicted to {what} page {page}: all are pinned")


def _write_too_big(addr: int, length: int, new_pages: int, buffer_pages: int) -> ChmError:
    return ChmError(errno.EINVAL, f"write of {length} bytes at {addr} spans {new_pages} pages, more than the whole "
                                  f"write buffer ({buffer_pages} pages): split it")


def _write_refused(addr: int, length: int, new_pages: int) -> WriteBufferFull:
    return WriteBufferFull(f"write of {length} bytes at {addr} needs {new_pages} write-buffer pages; the buffer has "
                           f"no room until a flush completes", new_pages=new_pages)


def _log_to_stderr(message: str) -> None:
    print(f"chm: {message}", file=sys.stderr, flush=True)


class ReadOutcome(NamedTuple):
    """What a read did: when its last byte reached the host, and its pages by how DRAM held them (the
    ``page_hits``, ``page_misses`` and ``merged_misses`` it counted). A read served by the native hit path
    is all hits: it serves only pages resident and ready."""

    finish: float
    hit_pages: int  # resident and ready
    missed_pages: int  # staged from the media by this read
    merged_pages: int  # resident but still being staged (by an earlier read or prefetch): waited for


class WriteOutcome(NamedTuple):
    """What an accepted write did: when it finished, its pages by whether the write path already had a
    frame for them, and the write buffer's pages in use after it (0 for a policy without one)."""

    finish: float
    new_pages: int  # needed a new frame (admitted into the write buffer, for a policy with one)
    overwritten_pages: int  # already had a frame on the write path
    write_buffer_pages: int


class PrefetchOutcome(NamedTuple):
    """What an accepted prefetch did: its handle, when the host learns it, its pages by whether it staged
    them (``prefetch_staged_pages``) or found them resident (``prefetch_resident_pages``), and the pages
    the device's prefetch window holds after it (``snapshot()["prefetch_pages_held"]``)."""

    handle: int
    ack: float
    staged_pages: int
    resident_pages: int
    window_pages_held: int


class SequentialOutcome(NamedTuple):
    """What ``run_sequential`` did: when the last operation finished, the pages its writes needed a new frame
    for (their ``WriteOutcome.new_pages``, summed: with the reads' ``page_misses``, the cache misses), and
    how many of the operations the native path ran (the others went through read, write and flush)."""

    finish: float
    write_misses: int
    native_ops: int


SEQ_READ, SEQ_WRITE = lib.CHM_SEQ_READ, lib.CHM_SEQ_WRITE
_SEQ_KINDS = {"read": SEQ_READ, "write": SEQ_WRITE, SEQ_READ: SEQ_READ, SEQ_WRITE: SEQ_WRITE}
_SEQ_BAD_KIND = 255  # the native path stops there; the Python step says why
# The stats the native sequential path counts besides the hit read's: struct chm_seq_counts's fields.
NATIVE_SEQ_COUNTS = tuple(name for name, _ in ffi.typeof("struct chm_seq_counts").fields)
_run_sequential = lib.chm_dev_run_sequential
_dev_read, _dev_write, _dev_prefetch_fetch = lib.chm_dev_read, lib.chm_dev_write, lib.chm_dev_prefetch_fetch
_ZERO_SEQ_COUNTS = memoryview(array("Q", bytes(8 * len(NATIVE_SEQ_COUNTS))))
# The policy calls chm_dev_run_sequential makes itself (CachePolicy's, over its one frame table).
_SEQ_POLICY_METHODS = ("lookup", "staged_lookup", "write_lookup", "read_copy", "page_of", "is_dirty", "touch", "pin",
                       "unpin", "pins", "mark_dirty", "drop", "allocate_clean", "admit_writes", "allocate_write",
                       "flushed", "flush_grant", "native_lookup_areas")


def sequential_ops(ops) -> tuple[bytes, array, array]:
    """``(kind, addr, length)`` operations (kind ``"read"`` or ``"write"``, as ``Replay.ops`` records them) as
    ``run_sequential``'s three arrays."""
    kinds = bytes(_SEQ_KINDS.get(kind, _SEQ_BAD_KIND) for kind, _, _ in ops)
    return kinds, array("Q", [addr for _, addr, _ in ops]), array("Q", [length for _, _, length in ops])


def _seq_buffer(values, fmt: str):
    """``values`` as a C-contiguous buffer of ``fmt`` items (kept, or converted); None when they are not all
    plain non-negative integers that fit (the Python calls then say what is wrong)."""
    try:
        view = memoryview(values)
    except TypeError:
        view = None
    if view is not None and view.c_contiguous and view.ndim == 1 and view.itemsize == array(fmt).itemsize \
            and view.format.lstrip("<=@") in ((fmt,) if fmt == "B" else (fmt, "L")):
        return view  # unsigned: used in place
    if fmt == "B":
        return bytes(_SEQ_KINDS.get(kind, _SEQ_BAD_KIND) for kind in values)
    values = view.tolist() if view is not None else values
    if any(type(v) is not int for v in values):  # a bool or a float: check_range names it
        return None
    try:
        return array(fmt, values)
    except OverflowError:  # a negative one
        return None


def _policy_runs_sequentially(policy) -> bool:
    """Is ``policy`` a built-in frame-table cache the native sequential path runs as the policy would: a
    CachePolicy over one native table of lru, fifo, clock, s3fifo or sieve, nothing of it overridden?"""
    from .policies.base import CachePolicy
    from .policies.clock import ClockOrder
    from .policies.fifo import FifoOrder
    from .policies.lru import LruOrder
    from .policies.s3fifo import S3FifoOrder
    from .policies.sieve import SieveOrder

    cls = type(policy)
    if not isinstance(policy, CachePolicy) or cls.eviction not in (LruOrder, FifoOrder, ClockOrder, S3FifoOrder,
                                                                    SieveOrder):
        return False
    if any(getattr(cls, name) is not getattr(CachePolicy, name) for name in _SEQ_POLICY_METHODS):
        return False
    table = policy.read_area.table
    bound = {"lookup": table.lookup, "staged_lookup": table.lookup, "write_lookup": table.lookup,
             "touch": table.touch, "pin": table.pin, "unpin": table.unpin, "mark_dirty": table.mark_dirty,
             "allocate_clean": table.insert}  # CachePolicy._bind_fast_paths
    if any(name in _SEQ_POLICY_METHODS and value != bound.get(name) for name, value in vars(policy).items()):
        return False
    return (policy.areas == [policy.read_area] and policy.native_lookup_areas() == [policy.read_area]
            and not table.plugin and table.sets == 1 and policy.flush_pages_in_flight is None
            and policy.write_buffer_pages == 0 and not policy.splits_dram)


def _hymcache_runs_natively(policy) -> bool:
    """Is ``policy`` the built-in hymcache, nothing of it replaced, over native tables (its flush rule, write
    admission and write path are then the native core's)?"""
    from .policies.hymcache import HymCachePolicy
    from .write_buffer import FlushArbiter, WriteAdmission

    if type(policy) is not HymCachePolicy or type(policy.arbiter) is not FlushArbiter \
            or type(policy.admission) is not WriteAdmission:
        return False
    if any(callable(value) for value in vars(policy).values()):
        return False
    areas = policy.native_lookup_areas()
    return (areas == [policy.write_area, policy.read_area] and policy.areas == areas[::-1]
            and type(policy.write_area).lookup is type(policy.read_area).lookup
            and all(type(area).insert is type(policy.read_area).insert for area in areas))


class UnflushedData(ChmError):
    """close() gave up draining: ``pages`` pages (``nbytes`` bytes) acknowledged but never flushed are lost;
    ``error`` is the media error that kept them off the media."""

    def __init__(self, pages: int, nbytes: int, error: ChmError):
        super().__init__(error.errno, f"{pages} pages ({nbytes} bytes) of acknowledged writes were left unflushed "
                                      f"(lost): {error.message}")
        self.pages, self.nbytes, self.error = pages, nbytes, error


@dataclass
class Staged:
    """What the controller keeps per prefetch handle (the engine keeps the window)."""

    frames: list[int]  # pinned read frames, in page order
    ready_at: float


class Controller:
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

    def _native_read_setup(self) -> None:
        """The native DRAM-hit read's view of this controller (``native_read``, ``native_dev``)."""
        dev = self.native_dev = ffi.new("struct chm_dev *")
        timing, ctl, frames = self.timing, self.cfg.controller, self.frames
        self._native_keep = [ffi.from_buffer("double[]", self.ready_at), ffi.from_buffer("int64_t[]", frames.io_token),
                             ffi.from_buffer("int64_t[]", frames.write_seq),
                             ffi.new("struct chm_ssd *[]", [ssd._c for ssd in timing.ssds])]
        dev.page_size, dev.capacity = self.page, self.capacity
        dev.cycles_per_command, dev.cycles_per_lookup = ctl.cycles_per_command, ctl.cycles_per_lookup
        dev.ready_at, dev.io_token, dev.write_seq, dev.ssds = self._native_keep
        dev.dram = ffi.NULL if frames.region is None else ffi.cast("uint8_t *", frames.region.base_addr)
        dev.controller, dev.dram_pipe, dev.link_to_host = timing.controller._c, timing.dram._c, timing.link_to_host._c
        dev.read_latency = timing.latencies.histogram("read")._c
        # the sequential path's (run_sequential)
        dev.cycles_per_admission, dev.stripe_bytes = ctl.cycles_per_admission, self.cfg.ssd.stripe_bytes
        dev.n_ssds, dev.chunk_pages = len(timing.ssds), self.chunk_pages
        dev.link_to_device, dev.write_latency = timing.link_to_device._c, timing.latencies.histogram("write")._c
        self._seq_result = ffi.new("struct chm_seq_result *")
        self._seq_counts = memoryview(ffi.buffer(ffi.addressof(self._seq_result, "counts"))).cast("Q")
        areas = self.policy.native_lookup_areas() or []
        for i, area in enumerate(areas):
            dev.areas[i].table, dev.areas[i].base = area.table._c, area.base
        dev.n_areas = len(areas)
        self.native_read = bool(areas)  # DRAM-hit reads run in C
        self._native_counts = memoryview(ffi.buffer(ffi.addressof(dev, "counts"))).cast("Q")
        self._native_finish = ffi.new("double *")
        # the data-off path's (module docstring, "Native data-off path")
        self._ops = dev.ops = ffi.new("struct chm_seq_counts *")
        self._ops_counts = memoryview(ffi.buffer(self._ops)).cast("Q")
        self._write_result = ffi.new("struct chm_write_result *")
        self._prefetch_result = ffi.new("struct chm_prefetch_result *")
        self._prefetch_frames = ffi.new("uint32_t[]", 64)
        dev.cycles_per_prefetch_page = ctl.cycles_per_prefetch_page
        self._read_result = ffi.new("double[4]")

    def _native_ops_setup(self) -> None:
        """Hand the flusher's state to C where the native core has the policy's flush rule and write path."""
        self._native_staging = False  # reads that stage run in C too (one area)
        if self.native_ops_problem() is None:
            self.flusher.go_native(self.native_dev, self._fold_ops)
            self._native_staging = self.native_dev.n_areas == 1

    def _native_parts_problem(self) -> str | None:
        """Why no native data-off path can run on this device whatever the policy (None: one can)."""
        if self.data:
            return "emulation.data is on"
        if type(self.flusher) is not Flusher or type(self.timing) is not TimingModel or self.media.backend is not None:
            return "the flusher, the timing model or the media are not the built-in ones"
        return None

    def native_ops_problem(self) -> str | None:
        """Why the data-off operations cannot run natively on this device (None: they can)."""
        if (problem := self._native_parts_problem()) is not None:
            return problem
        if not self.native_read:
            return f"policy {self.policy.name!r} looks pages up in Python"
        from .policies.base import Policy

        if not ((_policy_runs_sequentially(self.policy) and type(self.policy).released is Policy.released)
                or _hymcache_runs_natively(self.policy)):
            return f"policy {self.policy.name!r} is not a built-in frame-table cache or hymcache"
        if type(self.engine) is not PrefetchEngine:
            return "the prefetch engine is not the built-in one"
        return None

    def _fold_ops(self) -> None:
        """Add what the native hit read and data-off path counted to ``stats`` (after each call: a caller may
        hold ``stats``)."""
        _fold_counts(self._stats, self._native_counts, NATIVE_READ_COUNTS, _ZERO_COUNTS)
        _fold_counts(self._stats, self._ops_counts, NATIVE_SEQ_COUNTS, _ZERO_SEQ_COUNTS)

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

    # ---- sequential operations -----------------------------------------------------------
    def run_sequential(self, kinds, addrs, lengths, now: float = 0.0) -> SequentialOutcome:
        """Run operations one after another (module docstring, "Native sequential path"): operation ``i`` is
        a read (``kinds[i]`` ``"read"`` or ``SEQ_READ``) or a write and its flush (``"write"``, ``SEQ_WRITE``)
        of ``lengths[i]`` bytes at ``addrs[i]``, starting when the one before finished (the first at ``now``).
        The device ends as ``read``/``write``/``flush`` called in turn leave it; an operation they refuse
        raises their error, with the ones before it done. ``sequential_ops`` makes the arrays from
        ``(kind, addr, length)`` triples; buffers (``bytes``, ``array('Q')``) are used in place."""
        n = len(kinds)
        if len(addrs) != n or len(lengths) != n:
            raise ValueError(f"{n} kinds, {len(addrs)} addresses and {len(lengths)} lengths: one of each per operation")
        buffers = None
        if self.native_sequential_problem() is None:
            buffers = (_seq_buffer(kinds, "B"), _seq_buffer(addrs, "Q"), _seq_buffer(lengths, "Q"))
            if None in buffers:
                buffers = None
        pointers = None
        i, write_misses, native_ops = 0, 0, 0
        try:
            if buffers is not None:
                pointers = (ffi.from_buffer("uint8_t[]", buffers[0]), ffi.from_buffer("uint64_t[]", buffers[1]),
                            ffi.from_buffer("uint64_t[]", buffers[2]))
            while i < n:
                if pointers is not None and self._settled():
                    kinds_p, addrs_p, lengths_p = pointers
                    result = self._seq_result
                    rc = _run_sequential(self.native_dev, kinds_p + i, addrs_p + i, lengths_p + i, n - i, now, result)
                    self._fold_sequential(result)
                    i += result.done
                    native_ops += result.done
                    write_misses += result.write_misses
                    now = result.now
                    if rc == lib.CHM_E_NOMEM:
                        raise MemoryError(f"sequential operation #{i}: no memory for the native path's state")
                    if rc not in (lib.CHM_OK, lib.CHM_E_ARG):  # CHM_E_INTERNAL: a frame could not be had
                        raise RuntimeError(f"sequential operation #{i}: native status {rc} (every frame pinned)")
                    if i == n:
                        break
                    # CHM_E_ARG: the device refuses operation i; its call below raises why
                now, misses = self._sequential_step(kinds[i], addrs[i], lengths[i], now)
                write_misses += misses
                i += 1
        finally:
            for pointer in pointers or ():
                ffi.release(pointer)
        return _tuple_new(SequentialOutcome, (now, write_misses, native_ops))

    def _sequential_step(self, kind, addr: int, length: int, now: float) -> tuple[float, int]:
        """One operation of ``run_sequential`` through the calls: (its finish, its write misses)."""
        kind = _SEQ_KINDS.get(kind, kind)
        if kind == SEQ_READ:
            return self.read(addr, length, now).finish, 0
        if kind == SEQ_WRITE:
            written = self.write(addr, None, length, now)
            return self.flush(written.finish), written.new_pages
        raise ValueError(f"operation kind {kind!r} is neither 'read' nor 'write'")

    def native_sequential_problem(self) -> str | None:
        """Why ``run_sequential`` cannot use the native path on this device at all (None: it can, whenever
        the device is settled)."""
        if (problem := self._native_parts_problem()) is not None:
            return problem
        if not self.native_read or not _policy_runs_sequentially(self.policy):
            return f"policy {self.policy.name!r} is not a built-in frame-table cache without a write buffer"
        if type(self).read is not Controller.read or type(self).write is not Controller.write \
                or {"read", "write"} & vars(self).keys():
            return "read or write is not the controller's own"
        if self.flush != self.flusher.flush or self.tick != self.flusher.tick:
            return "flush or tick is not the flusher's own"
        return None

    def _settled(self) -> bool:
        """Nothing dirty or in flight, no frame pinned, no prefetch held, no media or staging-read error:
        the state the native sequential path starts from (and leaves after each operation)."""
        flusher = self.flusher
        return (flusher.pending() == (0, 0) and not self.read_error and flusher.media_error is None
                and not self.staged and self.engine.pages_held == 0
                and lib.chm_ft_pinned_ways(self.policy.read_area.table._c, 0) == 0)

    def _fold_sequential(self, result) -> None:
        """Add what a native sequential run counted to ``stats`` and the flusher."""
        self.fold_native_counts()
        _fold_counts(self._stats, self._seq_counts, NATIVE_SEQ_COUNTS, _ZERO_SEQ_COUNTS)
        if self.flusher.dev is None:  # else the native flusher counted them
            self.flusher._flight_order += result.flush_writes

    def fold_native_counts(self) -> None:
        """Add what native hit reads counted to ``stats``."""
        _fold_counts(self._stats, self._native_counts, NATIVE_READ_COUNTS, _ZERO_COUNTS)

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

    # ---- writes ------------------------------------------------------------------
    def write(self, addr: int, data: memoryview | None, length: int, now: float, whole: bool = True) -> WriteOutcome:
        """Write ``length`` bytes (``data``, or nothing when data is off) at ``addr``; returns the finish time
        and its pages (WriteOutcome).

        Raises WriteBufferFull, having written nothing, when the policy refuses; its ``new_pages`` is the
        write-buffer pages the write asked for. ``whole`` as for ``read``.
        """
        self.check_range(addr, length)
        dev = self.flusher.dev
        if dev is not None:
            res = self._write_result
            rc = _dev_write(dev, addr, length, now, whole, res)
            self._fold_ops()
            if rc == 0:
                return _tuple_new(WriteOutcome, (res.finish, res.new_pages, res.pages - res.new_pages,
                                                 self.policy.write_buffer_pages))
            self._native_write_failed(rc, res, addr, length)
        self.tick(now)
        if self.flusher.media_error is not None:
            self.stats["media_refused_writes"] += 1
            raise self.flusher.refuse_write(f"write of {length} bytes at {addr}")
        pages = self._pages(addr, length)
        new_pages = sum(1 for p in pages if self.policy.write_lookup(p) is None)
        if new_pages > self.cfg.write_buffer_frames > 0:
            raise _write_too_big(addr, length, new_pages, self.cfg.write_buffer_frames)
        if not self.policy.admit_writes(new_pages):
            self.stats["refused_writes"] += 1
            self.stats["refused_write_bytes"] += length
            raise _write_refused(addr, length, new_pages)
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
        return _tuple_new(WriteOutcome, (finish, new_pages, len(pages) - new_pages, self.policy.write_buffer_pages))

    @staticmethod
    def _native_read_failed(rc: int, page: int, addr: int, length: int):
        """Raise what ``read`` raises where ``chm_dev_read`` stopped with status ``rc`` (CHM_NO_FRAME: at ``page``)."""
        if rc == lib.CHM_NO_FRAME:
            raise _all_pinned("stage", page)
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(f"read of {length} bytes at {addr}: no memory for the native path's state")
        raise RuntimeError(f"read of {length} bytes at {addr}: native status {rc}")

    def _native_write_failed(self, rc: int, res, addr: int, length: int):
        """Raise what ``write`` raises where ``chm_dev_write`` stopped with status ``rc``."""
        if rc == lib.CHM_WRITE_TOO_BIG:
            raise _write_too_big(addr, length, res.new_pages, self.cfg.write_buffer_frames)
        if rc == lib.CHM_WRITE_REFUSED:
            raise _write_refused(addr, length, res.new_pages)
        if rc == lib.CHM_NO_FRAME:
            raise _all_pinned("write", res.page)
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(f"write of {length} bytes at {addr}: no memory for the native path's state")
        raise RuntimeError(f"write of {length} bytes at {addr}: native status {rc}")

    def _write_page(self, page: int, lo: int, hi: int, src: memoryview | None, now: float) -> float:
        frames, read_error = self.frames, self.read_error
        frame = self.policy.write_lookup(page)
        ready = now
        if frame is None:
            ins, now = self._allocate(self.policy.allocate_write, page, now, "write")
            frame = ins.frame
            ready = self._take_frame(ins, now)
            self.ready_at[frame] = now
            if hi - lo < self.page:  # partial page: the rest must come from DRAM's staged copy or the media
                ready = max(ready, self._fill_partial(frame, page, now))
        else:
            frames.settle(frame)
            if frame in read_error:
                if hi - lo < self.page:
                    frames.check_read(frame)  # the rest of the page could not be read: nothing to merge with
                del read_error[frame]  # the write supplies every byte
            self.flusher.wait_flush_of(frame)
            self.policy.touch(frame)
        copy = self.policy.read_copy(page)
        for target in {frame, copy} - {None}:
            frames.settle(target)
            if src is not None:
                frames.view(target, lo, hi)[:] = src
        frames.write_seq[frame] += 1
        self.policy.mark_dirty(frame)
        self.flusher.enqueue(frame, now)
        return self.timing.dram.transfer(max(ready, self.ready_at[frame]), hi - lo)

    def _fill_partial(self, frame: int, page: int, now: float) -> float:
        copy = self.policy.read_copy(page)
        if copy is not None and copy != frame:
            self.frames.settle(copy)
            if self.data:
                self.frames.view(frame)[:] = self.frames.view(copy)
            return max(now, self.ready_at[copy])
        self.stats["rmw_reads"] += 1
        done, token = self.media.read(frame, page, now)
        if token is not None:
            try:
                self.media.wait(token)
            except MediaIOError as exc:  # the frame holds no valid copy of the page: give it up, fail the write
                self.stats["read_failures"] += 1
                self.policy.flushed(frame)  # not dirty; hymcache returns the write-buffer frame
                if self.policy.page_of(frame) is not None:
                    self.read_error[frame] = exc  # lru: dropped once unpinned
                raise ChmError(exc.errno, f"write needs the rest of page {page} from the media: {exc.message}") from None
        return done

    # ---- prefetch ----------------------------------------------------------------
    def prefetch(self, addr: int, size: int, now: float) -> PrefetchOutcome:
        """Stage an object; returns its handle, the time the command is acknowledged and its pages
        (PrefetchOutcome)."""
        self.check_range(addr, size, "size")
        self.tick(now)
        pages = self._pages(addr, size)
        handle = self._next_handle
        self.engine.issue(handle, pages.start, len(pages))
        self._next_handle += 1
        self.stats["prefetches"] += 1
        self.stats["prefetch_bytes"] += size
        t = self._cycles(now, self.cfg.controller.cycles_per_command)
        dev = self.flusher.dev
        if dev is not None:  # the fetch loop in C (module docstring, "Native data-off path")
            buf = self._prefetch_frames
            if len(pages) > len(buf):
                buf = self._prefetch_frames = ffi.new("uint32_t[]", len(pages))
            res = self._prefetch_result
            rc = _dev_prefetch_fetch(dev, self.engine._c, t, buf, res)
            self._fold_ops()
            staged, resident = res.staged, res.resident
            self.stats["prefetch_staged_pages"] += staged
            self.stats["prefetch_resident_pages"] += resident
            if rc:
                if rc == lib.CHM_NO_FRAME:
                    raise _all_pinned("stage", res.page)
                raise MemoryError(f"prefetch of {size} bytes at {addr}: no memory for the native path's state")
            self.staged[handle] = Staged(ffi.unpack(buf, res.frames), res.ready_at)
            return _tuple_new(PrefetchOutcome, (handle, res.t + self.cfg.host_link.latency_ns, staged, resident,
                                                self.engine.pages_held))
        frames, ready_at = [], t
        staged = resident = 0
        try:
            while (fetch := self.engine.next_fetch()) is not None:
                page = fetch[1]
                t = self._cycles(t, self.cfg.controller.cycles_per_prefetch_page)
                frame = self.policy.staged_lookup(page)
                if frame is None and self.policy.lookup(page) is not None:
                    resident += 1  # newest data sits in the write buffer
                    continue
                if frame is None:
                    staged += 1
                    frame = self._stage(page, t)
                else:
                    resident += 1
                    self.policy.touch(frame)
                self.policy.pin(frame)
                frames.append(frame)
                ready_at = max(ready_at, self.ready_at[frame])
        finally:  # counted even when staging fails
            self.stats["prefetch_staged_pages"] += staged
            self.stats["prefetch_resident_pages"] += resident
        self.staged[handle] = Staged(frames, ready_at)
        self.media.poll()  # get the reads going now
        return _tuple_new(PrefetchOutcome, (handle, t + self.cfg.host_link.latency_ns, staged, resident,
                                            self.engine.pages_held))

    def _staged_in_time(self, handle: int, now: float, timeout_ns: float | None) -> Staged:
        """The staged object behind ``handle``; raises as ``wait`` does for an unknown handle or a modelled
        staging later than ``now + timeout_ns``."""
        self.engine.get(handle)  # an unknown handle raises here
        staged = self.staged[handle]
        if timeout_ns is not None and staged.ready_at > now + timeout_ns:
            raise ChmError(errno.ETIMEDOUT, f"prefetch handle {handle} not staged within {timeout_ns / 1e6:g} ms "
                                            f"(ready in {(staged.ready_at - now) / 1e6:.3f} ms of modelled time)")
        return staged

    def wait_would_block(self, handle: int, now: float, timeout_ns: float | None = None) -> bool:
        """Would ``wait`` block on media reads still in flight (real I/O, data on)? Raises what ``wait`` would
        raise before that (unknown handle, ETIMEDOUT). Never blocks: a server parks the wait meanwhile."""
        staged = self._staged_in_time(handle, now, timeout_ns)
        if not self.data:
            return False
        self.media.poll()
        tokens, landed = self.frames.io_token, self.media.landed
        return any(tokens[frame] != NO_TOKEN and not landed(tokens[frame]) for frame in staged.frames)

    def wait(self, handle: int, now: float, timeout_ns: float | None = None) -> float:
        """Until the object is staged; returns when the host learns it (virtual time)."""
        staged = self._staged_in_time(handle, now, timeout_ns)
        if self.data or self.read_error:  # else nothing to settle, no read failed
            for frame in staged.frames:
                self.frames.settle(frame)
            for frame in staged.frames:
                self.frames.check_read(frame)
        self.engine.arrive_all(handle)
        self.tick(now)
        return max(now, staged.ready_at) + self.cfg.host_link.latency_ns

    def release(self, handle: int, now: float) -> float:
        self.engine.release(handle)
        self.stats["releases"] += 1
        dev = self.flusher.dev
        if dev is not None:
            frames = self.staged.pop(handle).frames
            lib.chm_dev_release_frames(dev, ffi.new("uint32_t[]", frames), len(frames))
            self.tick(now)
            return self._cycles(now, self.cfg.controller.cycles_per_command) + self.cfg.host_link.latency_ns
        for frame in self.staged.pop(handle).frames:
            self.frames.settle(frame)
            self.policy.unpin(frame)
            self.policy.released(frame)
        self.tick(now)
        return self._cycles(now, self.cfg.controller.cycles_per_command) + self.cfg.host_link.latency_ns

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
