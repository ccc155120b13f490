"""libchm against its floors, side by side in one run.

(a) 4 KiB DRAM-hit read latency through libchm from C (p50, p99) next to a
    bare C shared-memory ring round trip between two processes (the floor),
    the two taking turns in rounds (medians of the rounds);
(b) 16 MiB DRAM-hit read throughput through libchm, copy path and zero-copy
    path, next to single-thread memcpy of the same size (the three taking
    turns; medians of the repetitions), with 64 KiB and with 2 MiB pages,
    the two devices' runs interleaved (shares: medians of 5 runs);
(c) CPU used by an idle ``chm serve``.

Goals (issue 11, the native hit path): p50 <= 5x the floor; zero-copy >= 90 %
of memcpy, copy >= 80 %, with either page size.

Results: ``bench/results/bench_libchm.json`` and ``.md``.

    python -m bench bench_libchm            (or: make bench)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import result_files

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIBCHM = ROOT / "libchm"
CHM = Path(sys.executable).parent / "chm"
LATENCY_GOAL_X_FLOOR = 5.0  # 4 KiB DRAM-hit p50 over the ring floor's
ZERO_COPY_GOAL = 0.90  # of memcpy
COPY_GOAL = 0.80


def _goal(met: bool) -> str:
    return "goal met" if met else "goal MISSED"


def _run_json(cmd: list[str]) -> list[dict]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Serve:
    def __init__(self, media: Path, node: str, *args: str):
        self.proc = subprocess.Popen([str(CHM), "serve", "--node", node, "--media", str(media), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"chm serve did not start: {line}{self.proc.stderr.read()}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.communicate(timeout=120)


def _median_run(results: list[dict]) -> dict:
    """Each contender's median over the runs, as a share of the same run's memcpy; ``data_ok`` of all."""
    out = {"memcpy_gbps": statistics.median(r["memcpy_gbps"] for r in results),
           "data_ok": all(r["data_ok"] for r in results)}
    for key in ("zero_copy_gbps", "copy_gbps"):
        out[key] = out["memcpy_gbps"] * statistics.median(r[key] / r["memcpy_gbps"] for r in results)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_libchm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000, help="latency samples per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=10, help="latency rounds, floor and device in turn (default 10)")
    parser.add_argument("--size", type=int, default=16 << 20, help="throughput read size in bytes (default 16 MiB)")
    parser.add_argument("--reps", type=int, default=20, help="throughput repetitions per run (default 20)")
    parser.add_argument("--runs", type=int, default=5,
                        help="throughput runs, the two page sizes in turn; medians of the runs (default 5)")
    args = parser.parse_args(argv)
    if args.iters < 100 or args.rounds < 1 or args.size < 4096 or args.size > (32 << 20) or args.reps < 1 \
            or args.runs < 1:
        parser.error("--iters >= 100, --rounds >= 1, --size in [4096, 32 MiB], --reps >= 1, --runs >= 1")

    subprocess.run(["make", "-s", "-C", str(LIBCHM)], check=True)
    work = Path(tempfile.mkdtemp(prefix="chm-bench-", dir="/var/tmp"))
    try:
        exe = work / "bench_libchm"
        subprocess.run(["cc", "-O2", "-Wall", str(HERE / "bench_libchm.c"), "-o", str(exe), f"-I{LIBCHM / 'include'}",
                        f"-L{LIBCHM / 'build'}", f"-Wl,-rpath,{LIBCHM / 'build'}", "-lchm"], check=True)
        # lru: reads of written data hit DRAM; the profile is the CI one (64 KiB pages). The same reads
        # with 2 MiB pages: 32x fewer pages per read for the controller model. Both devices run at once,
        # so their throughput runs can take turns.
        node = f"chm-bench-{os.getpid()}"
        serve = _Serve(work / "media", node, "--policy", "lru")
        serve_big = None
        try:
            serve_big = _Serve(work / "media2", node + "-big", "--policy", "lru",
                               "--set", "device.page_size_bytes=2097152", "--set", "ssd.stripe_bytes=2097152",
                               "--set", "policy.prefetch_window_bytes=33554432")
            time.sleep(0.5)
            cpu0, t0 = _cpu_seconds(serve.proc.pid), time.monotonic()
            time.sleep(2.0)
            idle_pct = 100 * (_cpu_seconds(serve.proc.pid) - cpu0) / (time.monotonic() - t0)
            modelled, floor, lat = _run_json([str(exe), "lat", node, str(args.iters), str(args.rounds)])
            runs: dict[str, list[dict]] = {node: [], node + "-big": []}
            for _ in range(args.runs):
                for name, results in runs.items():
                    results.append(_run_json([str(exe), "tput", name, str(args.size), str(args.reps)])[0])
            tput, tput_big = (_median_run(results) for results in runs.values())
        finally:
            serve.stop()
            if serve_big is not None:
                serve_big.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    us = lambda ns: f"{ns / 1000:8.2f} us"  # noqa: E731
    x_floor = lat["p50_ns"] / max(floor["p50_ns"], 1)
    print(f"(a) 4 KiB DRAM-hit read latency, {args.rounds} rounds of {args.iters} samples (medians of the rounds)   "
          f"p50          p99")
    print(f"    bare shared-memory ring round trip (floor)  {us(floor['p50_ns'])}  {us(floor['p99_ns'])}")
    print(f"    chm_read through libchm + chm serve         {us(lat['p50_ns'])}  {us(lat['p99_ns'])}"
          f"   (min {lat['min_ns'] / 1000:.2f} us; modelled device latency {modelled['latency_ns'] / 1000:.2f} us)")
    print(f"    p50 {x_floor:.1f}x the floor ({_goal(x_floor <= LATENCY_GOAL_X_FLOOR)}: at most "
          f"{LATENCY_GOAL_X_FLOOR:g}x)")
    mb = args.size >> 20
    print(f"(b) {mb} MiB DRAM-hit read throughput, {args.runs} interleaved runs x {args.reps} reps (medians)   GB/s   % of memcpy   "
          f"(goals: zero-copy >= {100 * ZERO_COPY_GOAL:.0f} %, copy >= {100 * COPY_GOAL:.0f} %)")
    for label, t in (("64 KiB pages (profile small)", tput), ("2 MiB pages", tput_big)):
        print(f"    [{label}]")
        for name, key, goal in (("memcpy, one thread", "memcpy_gbps", None),
                                ("libchm zero-copy (chm_buffer)", "zero_copy_gbps", ZERO_COPY_GOAL),
                                ("libchm copy path", "copy_gbps", COPY_GOAL)):
            share = t[key] / t["memcpy_gbps"]
            print(f"      {name:<32} {t[key]:6.2f}   {100 * share:5.0f} %" +
                  ("" if goal is None else f"   {_goal(share >= goal)}"))
    print(f"(c) idle chm serve: {idle_pct:.2f} % of one core over 2 s (goal < 2 %)")
    rows = [("4 KiB DRAM-hit read through libchm, p50 / p99",
             f"{lat['p50_ns'] / 1000:.2f} / {lat['p99_ns'] / 1000:.2f} µs",
             f"bare shared-memory ring: {floor['p50_ns'] / 1000:.2f} / {floor['p99_ns'] / 1000:.2f} µs "
             f"(p50 {x_floor:.1f}x)", f"p50 ≤ {LATENCY_GOAL_X_FLOOR:g}x the ring")]
    for name, key, goal in (("zero-copy (chm_buffer)", "zero_copy_gbps", ZERO_COPY_GOAL),
                            ("copy path", "copy_gbps", COPY_GOAL)):
        rows.append((f"{mb} MiB DRAM-hit read, {name}, 64 KiB / 2 MiB pages",
                     f"{tput[key]:.2f} / {tput_big[key]:.2f} GB/s",
                     f"memcpy {tput['memcpy_gbps']:.2f} / {tput_big['memcpy_gbps']:.2f} GB/s "
                     f"({tput[key] / tput['memcpy_gbps']:.0%} / {tput_big[key] / tput_big['memcpy_gbps']:.0%})",
                     f"≥ {goal:.0%}"))
    rows.append(("idle `chm serve`", f"{idle_pct:.2f}% of a core", "", "< 2%"))
    result_files.write("bench_libchm", rows, {
        "latency": {"floor": floor, "libchm": lat, "modelled": modelled, "x_floor": x_floor},
        "throughput": {"size": args.size, "page_64k": tput, "page_2m": tput_big}, "idle_cpu_pct": idle_pct,
        "iters": args.iters, "rounds": args.rounds, "reps": args.reps, "runs": args.runs}, argv)
    return 0 if tput["data_ok"] and tput_big["data_ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
