"""``chm hymcache simulate``: the whole Fig. 13 preset (all its tiers) and the whole Fig. 10 preset, wall time.

Issue 12's goal: the whole Fig. 13 preset, all its tiers, runs in at most ``GOAL_S`` (2 minutes) on the 2-core
machine. Fig. 10 (4P-1D-1S PD, Qwen2.5-32B, ~1.5 TB of reusable KV) is timed the same way beside it, with the
same goal for reference. Each figure runs as ``simulate`` runs it for the command line (the workload, every tier
in turn, the speedups); per tier, its wall time and its simulated events. The bench fails if Fig. 13 misses
its goal. Results: ``bench/results/bench_sim.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench import result_files

GOAL_S = 120.0
FIGURES = ("13", "10")


def run_figure(fig: str) -> tuple[float, dict]:
    from host_runtime.hymcache.sim.config import load_settings, preset_path
    from host_runtime.hymcache.sim.run import simulate

    s = load_settings(preset_path(fig))
    t0 = time.perf_counter()
    result = simulate(s)
    return time.perf_counter() - t0, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench bench_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("figures", nargs="*", default=list(FIGURES), help=f"presets to time (default: {' '.join(FIGURES)})")
    args = parser.parse_args(argv)
    status, rows, details = 0, [], {}
    for fig in args.figures:
        wall, result = run_figure(fig)
        details[fig] = {"wall_s": wall, "workload": result["workload"],
                        "tiers": {name: {k: sm[k] for k in ("wall_s", "events", "makespan_s")}
                                  for name, sm in result["summary"].items()}}
        rows.append((f"`chm hymcache simulate --figure {fig}`, all {len(result['summary'])} tiers", f"{wall:.1f} s",
                     "", f"≤ {GOAL_S:g} s" + ("" if fig == "13" else " (for reference)")))
        w = result["workload"]
        print(f"  Fig. {fig}: {w['requests']} requests x {len(result['summary'])} tiers, reusable KV "
              f"{w['reusable_footprint_bytes'] / 1e12:.3f} TB", flush=True)
        for name, sm in result["summary"].items():
            print(f"    {name:<14} {sm['wall_s']:7.1f} s wall  {sm['events']:>9} events  "
                  f"{sm['events'] / max(sm['wall_s'], 1e-9) / 1e3:7.1f} k events/s  makespan {sm['makespan_s']:8.1f} s "
                  f"(simulated)", flush=True)
        verdict = "goal met" if wall <= GOAL_S else "goal MISSED"
        print(f"  Fig. {fig}, all tiers: {wall:.1f} s of wall time (goal: at most {GOAL_S:g} s{'' if fig == '13' else ', for reference'}) "
              f"-> {verdict}", flush=True)
        if fig == "13" and wall > GOAL_S:
            status = 1
    result_files.write("bench_sim", rows, details, argv)
    return status


if __name__ == "__main__":
    sys.exit(main())
