"""The native data-off path (controller.py, "Native data-off path"; flusher.py, "Native mode"): with data off and
a built-in policy, ``write``, ``read``, ``prefetch``, ``release``, ``tick``, ``run_until``, ``next_event_ns``,
``quiet_until`` and ``flush`` run in C over the flusher's state held there.

Each must leave the device exactly as the Python it replaces: two fresh controllers, one native and one with
its flusher's state brought back to Python (``Flusher.to_python``: every call then runs the Python code, but for the
DRAM-hit read, which is native in both), run the same operations at the same virtual times -- overlapping, as
the replay issues them, with background work between -- and must return the same outcomes (or raise the same
errors) and end in the same state: stats, latency histograms, pipes, SSD models, frame tables, per-frame
state, the dirty queue, the flights, the flusher's counters, the write buffer. Then both run more operations,
since a policy's hidden state shows only in later decisions.
"""

from __future__ import annotations

import random

import pytest

from emulator import ChmError
from emulator.config import Config
from emulator.controller import Controller
from emulator.errors import WriteBufferFull
from emulator.native import lib
from emulator.shared_data import mooncake_conversation_trace
from host_runtime.replay import MooncakeTrace, Replay, get_model, replay_config

from .conftest import KiB
from .native_twins import device_state, fifo_plug_in, python_controller, tiny_config

NATIVE_POLICIES = ("lru", "fifo", "clock", "s3fifo", "sieve", "hymcache")
def random_ops(cfg: Config, seed: int, count: int) -> list[tuple]:
    """Operations at virtual times that overlap (a step smaller than an SSD access, or a long idle gap):
    reads and writes of partial pages, pages and runs of pages, prefetches (waited for and released a few
    operations later), background work, flushes."""
    rng = random.Random(seed)
    cap, page = cfg.capacity_bytes, cfg.device.page_size_bytes
    longest = max(1, min(cfg.write_buffer_frames or cfg.dram_frames, cfg.dram_frames // 2))
    ops, recent, now = [], [0], 0.0
    for _ in range(count):
        now += rng.choice((0.0, 10.0, 500.0, 20_000.0, 150_000.0, 2e6))
        base = rng.choice(recent) if rng.random() < 0.7 else rng.randrange(cap)
        addr = min(base + rng.choice((0, 0, 1, rng.randrange(page), page)), cap - 1)
        length = rng.choice((1, 100, page, page - 1, page + 7, 3 * page, rng.randrange(1, longest * page + 1)))
        length = min(length, cap - addr, longest * page - addr % page)
        kind = rng.random()
        if kind < 0.38:
            ops.append(("read", addr, length, now))
        elif kind < 0.76:
            ops.append(("write", addr, length, now))
        elif kind < 0.88:
            ops.append(("prefetch", addr, min(length, 2 * page - addr % page), now))
        elif kind < 0.95:
            ops.append(("run_until", now))
        elif kind < 0.98:
            ops.append(("tick", now))
        else:
            ops.append(("flush", now))
        recent = (recent + [addr])[-12:]
    return ops


def run_ops(ctl: Controller, ops) -> list:
    """Each operation through ``ctl``; a prefetch is waited for and released three operations later (or at
    the end). Returns what each returned or raised."""
    results, held = [], []

    def settle(until: int | None):
        while held and (until is None or held[0][0] <= until):
            _, handle, at = held.pop(0)
            try:
                done = ctl.wait(handle, at)
                results.append(("released", done, ctl.release(handle, done)))
            except ChmError as exc:
                results.append(("wait-error", exc.errno, str(exc)))

    for i, op in enumerate(ops):
        settle(i)
        kind, now = op[0], op[-1]
        try:
            if kind == "read":
                results.append(tuple(ctl.read(op[1], op[2], now)))
            elif kind == "write":
                results.append(tuple(ctl.write(op[1], None, op[2], now)))
            elif kind == "prefetch":
                issued = ctl.prefetch(op[1], op[2], now)
                held.append((i + 3, issued.handle, issued.ack))
                results.append(tuple(issued))
            elif kind == "run_until":
                results.append(("ran", ctl.run_until(now), ctl.next_event_ns(now), ctl.quiet_until(now)))
            elif kind == "tick":
                ctl.tick(now)
                results.append(("ticked", ctl.next_event_ns(now)))
            else:
                results.append(("flushed", ctl.flush(now)))
        except WriteBufferFull as exc:
            results.append(("refused", exc.new_pages, str(exc)))
        except ChmError as exc:
            results.append(("error", exc.errno, str(exc)))
    settle(None)
    return results


def assert_same(make_ctl, ops, tail) -> tuple[Controller, list]:
    native, python = make_ctl(), python_controller(make_ctl())
    assert native.flusher.dev is not None
    got = run_ops(native, ops)
    assert got == run_ops(python, ops)
    for table in (area.table for area in native.policy.areas):
        table.check()
    assert device_state(native) == device_state(python)
    assert native.flusher.dev is not None  # stayed native all along
    assert run_ops(native, tail) == run_ops(python, tail)
    assert device_state(native) == device_state(python)
    return native, got


# ---- equivalence ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", NATIVE_POLICIES)
@pytest.mark.parametrize("seed", [1, 2])
def test_random_operations_run_natively_as_in_python(policy, seed):
    more = {"policy.lru_writeback_delay_ns": 400_000.0, "policy.flush_max_delay_ns": 200_000.0}
    cfg = tiny_config(policy, 16, more)
    ops = random_ops(cfg, seed, 700)
    native, results = assert_same(lambda: Controller(cfg, None), ops[:550], ops[550:])
    s = native.snapshot()
    kinds = {r[0] for r in results if isinstance(r[0], str)}
    assert s["evictions"] and s["flush_batches"] and s["page_misses"] and s["merged_misses"] and s["rmw_reads"]
    assert s["flushed_pages"] > s["flush_batches"] and native.events_run and "released" in kinds
    if policy == "hymcache":
        assert s["refused_writes"] and "refused" in kinds
    else:
        assert s["dirty_evictions"]


@pytest.mark.parametrize("policy", ["lru", "sieve"])
def test_every_frame_pinned_by_flushes_in_flight_waits_for_them_as_in_python(policy):
    """A write of the whole DRAM, flushed: every frame is pinned by a flight; the next read and write find a
    frame only once the flights have landed (Controller._allocate), natively too."""
    cfg = tiny_config(policy, 8, {"policy.lru_writeback_delay_ns": 10_000.0})
    page = cfg.device.page_size_bytes
    ops = [("write", 0, 8 * page, 0.0), ("run_until", 2e4), ("read", 100 * page, page, 2e4 + 1),
           ("write", 200 * page, 2 * page, 2e4 + 2), ("read", 0, 3 * page, 2e4 + 3)]
    native, python = Controller(cfg, None), python_controller(Controller(cfg, None))
    assert run_ops(native, ops[:2]) == run_ops(python, ops[:2])
    pinned = lib.chm_ft_pinned_ways(native.policy.read_area.table._c, 0)
    assert pinned == 8 and len(native.flights) == 4  # runs of 2 pages: 2-page stripes
    assert run_ops(native, ops[2:]) == run_ops(python, ops[2:])
    assert native.stats["dirty_evictions"] == 0 and not native.flights
    assert device_state(native) == device_state(python)


@pytest.mark.parametrize("policy", ["lru", "hymcache"])
def test_a_mooncake_replay_prefix_runs_natively_as_in_python(policy):
    """The replay the issue times (paper profile, Llama-3.1-8B blocks), on the trace's first requests."""
    block = get_model("llama-3.1-8b").block_bytes(128)
    results = []
    for native in (True, False):
        trace = MooncakeTrace(mooncake_conversation_trace(), block, 128, limit=120)
        small = {"dram.size_bytes": 2 << 30, "policy.prefetch_window_bytes": 512 << 20}  # evictions, merges
        replay = Replay(replay_config("paper", policy, small), policy, trace, progress=False)
        if not native:
            python_controller(replay.ctl)
        result = replay.run()
        result.pop("speed")
        results.append((result, device_state(replay.ctl)))
        assert (replay.ctl.flusher.dev is not None) == native
    assert results[0] == results[1]
    device = results[0][0]["device"]
    assert device["flushed_pages"] and (device["evictions"] and device["page_misses"] if policy == "lru" else
                                        device["prefetch_staged_pages"] and device["prefetch_resident_pages"])


# ---- native or Python: chosen once ----------------------------------------------------------------

def test_a_method_replaced_on_a_native_flusher_changes_nothing_it_stays_native():
    """The choice is made when the controller is built: replacing a method later does not bring the state
    back to Python (a test watching a method builds the Python path: python_controller)."""
    cfg = tiny_config("lru", 16, {"policy.lru_writeback_delay_ns": 1e6})
    ops = random_ops(cfg, 5, 300)
    native, python = Controller(cfg, None), python_controller(Controller(cfg, None))
    started = []
    start_flush = native.flusher.start_flush
    native.flusher.start_flush = lambda entries, now: (started.append(now), start_flush(entries, now))
    assert run_ops(native, ops) == run_ops(python, ops)
    assert native.flusher.dev is not None and not started  # the C flusher started the flushes
    native.flusher.__dict__.pop("start_flush")
    assert device_state(native) == device_state(python)


def test_the_state_brought_back_to_python_midway_carries_on_there():
    cfg = tiny_config("lru", 16, {"policy.lru_writeback_delay_ns": 1e6})
    ops = random_ops(cfg, 5, 300)
    native, python = Controller(cfg, None), python_controller(Controller(cfg, None))
    assert run_ops(native, ops[:150]) == run_ops(python, ops[:150])
    assert native.flusher.pending() != (0, 0)  # something to carry over
    native.flusher.to_python()
    started = []
    start_flush = native.flusher.start_flush
    native.flusher.start_flush = lambda entries, now: (started.append(now), start_flush(entries, now))
    assert run_ops(native, ops[150:]) == run_ops(python, ops[150:])
    assert native.flusher.dev is None and started
    native.flusher.__dict__.pop("start_flush")
    assert device_state(native) == device_state(python)


def test_a_policy_method_replaced_on_the_python_path_is_called():
    cfg = tiny_config("hymcache")
    ctl = python_controller(Controller(cfg, None))
    ctl.write(0, None, 4 * KiB, 0.0)
    ctl.policy.next_flush_at = lambda dirty, now, reads_idle_at: None  # never
    assert ctl.next_event_ns(0.0) is None and ctl.flusher.dev is None and ctl.dirty


@pytest.mark.parametrize("policy", ["libcachesim:LRU", "test-ops-plugin"])
def test_other_policies_keep_the_flusher_in_python(policy):
    with fifo_plug_in("test-ops-plugin"):
        ctl = Controller(tiny_config(policy), None)
        assert ctl.native_ops_problem() is not None and ctl.flusher.dev is None


def test_data_on_keeps_the_flusher_in_python(tmp_path):
    cfg = tiny_config("lru").with_overrides({"emulation.data": True})
    ctl = Controller(cfg, tmp_path / "media", log=lambda line: None, format_media=True)
    try:
        assert ctl.native_ops_problem() == "emulation.data is on" and ctl.flusher.dev is None
    finally:
        ctl.close(0.0)
