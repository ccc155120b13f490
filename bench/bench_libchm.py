"""libchm against its floors, side by side in one run.

(a) 4 KiB DRAM-hit read latency through libchm from C (p50, p99) next to a
    bare C shared-memory ring round trip between two processes (the floor),
    the two taking turns in rounds (medians of the rounds);
(b) 16 MiB DRAM-hit read throughput through libchm, copy path and zero-copy
    path, next to single-thread memcpy of the same size (the three taking
    turns; medians of the repetitions), with 64 KiB and with 2 MiB pages,
    the two devices' runs interleaved (shares: medians of 5 runs);
(c) CPU used by an idle ``chm serve``;
(d) chm_mmap (issue 26, bench_map.c): 4 KiB first-touch reads through a fresh
    mapping (faults served by its handler thread, and CHM_MAP_INLINE: in the
    faulting thread) against chm_read of the same 4 KiB, sequential and random, on DRAM
    hits and on misses (every contender in turn in each round, same pages),
    the kernel's floors for such a first touch beside them (a frame of a memfd
    mapped over the page, MAP_FIXED, and touched; and, with no VMA operation at
    all, a userfaultfd MINOR fault delivered as SIGBUS and one UFFDIO_CONTINUE:
    no device, no handler of ours),
    memcpy out of resident mapped pages against memcpy of private memory, and
    the time from a device's kill -9 to its client's mapping being withdrawn.

Goals (issue 11, the native hit path): p50 <= 5x the floor; zero-copy >= 90 %
of memcpy, copy >= 80 %, with either page size. Issue 26: first-touch p50 <=
2x chm_read's in each case; resident reads >= 0.9x memcpy; withdrawal within
about 100 ms.

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
FIRST_TOUCH_GOAL_X_READ = 2.0  # first-touch p50 through the mapping over chm_read's
RESIDENT_GOAL = 0.90  # of memcpy
WITHDRAW_GOAL_MS = 100.0
# The mapping cases' device: lru (chm_mmap needs a one-area policy), 512 frames of 64 KiB, so 256 pages fit and
# a read of 512 others evicts them.
MAP_DEVICE = ("--policy", "lru", "--set", "dram.size_bytes=33554432", "--set", "policy.prefetch_window_bytes=4194304")
MAP_PAGES = 256
MAP_CASES = ("hit_seq", "hit_rand", "miss_seq", "miss_rand")
MAP_MODES = {"map": "chm_mmap", "inline": "chm_mmap CHM_MAP_INLINE"}  # bench_map's contenders: who serves a fault
FLOORS = {  # bench_map's floors of a random no-copy first touch, no device, no handler of ours
    "rand_floor": "mmap(MAP_FIXED) of a frame + its first touch",
    "rand_fault_delivery": "a userfaultfd MINOR fault as SIGBUS + one UFFDIO_CONTINUE, frames at their pages' "
                           "offsets (no VMA operation)",
}
CUT_OFF_LEASE_MS = 100  # chm serve's default --map-lease-ms


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


def _map_cases(work: Path, node: str, exe: Path, rounds: int, deaths: int) -> dict:
    """(d): first touches against chm_read, resident reads against memcpy, and the withdrawal after a kill."""
    serve = _Serve(work / "media-map", node + "-map", *MAP_DEVICE)
    try:
        lines = {r["what"]: r for r in _run_json([str(exe), "touch", node + "-map", str(MAP_PAGES), str(rounds)])}
        resident = _run_json([str(exe), "resident", node + "-map", str(16 << 20), "20"])[0]
        scan = _run_json([str(exe), "scan", node + "-map", str(MAP_PAGES), str(max(3, rounds))])[0]
    finally:
        serve.stop()
    cut_off_ms = _cut_off_ms(work, node, exe)
    withdrawn = []
    for i in range(deaths):  # a device of its own each time, killed under a client holding a mapping
        victim = _Serve(work / f"media-death{i}", f"{node}-death{i}", *MAP_DEVICE)
        client = subprocess.Popen([str(exe), "death", f"{node}-death{i}"], stdout=subprocess.PIPE, text=True)
        try:
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError("bench_map death did not get ready")
            victim.proc.kill()
            victim.proc.wait()
            result = json.loads(client.stdout.readline())
            withdrawn.append(result["withdrawn_after_ns"] / 1e6)
        finally:
            client.wait(timeout=60)
            for leftover in Path("/dev/shm").glob(f"{node}-death{i}*"):
                leftover.unlink()
    cases = {case: {"read": lines[case + "_read"],
                    **{mode: lines[f"{case}_{mode}"] for mode in MAP_MODES},
                    **{f"x_read_{mode}": lines[f"{case}_{mode}"]["p50_ns"] / max(1, lines[case + "_read"]["p50_ns"])
                       for mode in MAP_MODES}}
             for case in MAP_CASES}
    floors = {name: lines[name] for name in FLOORS if name in lines}
    for floor in floors.values():
        floor["x_read"] = floor["p50_ns"] / max(1, lines["hit_rand_read"]["p50_ns"])
    return {"first_touch": cases, "floors": floors, "stats": lines["stats"], "resident": resident, "scan": scan,
            "cut_off_ms": cut_off_ms, "lease_ms": CUT_OFF_LEASE_MS,
            "resident_share": resident["mapped_gbps"] / resident["memcpy_gbps"],
            "withdrawn_ms": withdrawn, "withdrawn_ms_median": statistics.median(withdrawn) if withdrawn else None}


def _cut_off_ms(work: Path, node: str, exe: Path) -> float:
    """A client that stops (SIGSTOP, holding a lease) until the device has cut it off: ms from its stop."""
    import libchm

    name = node + "-stall"
    serve = _Serve(work / "media-stall", name, *MAP_DEVICE, "--map-lease-ms", str(CUT_OFF_LEASE_MS),
                   "--map-max-expired", "1")
    client = subprocess.Popen([str(exe), "stall", name], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "CHM_MAP_TEST_STALL_AT": "1"})
    try:
        if client.stdout.readline().strip() != "ready":
            raise RuntimeError("bench_map stall did not get ready")
        stat = Path(f"/proc/{client.pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":  # stopped in its fault, lease held
            time.sleep(0.0002)
        stopped = time.monotonic()
        with libchm.Device(name) as dev:
            while dev.stats()["map_clients_cut_off"] == 0:
                time.sleep(0.0005)
            return (time.monotonic() - stopped) * 1e3
    finally:
        client.kill()
        client.wait()
        serve.stop()


def _print_map(mapped: dict, rounds: int) -> None:
    print(f"(d) chm_mmap, 4 KiB first touches of {MAP_PAGES} pages x {rounds} rounds, each contender in turn "
          f"(goal: p50 <= {FIRST_TOUCH_GOAL_X_READ:g}x chm_read's)      p50          p99")
    for case, r in mapped["first_touch"].items():
        for who, name in (("read", "chm_read"), *MAP_MODES.items()):
            label = f"{case.replace('_', ' ')}: " + (name if who == "read" else f"first touch via {name}")
            x = "" if who == "read" else \
                f"  p50 {r['x_read_' + who]:.2f}x ({_goal(r['x_read_' + who] <= FIRST_TOUCH_GOAL_X_READ)})"
            print(f"    {label:<54} {r[who]['p50_ns'] / 1000:8.2f} us  {r[who]['p99_ns'] / 1000:8.2f} us{x}")
    for name, fl in mapped["floors"].items():
        print(f"    kernel floor, random: {FLOORS[name]}, no device: {fl['p50_ns'] / 1000:.2f} us p50 = "
              f"{fl['x_read']:.2f}x chm_read's hit")
    res = mapped["resident"]
    print(f"    resident mapped pages, 16 MiB memcpy: {res['mapped_gbps']:.2f} GB/s, private memory "
          f"{res['memcpy_gbps']:.2f} GB/s ({mapped['resident_share']:.0%}; "
          f"{_goal(mapped['resident_share'] >= RESIDENT_GOAL)}: >= {RESIDENT_GOAL:.0%})")
    scan = mapped["scan"]
    print(f"    scan of {scan['pages']} resident pages, whole-page reads: chm_read {scan['read_gbps']:.2f} GB/s, "
          f"fresh mapping {scan['map_gbps']:.2f} GB/s, CHM_MAP_STRICT {scan['strict_gbps']:.2f} GB/s")
    print(f"    a client stopped holding a lease (--map-lease-ms {mapped['lease_ms']}, --map-max-expired 1): cut off "
          f"{mapped['cut_off_ms']:.1f} ms after it stopped")
    ms = mapped["withdrawn_ms_median"]
    if ms is not None:
        print(f"    kill -9 of the device -> mapping withdrawn (SIGBUS): median {ms:.2f} ms of "
              f"{len(mapped['withdrawn_ms'])} ({_goal(ms <= WITHDRAW_GOAL_MS)}: about {WITHDRAW_GOAL_MS:g} ms)")


def _map_rows(mapped: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for case, r in mapped["first_touch"].items():
        for mode, name in MAP_MODES.items():
            rows.append((f"4 KiB first touch via {name}, {case.replace('_', ' ')}, p50 / p99",
                         f"{r[mode]['p50_ns'] / 1000:.2f} / {r[mode]['p99_ns'] / 1000:.2f} µs",
                         f"chm_read of the same 4 KiB: {r['read']['p50_ns'] / 1000:.2f} / "
                         f"{r['read']['p99_ns'] / 1000:.2f} µs (p50 {r['x_read_' + mode]:.2f}x)",
                         f"p50 ≤ {FIRST_TOUCH_GOAL_X_READ:g}x chm_read"))
    for name, fl in mapped["floors"].items():
        rows.append((f"kernel floor of a no-copy 4 KiB first touch, rand: {FLOORS[name]}, no device, p50 / p99",
                     f"{fl['p50_ns'] / 1000:.2f} / {fl['p99_ns'] / 1000:.2f} µs",
                     f"chm_read hit rand p50 {mapped['first_touch']['hit_rand']['read']['p50_ns'] / 1000:.2f} µs "
                     f"(floor {fl['x_read']:.2f}x)", "the least such a mapping pays"))
    res = mapped["resident"]
    rows.append(("16 MiB memcpy out of resident mapped pages", f"{res['mapped_gbps']:.2f} GB/s",
                 f"memcpy of private memory {res['memcpy_gbps']:.2f} GB/s ({mapped['resident_share']:.0%})",
                 f"≥ {RESIDENT_GOAL:.0%}"))
    scan = mapped["scan"]
    rows.append((f"scan of {scan['pages']} resident pages (whole-page reads): fresh mapping / CHM_MAP_STRICT",
                 f"{scan['map_gbps']:.2f} / {scan['strict_gbps']:.2f} GB/s", f"chm_read {scan['read_gbps']:.2f} GB/s",
                 "the cost of strict counts"))
    rows.append(("client stopped holding a lease → cut off", f"{mapped['cut_off_ms']:.1f} ms",
                 f"--map-lease-ms {mapped['lease_ms']}, --map-max-expired 1", "within the lease bound"))
    if mapped["withdrawn_ms_median"] is not None:
        rows.append(("device kill -9 → client's mapping withdrawn (SIGBUS)",
                     f"{mapped['withdrawn_ms_median']:.2f} ms (median of {len(mapped['withdrawn_ms'])})", "",
                     f"≈ {WITHDRAW_GOAL_MS:g} ms"))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_libchm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000, help="latency samples per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=10, help="latency rounds, floor and device in turn (default 10)")
    parser.add_argument("--size", type=int, default=16 << 20, help="throughput read size in bytes (default 16 MiB)")
    parser.add_argument("--reps", type=int, default=20, help="throughput repetitions per run (default 20)")
    parser.add_argument("--runs", type=int, default=5,
                        help="throughput runs, the two page sizes in turn; medians of the runs (default 5)")
    parser.add_argument("--map-rounds", type=int, default=5, help="chm_mmap first-touch rounds (default 5)")
    parser.add_argument("--deaths", type=int, default=3, help="device kills timed for the withdrawal (default 3)")
    args = parser.parse_args(argv)
    if args.iters < 100 or args.rounds < 1 or args.size < 4096 or args.size > (32 << 20) or args.reps < 1 \
            or args.runs < 1:
        parser.error("--iters >= 100, --rounds >= 1, --size in [4096, 32 MiB], --reps >= 1, --runs >= 1")

    subprocess.run(["make", "-s", "-C", str(LIBCHM)], check=True)
    work = Path(tempfile.mkdtemp(prefix="chm-bench-", dir="/var/tmp"))
    try:
        exe = work / "bench_libchm"
        map_exe = work / "bench_map"
        for source, out in (("bench_libchm.c", exe), ("bench_map.c", map_exe)):
            subprocess.run(["cc", "-O2", "-Wall", str(HERE / source), "-o", str(out), f"-I{LIBCHM / 'include'}",
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
        mapped = _map_cases(work, node, map_exe, args.map_rounds, args.deaths)
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
    _print_map(mapped, args.map_rounds)
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
    rows += _map_rows(mapped)
    result_files.write("bench_libchm", rows, {
        "latency": {"floor": floor, "libchm": lat, "modelled": modelled, "x_floor": x_floor},
        "throughput": {"size": args.size, "page_64k": tput, "page_2m": tput_big}, "idle_cpu_pct": idle_pct,
        "mmap": mapped, "iters": args.iters, "rounds": args.rounds, "reps": args.reps, "runs": args.runs,
        "map_rounds": args.map_rounds}, argv)
    return 0 if tput["data_ok"] and tput_big["data_ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
