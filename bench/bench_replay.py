"""Replay speed: block accesses per second of wall time, beside a plain LRU over the same pages.

The peer is the cheapest thing that could answer "hit or miss?" for the same page stream: an
``OrderedDict`` LRU in pure Python, with no timing, pinning, flushing or prefetch. The
controller replay does all of those, so the ratio says what the full device model costs.
The paper-scale runs (and their own speeds) are ``make repro``.

Second, what a trace's span costs: the same requests with ``--time-scale 1000`` (1000 times the
virtual time, the same work) beside ``--time-scale 1``. Virtual time jumps from event to event, so
idle time should cost nothing: the goal is a ratio of at most ``SPAN_COST_GOAL``.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

from host_runtime.replay import MooncakeTrace, Replay, get_model, replay_config
from host_runtime.replay.reference import ordered_dict_lru
from emulator.shared_data import mooncake_conversation_trace

REQUESTS = 1000  # the first requests of the shared trace (the whole hour is `make repro`)
SPAN_REQUESTS = 100  # the time-scale comparison's prefix: ~1 s a replay, 20 replays
SPAN_RUNS = 5  # replays per setting, the settings interleaved; the median counts
TIME_SCALES = (1.0, 1000.0)
SPAN_COST_GOAL = 1.5  # wall time at --time-scale 1000 over --time-scale 1


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
    span_cost(block)
    return 0


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
