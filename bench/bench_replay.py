"""Replay speed: block accesses per second of wall time, beside a plain LRU over the same pages.

The peer is the cheapest thing that could answer "hit or miss?" for the same page stream: an
``OrderedDict`` LRU in pure Python, with no timing, pinning, flushing or prefetch. The
controller replay does all of those, so the ratio says what the full device model costs.
The paper-scale runs (and their own speeds) are ``make repro``.
"""

from __future__ import annotations

import resource
import sys
import time

from host_runtime.replay import MooncakeTrace, Replay, get_model, replay_config
from host_runtime.replay.reference import ordered_dict_lru
from emulator.shared_data import mooncake_conversation_trace

REQUESTS = 1000  # the first requests of the shared trace (the whole hour is `make repro`)


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
