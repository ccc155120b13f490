"""The native sequential path (``Controller.run_sequential``, ``chm_dev_run_sequential``) and the native SSD
model (``timing.SsdModel`` over ``struct chm_ssd``).

``run_sequential`` must leave the device exactly as the per-operation loop it replaces (``read``, or
``write`` then ``flush``, each starting when the one before finished): two fresh controllers, one through
the native path and one through the calls, end with the same finish, write misses, snapshot (stats,
latency summaries, busy times), histograms, pipes, SSD models (their heaps too), frame table (pages, dirty
bits, pins, queues), per-frame state and flusher counters; and since a policy's hidden state (clock
counters, the sieve hand, the s3fifo ghost) shows only in later decisions, both then run the same further
operations through the calls and must still agree.
"""

from __future__ import annotations

import errno
import heapq
import random

import pytest

from emulator import ChmError, load_profile
from emulator.config import Config
from emulator.controller import SEQ_READ, SEQ_WRITE, Controller, sequential_ops
from emulator.shared_data import mooncake_conversation_trace
from emulator.timing import Pipe, SsdModel
from host_runtime.replay import MooncakeTrace, Replay, replay_config
from host_runtime.replay.traces import MOONCAKE_TOKENS_PER_HASH

from . import native_twins
from .conftest import KiB
from .native_twins import device_state, fifo_plug_in, python_controller

SEQUENTIAL_POLICIES = ("lru", "fifo", "clock", "s3fifo", "sieve")
MOONCAKE_REQUESTS = 400  # the trace's first requests: a few thousand page accesses
MOONCAKE_DRAM_PAGES = 256  # far fewer than the prefix touches: evictions all along


def per_op_loop(ctl: Controller, ops, now: float = 0.0) -> tuple[float, int]:
    """What run_sequential replaces (bench/bench_replay.py's device path before it): (finish, write misses)."""
    write_misses = 0
    for kind, addr, length in ops:
        if kind == "read":
            now = ctl.read(addr, length, now).finish
        else:
            written = ctl.write(addr, None, length, now)
            write_misses += written.new_pages
            now = ctl.flush(written.finish)
    return now, write_misses


def assert_same_run(make_ctl, ops, tail_ops=(), now: float = 0.0, expect_native: bool = True) -> None:
    """``ops`` through run_sequential on one fresh controller and through the calls on another: the same
    outcome and state; then ``tail_ops`` through the calls on both: still the same."""
    native, python = make_ctl(), python_controller(make_ctl())
    outcome = native.run_sequential(*sequential_ops(ops), now=now)
    assert outcome.native_ops == (len(ops) if expect_native else 0)
    assert (outcome.finish, outcome.write_misses) == per_op_loop(python, ops, now)
    native.policy.read_area.table.check()
    assert device_state(native) == device_state(python)
    if tail_ops:
        assert per_op_loop(native, tail_ops, outcome.finish) == per_op_loop(python, tail_ops, outcome.finish)
        assert device_state(native) == device_state(python)


def tiny_config(policy: str, dram_frames: int = 16, more: dict | None = None) -> Config:
    """The shared tiny device with the prefetch window --sequential has."""
    return native_twins.tiny_config(policy, dram_frames, {"policy.prefetch_window_bytes": 4 * KiB, **(more or {})})


def random_ops(cfg: Config, seed: int, count: int, longest: int | None = None) -> list[tuple[str, int, int]]:
    """Reads and writes, mostly near recent ones (hits, overwrites), of partial pages, whole pages and runs
    of pages up to ``longest`` pages, by default longer than DRAM (a read staged in chunks, a write evicting
    its own dirty pages)."""
    rng = random.Random(seed)
    cap, page = cfg.capacity_bytes, cfg.device.page_size_bytes
    longest = cfg.dram_frames + 4 if longest is None else longest
    ops, recent = [], [0]
    for _ in range(count):
        base = rng.choice(recent) if rng.random() < 0.7 else rng.randrange(cap)
        addr = min(base + rng.choice((0, 0, 1, rng.randrange(page), page)), cap - 1)
        length = rng.choice((1, 100, page, page - 1, page + 7, 3 * page, rng.randrange(1, longest * page)))
        length = min(length, cap - addr, longest * page - addr % page)
        ops.append(("read" if rng.random() < 0.5 else "write", addr, length))
        recent = (recent + [addr])[-12:]
    return ops


@pytest.fixture(scope="module")
def mooncake_ops() -> list[tuple[str, int, int]]:
    """The device operations of the first requests of the Mooncake trace replayed as the oracle test and the
    bench do (--sequential, one 2 MiB page per hash id)."""
    page = load_profile("paper").device.page_size_bytes
    trace = MooncakeTrace(mooncake_conversation_trace(), block_bytes=page, tokens_per_block=MOONCAKE_TOKENS_PER_HASH,
                          limit=MOONCAKE_REQUESTS)
    cfg = replay_config("paper", "lru", {"dram.size_bytes": MOONCAKE_DRAM_PAGES * page,
                                         "policy.prefetch_window_bytes": page})
    replay = Replay(cfg, "lru", trace, progress=False, record_ops=True, sequential=True)
    replay.run()
    return replay.ops


# ---- equivalence ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", SEQUENTIAL_POLICIES)
def test_mooncake_prefix_runs_natively_as_through_the_calls(policy, mooncake_ops):
    page = load_profile("paper").device.page_size_bytes
    overrides = {"dram.size_bytes": MOONCAKE_DRAM_PAGES * page, "policy.prefetch_window_bytes": page}
    cfg = replay_config("paper", "lru", overrides, device_policy=policy)
    assert len(mooncake_ops) > 2000
    split = len(mooncake_ops) - 300
    assert_same_run(lambda: Controller(cfg, None), mooncake_ops[:split], mooncake_ops[split:])


SMALL_DRAMS = [(policy, frames) for policy in SEQUENTIAL_POLICIES for frames in (4, 8, 16)
               if policy != "s3fifo" or frames >= 8]  # S3-FIFO needs 2 frames in its small queue, 1 in the main


@pytest.mark.parametrize("policy, dram_frames", SMALL_DRAMS)
def test_random_operations_in_a_small_dram_run_natively_as_through_the_calls(policy, dram_frames):
    cfg = tiny_config(policy, dram_frames)
    for seed in range(4):
        ops = random_ops(cfg, seed * 31 + dram_frames, 300)
        assert_same_run(lambda: Controller(cfg, None), ops[:250], ops[250:], now=1234.5 * seed)


def test_the_random_operations_cover_what_the_native_path_does():
    """Dirty victims inside one write, partial-page writes, reads staged in chunks, runs of several
    pages per flush write, hits served by the native hit read: the cases above meet each."""
    cfg = tiny_config("lru", 8)
    ctl = Controller(cfg, None)
    ops = random_ops(cfg, 1, 2000)
    kinds, addrs, lengths = sequential_ops(ops)
    ctl.run_sequential(kinds, addrs, lengths)
    s = ctl.snapshot()
    assert s["dirty_evictions"] and s["rmw_reads"] and s["evictions"] and s["page_hits"] and s["page_misses"]
    assert s["flushed_pages"] > ctl.flusher.flight_counts()[0] > s["flush_batches"]  # runs of several pages, several runs
    assert ctl.chunk_pages < max(length for length in lengths) // cfg.device.page_size_bytes


# ---- what falls back to the calls -----------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["hymcache", "libcachesim:LRU"])
def test_other_policies_run_through_the_calls(policy):
    cfg = tiny_config(policy)
    assert Controller(cfg, None).native_sequential_problem() is not None
    ops = random_ops(cfg, 7, 120, longest=cfg.write_buffer_frames or None)  # hymcache: writes the buffer takes
    native, python = Controller(cfg, None), python_controller(Controller(cfg, None))
    outcome = native.run_sequential(*sequential_ops(ops))
    assert outcome.native_ops == 0
    assert (outcome.finish, outcome.write_misses) == per_op_loop(python, ops)
    assert native.snapshot() == python.snapshot()


def test_a_plug_in_eviction_policy_runs_through_the_calls():
    with fifo_plug_in("test-seq-plugin") as name:
        cfg = tiny_config(name)
        assert "not a built-in" in Controller(cfg, None).native_sequential_problem()
        assert_same_run(lambda: Controller(cfg, None), random_ops(cfg, 3, 80), expect_native=False)


def test_data_on_runs_through_the_calls(tmp_path):
    cfg = tiny_config("lru").with_overrides({"emulation.data": True})
    ctl = Controller(cfg, tmp_path / "media", log=lambda line: None, format_media=True)
    try:
        assert ctl.native_sequential_problem() == "emulation.data is on"
        outcome = ctl.run_sequential(["write", "read"], [0, 0], [8 * KiB, 8 * KiB])
        assert outcome.native_ops == 0 and outcome.write_misses == 2 and ctl.stats["page_hits"] == 2
    finally:
        ctl.close(0.0)


def test_an_unsettled_device_runs_through_the_calls_until_a_flush_settles_it():
    cfg = tiny_config("lru", more={"policy.lru_writeback_delay_ns": 1e15})  # no background flush meanwhile
    ops = random_ops(cfg, 11, 60)
    first_write = next(i for i, op in enumerate(ops) if op[0] == "write")
    native, python = Controller(cfg, None), python_controller(Controller(cfg, None))
    now = 0.0
    for ctl in (native, python):  # a write not flushed: dirty pages, then a prefetch held
        now = ctl.write(5 * cfg.device.page_size_bytes, None, 3 * KiB, 0.0).finish
    outcome = native.run_sequential(*sequential_ops(ops), now=now)
    assert outcome.native_ops == len(ops) - first_write - 1
    assert (outcome.finish, outcome.write_misses) == per_op_loop(python, ops, now)
    assert device_state(native) == device_state(python)
    # a prefetch handle held: nothing natively, whatever the flushes do
    handle = native.prefetch(0, 4 * KiB, outcome.finish).handle
    python.prefetch(0, 4 * KiB, outcome.finish)
    again = native.run_sequential(*sequential_ops(ops), now=outcome.finish)
    assert again.native_ops == 0
    assert (again.finish, again.write_misses) == per_op_loop(python, ops, outcome.finish)
    assert native.snapshot() == python.snapshot() and handle in native.staged


def test_an_operation_the_device_refuses_raises_its_error_with_the_ones_before_it_done():
    cfg = tiny_config("lru")
    ops = random_ops(cfg, 5, 40)
    bad = ops[:25] + [("write", cfg.capacity_bytes - KiB, 2 * KiB)] + ops[25:]  # past the end of the device
    native, python = Controller(cfg, None), python_controller(Controller(cfg, None))
    with pytest.raises(ChmError) as refused:
        native.run_sequential(*sequential_ops(bad))
    with pytest.raises(ChmError) as expected:
        per_op_loop(python, bad)
    assert refused.value.errno == expected.value.errno == errno.ERANGE
    assert str(refused.value) == str(expected.value)
    assert device_state(native) == device_state(python)
    with pytest.raises(ValueError, match="neither 'read' nor 'write'"):
        native.run_sequential(["read", "erase"], [0, 0], [1, 1])
    assert native.stats["reads"] == python.stats["reads"] + 1  # the read before it ran


def test_operations_given_as_lists_or_kind_codes():
    cfg = tiny_config("fifo")
    ops = random_ops(cfg, 2, 50)
    kinds, addrs, lengths = sequential_ops(ops)
    as_lists = Controller(cfg, None).run_sequential([k for k, _, _ in ops], list(addrs), list(lengths))
    as_codes = Controller(cfg, None).run_sequential(bytes(kinds), addrs, lengths)
    assert as_lists == as_codes and as_codes.native_ops == len(ops)
    assert set(kinds) <= {SEQ_READ, SEQ_WRITE}
    with pytest.raises(ValueError):
        Controller(cfg, None).run_sequential(kinds, addrs, lengths[:-1])


# ---- the SSD model ------------------------------------------------------------------------------------

class ReferenceSsd:
    """timing.SsdModel as it was written in Python (the specification struct chm_ssd follows)."""

    def __init__(self, cfg: Config):
        s = cfg.ssd
        self.read_latency_ns, self.write_latency_ns = s.read_latency_ns, s.write_latency_ns
        self.slowdown = s.read_slowdown_under_writes
        self._slots = [0.0] * s.parallelism
        self.read_media = Pipe("r", 0.0, s.read_bandwidth_gbps)
        self.write_media = Pipe("w", 0.0, s.write_bandwidth_gbps)
        self.writes_until = self.reads_until = 0.0
        self._read_finishes: list[float] = []
        self.slowed_reads = 0

    def read(self, ready, nbytes):
        start = max(ready, self._slots[0])
        slow = self.slowdown if start < self.writes_until else 1.0
        self.slowed_reads += slow > 1.0
        finish = self.read_media.transfer(start + self.read_latency_ns * slow, nbytes, slow)
        heapq.heapreplace(self._slots, finish)
        heapq.heappush(self._read_finishes, finish)
        if finish > self.reads_until:
            self.reads_until = finish
        return finish

    def write(self, ready, nbytes):
        start = max(ready, self._slots[0])
        finish = self.write_media.transfer(start + self.write_latency_ns, nbytes)
        heapq.heapreplace(self._slots, finish)
        self.writes_until = max(self.writes_until, finish)
        return finish

    def reads_in_flight(self, now):
        while self._read_finishes and self._read_finishes[0] <= now:
            heapq.heappop(self._read_finishes)
        return len(self._read_finishes)


def ssd_state(s) -> tuple:
    return (s._slots, s._read_finishes, s.writes_until, s.reads_until, s.slowed_reads, s.read_media.free_at,
            s.read_media.busy_ns, s.read_media.bytes, s.write_media.free_at, s.write_media.busy_ns, s.write_media.bytes)


@pytest.mark.parametrize("parallelism", [1, 3, 8])
def test_the_native_ssd_model_computes_as_the_python_one(parallelism):
    cfg = load_profile("small").with_overrides({"ssd.parallelism": parallelism})
    rng = random.Random(parallelism)
    native, reference = SsdModel(0, cfg), ReferenceSsd(cfg)
    now = 0.0
    for _ in range(3000):
        now += rng.choice((0.0, 1.0, 50.0, 3000.0, rng.uniform(0, 1e5)))
        op = rng.random()
        if op < 0.45:
            nbytes = rng.choice((4096, 65536, 2 << 20))
            assert native.read(now, nbytes) == reference.read(now, nbytes)
        elif op < 0.8:
            nbytes = rng.choice((4096, 65536, 2 << 20))
            assert native.write(now, nbytes) == reference.write(now, nbytes)
        else:
            at = now + rng.uniform(-2e5, 2e5)
            assert native.reads_in_flight(at) == reference.reads_in_flight(at)
        assert ssd_state(native) == ssd_state(reference)
    assert native.parallelism == parallelism
    assert native.busy_ns == native.read_media.busy_ns + native.write_media.busy_ns


def test_the_native_ssd_model_keeps_its_pipes_alive():
    ssd = SsdModel(0, load_profile("small"))
    pipe = ssd.read_media
    del ssd
    import gc
    gc.collect()
    assert pipe.transfer(0.0, 4096) > 0 and pipe.bytes == 4096
