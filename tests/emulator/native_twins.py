"""What the side-by-side tests of the native data-off paths share (test_native_ops.py, test_native_sequential.py):
a tiny data-off device, the all-Python reference controller, the state both must end in, and a plug-in policy."""

from __future__ import annotations

from contextlib import contextmanager

from emulator import load_profile
from emulator.config import Config
from emulator.controller import Controller
from emulator.native import ffi, lib

from .conftest import KiB, TINY

POLICY_FIT = {"s3fifo": {"policy.s3fifo.small_size_ratio": 0.25}}  # a small queue of >= 2 frames in tiny DRAMs


def tiny_config(policy: str, dram_frames: int = 16, more: dict | None = None) -> Config:
    return load_profile("small").with_overrides({**TINY, "policy.name": policy, "emulation.data": False,
                                                 "dram.size_bytes": dram_frames * 4 * KiB,
                                                 **POLICY_FIT.get(policy, {}), **(more or {})})


def python_controller(ctl: Controller) -> Controller:
    """``ctl`` with its flusher's state in Python (the per-operation calls all Python's, but for the DRAM-hit
    read): the reference the native paths are held to."""
    if ctl.flusher.dev is not None:
        ctl.flusher.to_python()
    assert ctl.flusher.dev is None and ctl.native_dev.flusher == ffi.NULL
    return ctl


def device_state(ctl: Controller) -> dict:
    """Everything an operation can change, as plain values."""
    timing, flusher, policy = ctl.timing, ctl.flusher, ctl.policy
    pipes = [timing.link_to_host, timing.link_to_device, timing.dram] + \
            [p for s in timing.ssds for p in (s.read_media, s.write_media)]
    tables = [area.table for area in policy.areas]
    return {
        "snapshot": ctl.snapshot(),
        "stats": dict(ctl.stats),
        "pipes": [(p.name, p.free_at, p.busy_ns, p.bytes) for p in pipes],
        "controller": (timing.controller.free_at, timing.controller.busy_ns),
        "ssds": [(s.writes_until, s.reads_until, s.slowed_reads, s._slots, list(s._read_finishes))
                 for s in timing.ssds],
        "histograms": {k: (h.count, h.total_ns, h.min_ns, h.max_ns, bytes(h.counts))
                       for k, h in timing.latencies.histograms.items() if h.count},
        "frames": (list(ctl.ready_at), list(ctl.frames.io_token), list(ctl.frames.write_seq)),
        "tables": [(list(t.page_of), bytes(t.dirty), list(t.pins),
                    [(o.queue(lib.CHM_QUEUE_MAIN), o.queue(lib.CHM_QUEUE_SMALL)) for o in t.orders])
                   for t in tables],
        "flusher": (flusher.flight_counts(), bytes(flusher.queued), list(flusher.dirty_entries()),
                    sorted((f, o, fl.frames, fl.seqs, fl.since) for f, o, fl in flusher.flight_entries()),
                    flusher.background_ns, flusher.events_run),
        "write_buffer": policy.write_buffer_pages,
        "free_when_unpinned": bytes(getattr(policy, "_free_when_unpinned", b"")),
        "staged": {h: (s.frames, s.ready_at) for h, s in ctl.staged.items()},
        "prefetch_pages_held": ctl.engine.pages_held,
    }


@contextmanager
def fifo_plug_in(name: str):
    """A policy registered as ``name`` while the block runs: fifo with an operation overridden, so a plug-in
    whose victims are chosen in Python."""
    from emulator.policies import register, unregister
    from emulator.policies.fifo import FifoOrder

    class MyFifo(FifoOrder):
        def evict(self, pinned, incoming=None):
            return super().evict(pinned, incoming)

    register(name, MyFifo)
    try:
        yield name
    finally:
        unregister(name)
