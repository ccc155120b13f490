"""Replay speed: block accesses per second of wall time, beside a plain LRU over the same pages.

The peer is the cheapest thing that could answer "hit or miss?" for the same page stream: an
``OrderedDict`` LRU in pure Python, with no timing, pinning, flushing or prefetch. The
controller replay does all of those, so the ratio says what the full device model costs.
The paper-scale runs (and their own speeds) are ``make repro``.

Second, the device path against libCacheSim (issue 11's replay-speed goal): ``--sequential`` lru in the
oracle test's setting (the whole Mooncake conversation trace, one 2 MiB page per hash id, DRAM of
``ORACLE_DRAM_PAGES`` pages), the replay's recorded device operations run through a fresh controller's
``run_sequential`` (the native sequential path: the device work of a read, or of a write and its flush, per
operation; the host-side KV index is not part of the figure), beside ``libcachesim``'s ``process_trace`` LRU
on the same page accesses; medians of ``ORACLE_RUNS`` interleaved runs, misses checked equal. Goal: at least
``LIBCACHESIM_SPEED_GOAL`` of libCacheSim's rate.

Third, what a trace's span costs: the same requests with ``--time-scale 1000`` (1000 times the
virtual time, the same work) beside ``--time-scale 1``. Virtual time jumps from event to event, so
idle time should cost nothing: the goal is a ratio of at most ``SPAN_COST_GOAL``.
"""

from __future__ import annotations

import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import libcachesim as lcs

from emulator.config import load_profile
from emulator.controller import Controller, sequential_ops
from host_runtime.replay import MooncakeTrace, Replay, get_model, replay_config
from host_runtime.replay.lcs_trace import write_oracle_general
from host_runtime.replay.traces import MOONCAKE_TOKENS_PER_HASH
from host_runtime.replay.reference import ordered_dict_lru
from emulator.shared_data import mooncake_conversation_trace

REQUESTS = 1000  # the first requests of the shared trace (the whole hour is `make repro`)
SPAN_REQUESTS = 100  # the time-scale comparison's prefix: ~1 s a replay, 20 replays
SPAN_RUNS = 5  # replays per setting, the settings interleaved; the median counts
TIME_SCALES = (1.0, 1000.0)
SPAN_COST_GOAL = 1.5  # wall time at --time-scale 1000 over --time-scale 1
ORACLE_DRAM_PAGES = 16384  # one of the oracle test's cache sizes
ORACLE_RUNS = 5
LIBCACHESIM_SPEED_GOAL = 0.9  # device-path page accesses/s over libCacheSim process_trace's


def main(argv: list[str] | None = None) -> int:
    block = get_model("llama-3.1-8b").block_bytes(128)
    trace = MooncakeTrace(mooncake_conversation_trace(), block, 128, limit=REQUESTS)
    print(f"Mooncake conversation trace, first {trace.describe()['requests']} requests, Llama-3.1-8B 16 MiB blocks, "
          f"paper profile (2 MiB pages)")
    print(f"  {'replay':<34} {'block acc/s':>12} {'page acc/s':>12} {'wall s':>7}")
    for variant in ("lru", "hymcache"):
        rp = Replay(replay_config("paper", variant), variant, trace, progress=sys.stderr.isatty(), record_ops=True)
        result = rp.run()
        s = result["speed"]
        print(f"  {'controller, ' + variant:<34} {s['block_accesses_per_s']:>12.0f} {s['page_accesses_per_s']:>12.0f} "
              f"{s['wall_s']:>7.1f}")
        if variant == "lru":
            t0 = time.perf_counter()
            counts = ordered_dict_lru(rp.ops, rp.cfg.device.page_size_bytes, rp.cfg.dram_frames)
            wall, pages = time.perf_counter() - t0, counts.pages
            blocks = len(rp.ops)
            print(f"  {'peer: OrderedDict LRU, same pages':<34} {blocks / wall:>12.0f} {pages / wall:>12.0f} {wall:>7.1f}")
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    device_path_vs_libcachesim()
    span_cost(block)
    return 0


def _device_path(cfg, ops: list[tuple[str, int, int]], arrays=None) -> tuple[float, int]:
    """The recorded sequential operations (one page each) through a fresh controller's ``run_sequential``
    (each a read, or a write drained by a flush before the next access: the native sequential path):
    (wall s, page misses: read misses plus first-touch writes). ``arrays``: ``sequential_ops(ops)``, made
    outside the timed region as libCacheSim's trace file is."""
    ctl = Controller(cfg, None)
    kinds, addrs, lengths = sequential_ops(ops) if arrays is None else arrays
    t0 = time.perf_counter()
    done = ctl.run_sequential(kinds, addrs, lengths, 0.0)
    wall = time.perf_counter() - t0
    if done.native_ops != len(ops):
        raise AssertionError(f"only {done.native_ops} of {len(ops)} operations took the native path: "
                             f"{ctl.native_sequential_problem()}")
    return wall, ctl.stats["page_misses"] + done.write_misses


def _libcachesim_lru(path: Path, pages: int) -> tuple[float, int, int]:
    """libCacheSim's LRU of ``pages`` objects over an oracleGeneral file: (process_trace wall s, requests, misses)."""
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = lcs.LRU(pages)
    t0 = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    wall = time.perf_counter() - t0
    n = reader.get_num_of_req()
    return wall, n, round(miss_ratio * n)


def device_path_vs_libcachesim() -> None:
    page = load_profile("paper").device.page_size_bytes
    overrides = {"dram.size_bytes": ORACLE_DRAM_PAGES * page, "policy.prefetch_window_bytes": page}
    cfg = replay_config("paper", "lru", overrides)
    trace = MooncakeTrace(mooncake_conversation_trace(), block_bytes=page, tokens_per_block=MOONCAKE_TOKENS_PER_HASH)
    replay = Replay(cfg, "lru", trace, progress=sys.stderr.isatty(), record_ops=True, sequential=True)
    expected = replay.run()["cache"]
    ops = replay.ops
    pages = [addr // page for _, addr, _ in ops]  # one page per block in this setting
    print(f"Device path vs libCacheSim: whole Mooncake conversation trace, --sequential lru, {len(pages):,} page "
          f"accesses, {ORACLE_DRAM_PAGES} pages of DRAM; median of {ORACLE_RUNS} interleaved runs "
          f"(goal: at least {LIBCACHESIM_SPEED_GOAL:g}x libCacheSim)")
    with tempfile.TemporaryDirectory(prefix="chm-bench-replay-") as tmp:
        path = write_oracle_general(Path(tmp) / "mooncake-pages.oracleGeneral", ((0, p, 1) for p in pages))
        walls: dict[str, list[float]] = {"device": [], "libcachesim": []}
        arrays = sequential_ops(ops)
        for _ in range(ORACLE_RUNS):
            wall, misses = _device_path(cfg, ops, arrays)
            walls["device"].append(wall)
            lcs_wall, n, lcs_misses = _libcachesim_lru(path, ORACLE_DRAM_PAGES)
            walls["libcachesim"].append(lcs_wall)
            if not (misses == lcs_misses == expected["misses"] and n == len(pages)):
                raise AssertionError(f"misses differ: device path {misses}, replay {expected['misses']}, "
                                     f"libCacheSim {lcs_misses} (of {n} requests, {len(pages)} pages)")
    rates = {name: len(pages) / statistics.median(w) for name, w in walls.items()}
    ratio = rates["device"] / rates["libcachesim"]
    met = "goal met" if ratio >= LIBCACHESIM_SPEED_GOAL else "goal MISSED"
    print(f"  {'path':<44} {'page acc/s':>12} {'wall s':>7} {'misses':>8}")
    print(f"  {'device: Controller.run_sequential (native)':<44} {rates['device']:>12,.0f} "
          f"{statistics.median(walls['device']):>7.2f} {expected['misses']:>8,}")
    print(f"  {'peer: libcachesim LRU process_trace':<44} {rates['libcachesim']:>12,.0f} "
          f"{statistics.median(walls['libcachesim']):>7.2f} {lcs_misses:>8,}")
    print(f"  ratio {ratio:.3f}x ({met})")


def span_cost(block: int) -> None:
    """Wall time of the same requests spread over 1000 times the virtual time, beside the original."""
    path = mooncake_conversation_trace()
    traces = {scale: MooncakeTrace(path, block, 128, limit=SPAN_REQUESTS, time_scale=scale) for scale in TIME_SCALES}
    low, high = TIME_SCALES
    print(f"Span cost: first {SPAN_REQUESTS} requests at --time-scale {high:g} vs {low:g}, paper profile, "
          f"median of {SPAN_RUNS} interleaved runs (goal: at most {SPAN_COST_GOAL:g}x)")
    print(f"  {'policy':<10} {'time-scale':>10} {'virtual s':>10} {'wall s':>7} {'events':>7}  ratio")
    for variant in ("lru", "hymcache"):
        walls: dict[float, list[float]] = {scale: [] for scale in TIME_SCALES}
        last: dict[float, dict] = {}
        for _ in range(SPAN_RUNS):
            for scale in TIME_SCALES:
                last[scale] = Replay(replay_config("paper", variant), variant, traces[scale], progress=False).run()
                walls[scale].append(last[scale]["speed"]["wall_s"])
        median = {scale: statistics.median(walls[scale]) for scale in TIME_SCALES}
        ratio = median[high] / median[low]
        for scale in TIME_SCALES:
            r = last[scale]
            met = "goal met" if ratio <= SPAN_COST_GOAL else "goal MISSED"
            verdict = f"  {ratio:.2f}x ({met})" if scale == high else ""
            print(f"  {variant:<10} {scale:>10g} {r['virtual_s']:>10.1f} {median[scale]:>7.2f} "
                  f"{r['speed']['background_events']:>7}{verdict}")
