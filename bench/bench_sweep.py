"""``chm replay --sweep`` on Dask: a 4-point grid serial, then on a LocalCluster of 2 single-threaded workers.

Issue 12's goal: a 4-point sweep of tasks of at least 30 s each takes at most ``GOAL`` of the serial time on
a ``LocalCluster`` with 2 single-threaded workers. The grid is ``--sweep device_policy=lru,fifo,clock,sieve``
over the HyMCache microbenchmark (``--policy lru``, paper profile, 64 MiB blocks, ``CONCURRENCY`` requests,
``TURNS`` turns): four points of about the same cost, each over 30 s on the 2-core box. Serial: the four points one after
another in this process (the same ``run_point`` a worker runs). Parallel: ``run_sweep`` -- cluster start,
the four tasks, gather, cluster close -- all timed. The results must be equal point by point (rows and
totals), or the bench fails. Results: ``bench/results/bench_sweep.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench import result_files

GOAL = 0.6
TASK_GOAL_S = 30.0
TURNS = 40
CONCURRENCY = 256  # tasks of >= 30 s (the native data-off controller made 64 x 14 turns, once ~32 s, take ~2.5 s)
POLICIES = ("lru", "fifo", "clock", "sieve")


def _specs(turns: int, concurrency: int = CONCURRENCY):
    from emulator.cli import build_parser
    from host_runtime.replay.sweep import check_points, grid, parse_sweep

    args = build_parser().parse_args(["replay", "microbench", "--profile", "paper", "--policy", "lru",
                                      "--block-bytes", "64MiB", "--turns", str(turns), "--concurrency", str(concurrency),
                                      "--no-progress"])
    args.gpu = args.gpu.source
    return check_points(args, grid(parse_sweep([f"device_policy={','.join(POLICIES)}"])))


def _same(a: dict, b: dict) -> bool:
    return a["rows"] == b["rows"] and a["total"] == b["total"] and a["device"] == b["device"]


def main(argv: list[str] | None = None) -> int:
    from host_runtime.replay.sweep import run_point, run_sweep

    parser = argparse.ArgumentParser(prog="python -m bench bench_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=TURNS, help="microbenchmark turns (sets a task's length)")
    args = parser.parse_args(argv)
    specs = _specs(args.turns)
    print(f"  4 points: microbench {CONCURRENCY} x 32 x {args.turns} turns, 64 MiB blocks, paper profile, "
          f"device_policy = {', '.join(POLICIES)}", flush=True)
    t0 = time.perf_counter()
    serial = []
    for spec in specs:
        t = time.perf_counter()
        serial.append(run_point(spec))
        print(f"  serial   {spec['point']['device_policy']:>6}: {time.perf_counter() - t:6.1f} s", flush=True)
    serial_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    parallel = run_sweep(specs, workers=2, progress=False)
    parallel_s = time.perf_counter() - t0
    for r in parallel:
        print(f"  parallel {r['point']['device_policy']:>6}: {r['speed']['wall_s']:6.1f} s in its worker", flush=True)
    same = all(_same(a, b) for a, b in zip(serial, parallel))
    shortest = min(r["speed"]["wall_s"] for r in serial)
    ratio = parallel_s / serial_s
    print(f"  serial {serial_s:.1f} s; LocalCluster(2 workers x 1 thread) {parallel_s:.1f} s, cluster start and "
          f"close included; ratio {ratio:.2f} (goal: at most {GOAL:g}) -> {'goal met' if ratio <= GOAL else 'goal MISSED'}")
    print(f"  shortest task {shortest:.1f} s (goal: at least {TASK_GOAL_S:g} s) -> "
          f"{'met' if shortest >= TASK_GOAL_S else 'MISSED (raise --turns)'}; results equal point by point: "
          f"{'yes' if same else 'NO'}")
    result_files.write("bench_sweep", [
        (f"`chm replay --sweep`: 4 microbenchmark replays ({CONCURRENCY} requests x {args.turns} turns; tasks "
         f"{shortest:.1f} s and up), serial vs a LocalCluster of 2 single-threaded workers",
         f"{serial_s:.1f} s vs {parallel_s:.1f} s ({ratio:.2f}x), cluster start and stop included; results equal "
         f"point by point: {'yes' if same else 'NO'}", "", f"≤ {GOAL:g}x, tasks ≥ {TASK_GOAL_S:g} s")],
        {"serial_s": serial_s, "parallel_s": parallel_s, "ratio": ratio, "shortest_task_s": shortest,
         "same": same, "turns": args.turns, "concurrency": CONCURRENCY,
         "task_wall_s": {r["point"]["device_policy"]: r["speed"]["wall_s"] for r in serial}}, argv)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
