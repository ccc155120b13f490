"""The controller's native paths: the C core's view of a controller (``struct chm_dev``), which of its
paths may run on a device (controller.py's docstring: "Native hit path", "Native data-off path"), and
folding what they counted into ``stats``. Methods of Controller.
"""

from __future__ import annotations

from array import array

from .flusher import Flusher
from .native import ffi
from .prefetch import PrefetchEngine
from .timing import TimingModel

# The stats the native hit read counts: struct chm_read_counts's fields, in its order.
NATIVE_READ_COUNTS = tuple(name for name, _ in ffi.typeof("struct chm_read_counts").fields)
_ZERO_COUNTS = memoryview(array("Q", bytes(8 * len(NATIVE_READ_COUNTS))))
# The stats the native sequential path counts besides the hit read's: struct chm_seq_counts's fields.
NATIVE_SEQ_COUNTS = tuple(name for name, _ in ffi.typeof("struct chm_seq_counts").fields)
_ZERO_SEQ_COUNTS = memoryview(array("Q", bytes(8 * len(NATIVE_SEQ_COUNTS))))
# The policy calls chm_dev_run_sequential makes itself (CachePolicy's, over its one frame table).
_SEQ_POLICY_METHODS = ("lookup", "staged_lookup", "write_lookup", "read_copy", "page_of", "is_dirty", "touch", "pin",
                       "unpin", "pins", "mark_dirty", "drop", "allocate_clean", "admit_writes", "allocate_write",
                       "flushed", "flush_grant", "native_lookup_areas")


def _fold_counts(stats: dict, counts: memoryview, names: tuple, zero: memoryview) -> None:
    """Add native counters (``counts``, in the order of ``names``) to ``stats`` and zero them."""
    values = counts.tolist()
    if any(values):
        for name, n in zip(names, values):
            if n:
                stats[name] += n
        counts[:] = zero


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


class NativePaths:
    """The native paths' setup and checks (a Controller mixin)."""

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

    def fold_native_counts(self) -> None:
        """Add what native hit reads counted to ``stats``."""
        _fold_counts(self._stats, self._native_counts, NATIVE_READ_COUNTS, _ZERO_COUNTS)
