"""The replay's request loop in C (``native/replay_loop.{h,c}``): ``Replay.run`` takes it where it can
(``native_problem``), driver.py's Python loop otherwise; the two give the same report, device state and Master
state (tests/host_runtime/test_native_replay.py runs them side by side).

A workload goes in as batches of arrays, never as a Python object per request: a libCacheSim trace as its
reader's columns (``LibCacheSimTrace.native_batches``: time, object id, size), a Mooncake trace as its requests'
start times and keys, any other workload phase by phase from its streams. What comes back are the report rows'
accumulators (``bucket.Bucket``, read latencies as distinct values and counts) and the loop's counters; the
controller's and the Master's state are theirs already (the loop ran on their structs).
"""

from __future__ import annotations

import errno
import functools
import os
from types import SimpleNamespace

import numpy as np

from driver.errors import ChmError
from .blocks import OBJECT_BLOCK_BITS, OutOfOrder, key_array  # noqa: F401 (OutOfOrder, key_array re-exported)
from .bucket import Bucket
from .native_build import REPLAY_LOOP



@functools.cache
def _module():
    return REPLAY_LOOP.load()


def native_problem(replay) -> str | None:
    """Why ``replay`` cannot run on the native loop (None: it can)."""
    from emulator import native_build
    from host_runtime.hymcache.checks import MAX_LENGTH
    from host_runtime.hymcache.native_master import NativeMaster

    ctl = replay.ctl
    if replay.prefetching:
        return f"variant {replay.variant!r} prefetches"
    if replay.ops is not None:
        return "the operations are recorded (record_ops)"
    if type(replay.master) is not NativeMaster or replay.master.mutation:
        return "the host index is not the native Master table"
    if os.environ.get(native_build.MUTATION_ENV):
        return f"${native_build.MUTATION_ENV} plants a mutation in the device core"
    if not getattr(ctl, "_native_staging", False) or ctl.flusher.dev is None:
        return f"device policy {ctl.policy.name!r} has no native data-off path of one area"
    if ctl.policy.write_buffer_pages:
        return f"device policy {ctl.policy.name!r} keeps a write buffer"
    if replay.slot_bytes > MAX_LENGTH:
        return f"a block's {replay.slot_bytes} bytes exceed the Master's {MAX_LENGTH}"
    return None


class NativeLoop:
    """The C loop on ``replay``'s controller and Master (driver.Replay, ``native_problem`` None)."""

    def __init__(self, replay):
        from emulator.native import ffi as core_ffi

        from host_runtime.hymcache.checks import MAX_BATCH

        m = _module()
        self.ffi, self.lib = ffi, lib = m.ffi, m.lib
        self.replay = replay
        ctl, master = replay.ctl, replay.master
        p = ffi.new("struct rp_params *")
        p.block_bytes, p.slot_bytes, p.refusal_ns = replay.block_bytes, replay.slot_bytes, replay.refusal_ns
        p.bucket_ns, p.by_time, p.sequential = replay.bucket_ns, replay.by_time, replay.sequential
        p.max_batch, p.object_block_bits = MAX_BATCH, OBJECT_BLOCK_BITS
        p.prefill_block_flops, p.prefill_position_flops = replay.prefill.flops_terms()
        dev = ffi.cast("void *", int(core_ffi.cast("uintptr_t", ctl.flusher.dev)))
        table = ffi.cast("void *", int(master._ffi.cast("uintptr_t", master._t)))
        out = ffi.new("struct rp_engine **")
        rc = lib.rp_new(dev, table, p, float(ctl.flusher.background_ns), out)
        if rc:
            raise MemoryError("native replay loop: out of memory") if rc == lib.RP_E_NOMEM else \
                ValueError(f"native replay loop: bad parameters (status {rc})")
        self._e = ffi.gc(out[0], lib.rp_free)
        self._counts = ffi.new("struct rp_counts *")
        self._done = 0
        self.labels: list = []  # phase rows: each phase's label, in order

    # ---- errors ----------------------------------------------------------------------------
    def _check(self, rc: int) -> None:
        if rc == 0:
            return
        lib, ffi = self.lib, self.ffi
        if rc == lib.RP_E_UNSORTED:
            raise OutOfOrder()
        if rc == lib.RP_E_NOMEM:
            raise MemoryError("native replay loop: out of memory")
        err = ffi.new("struct rp_error *")
        lib.rp_get_error(self._e, err)
        if rc == lib.RP_E_MASTER:
            self._master_failed(err.op, err.status)
        if rc == lib.RP_E_DEVICE:
            self._device_failed(err)
        raise RuntimeError(f"native replay loop: status {rc} (op {err.op}, status {err.status})")

    def _master_failed(self, op: int, status: int) -> None:
        master = self.replay.master
        if op == self.lib.RP_OP_PUT_START and status == master._lib.MT_E_NODEV:
            raise ChmError(errno.ENODEV, "no storage node is registered: start a KV Manager first")
        master._check(-status)

    def _device_failed(self, err) -> None:
        """Raise what the Controller (or its flusher) raises for the device call that failed."""
        from emulator.flusher import no_flush_granted
        from emulator.native import lib as core

        ctl, lib, length = self.replay.ctl, self.lib, self.replay.block_bytes
        if err.op == lib.RP_OP_WRITE:
            ctl._native_write_failed(err.status, SimpleNamespace(new_pages=err.new_pages, page=int(err.detail)),
                                     err.addr, length)
        if err.op == lib.RP_OP_READ:
            ctl._native_read_failed(err.status, int(err.detail), err.addr, length)
        if err.op == lib.RP_OP_RUN_UNTIL and err.status == core.CHM_E_INTERNAL:
            raise no_flush_granted(ctl.policy.name, err.detail)
        raise MemoryError("native flusher: no memory")

    # ---- feeding ---------------------------------------------------------------------------
    def counts(self):
        self.lib.rp_get_counts(self._e, self._counts)
        return self._counts

    def blocks_done(self) -> int:
        """Block references run since the last call."""
        refs = self.counts().block_refs
        delta, self._done = refs - self._done, refs
        return delta

    def add_known(self, keys) -> None:
        if keys:
            arr = key_array(list(keys))
            self._check(self.lib.rp_known_add(self._e, self.ffi.from_buffer("rp_key[]", arr), len(arr)))

    def phase_begin(self, now: float, label) -> None:
        self.labels.append(label)
        self._check(self.lib.rp_phase_begin(self._e, now, len(self.labels) - 1))

    def feed_objects(self, times: np.ndarray, obj_ids: np.ndarray, sizes: np.ndarray, first_time: int,
                     ns_per_unit: float, ignore_size: bool, final: int) -> None:
        ffi = self.ffi
        self._check(self.lib.rp_feed_objects(self._e, len(times), ffi.from_buffer("int64_t[]", times),
                                             ffi.from_buffer("uint64_t[]", obj_ids), ffi.from_buffer("int64_t[]", sizes),
                                             first_time, ns_per_unit, int(ignore_size), final))

    def feed(self, start_ns: np.ndarray, stream_requests: np.ndarray | None, think_ns: np.ndarray | None,
             request_keys: np.ndarray, keys: np.ndarray, final: int) -> None:
        ffi, NULL = self.ffi, self.ffi.NULL
        self._check(self.lib.rp_feed(
            self._e, len(start_ns), ffi.from_buffer("double[]", start_ns),
            NULL if stream_requests is None else ffi.from_buffer("uint32_t[]", stream_requests),
            NULL if think_ns is None else ffi.from_buffer("double[]", think_ns),
            ffi.from_buffer("uint64_t[]", request_keys), ffi.from_buffer("rp_key[]", keys), final))

    def feed_phase(self, phase) -> None:
        """A generated workload's phase, whole (its streams are in memory already)."""
        starts = np.array([s.start_ns for s in phase.streams], dtype=np.float64)
        per_stream = np.array([len(s.requests) for s in phase.streams], dtype=np.uint32)
        requests = [r for s in phase.streams for r in s.requests]
        think = np.array([r.think_ns for r in requests], dtype=np.float64)
        request_keys = np.array([len(r.keys) for r in requests], dtype=np.uint64)
        keys = key_array([k for r in requests for k in r.keys])
        self.feed(starts, per_stream, think if think.any() else None, request_keys, keys, self.lib.RP_FEED_LAST)

    def phase_end(self) -> float:
        now = self.ffi.new("double *")
        self._check(self.lib.rp_phase_end(self._e, now))
        return now[0]

    # ---- results ---------------------------------------------------------------------------
    def finish(self) -> None:
        """The device's background clock and counters back to the controller, the rows to ``replay.buckets``."""
        replay, lib, ffi = self.replay, self.lib, self.ffi
        c = self.counts()
        fl = replay.ctl.flusher
        fl.background_ns = c.background_ns
        fl.events_run += c.events_run
        replay.ctl._fold_ops()
        replay.revoked += c.revoked
        replay.no_space_puts += c.no_space_puts
        b = ffi.new("struct rp_bucket *")
        fields = Bucket.SUMMED + Bucket.SPANS
        for i in range(lib.rp_buckets(self._e)):
            lib.rp_get_bucket(self._e, i, b)
            n = b.latencies
            values, counts = np.empty(n, np.float64), np.empty(n, np.uint64)
            if n:
                lib.rp_get_latencies(self._e, i, ffi.from_buffer("double[]", values), ffi.from_buffer("uint64_t[]", counts))
            order = np.argsort(values, kind="stable")
            if replay.by_time:
                key, row = b.key, replay.window_bucket(b.key)
            else:
                key = self.labels[b.key]
                row = Bucket(key, start_ns=b.start_ns)
            for name in fields:
                setattr(row, name, getattr(b, name))
            row.latency_counts = (values[order], counts[order])
            replay.buckets[key] = row
