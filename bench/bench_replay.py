"""Replay speed as users see it: the ``chm replay`` command, end to end, beside libCacheSim (issue 23).

Every measured run is a whole process, started here and timed from its start until it exits:

* ``chm replay TRACE ... --out DIR --no-plot``, exactly as a user types it (reading the trace, the replay, the
  table on stdout, ``replay.json`` written);
* the peer, ``python -c`` that imports ``libcachesim``, opens the same trace with its ``TraceReader`` (same
  format, same parameters) and runs ``process_trace`` with the same cache (LRU or S3FIFO).

Peak RSS is each child's ``ru_maxrss`` as ``os.wait4`` reports it (the kernel's figure for its process tree:
the largest RSS any one process of it reached), the child forked by a launcher of a few MiB, not by the bench
(``run_process``).

Cases (``--cases``; the defaults are issue 23's acceptance):

* ``csv-lru``, ``csv-s3fifo``: a libCacheSim-format CSV trace the bench writes itself (seeded): ``--requests``
  requests (2,000,000), zipf alpha 1.2 over 500,000 objects, times uniform over an hour (sorted), one 4 KiB
  object per request; ``chm replay ... --sequential --block-bytes 4KiB`` on a device DRAM of 50,000 pages of
  the paper profile (2 MiB each; one 4 KiB block takes a page), beside libCacheSim's LRU / S3FIFO holding
  50,000 such objects (``cache_size`` = 50,000 x 4 KiB bytes). Goal: at least 1.0x libCacheSim's speed; peak
  RSS at most 2x libCacheSim's.
* ``mooncake-lru``: the whole Mooncake conversation trace (``../shared/data/traces/``), one 2 MiB page per hash
  id, 16,384 pages of DRAM, ``--sequential`` lru (the oracle test's setting), beside libCacheSim's LRU of
  16,384 objects on the same page accesses (an oracleGeneral file of the hash ids in file order, written in
  the bench's setup). Goal: at least 0.5x.
* ``csv-lru-vt``, ``csv-s3fifo-vt``, ``mooncake-lru-vt``: the same ``chm replay`` commands without
  ``--sequential`` (virtual time, overlapping requests, the timing model on), beside the same peer. Goal: at
  least 0.3x.

Runs are interleaved (chm, peer, chm, peer, ... for each case in turn, ``--runs`` rounds); the medians
count. ratio = the peer's median wall / chm's (a speed ratio). In sequential mode the misses in
``replay.json`` (``cache.misses``) must equal libCacheSim's (its miss ratio x requests) in every run; a
difference fails the bench. Without ``--sequential`` requests overlap and the counts differ by design.

Two in-process sections follow, neither of them what users run:

* ``device-only``: the sequential Mooncake replay's recorded device operations through a fresh
  ``Controller.run_sequential`` (native) beside ``process_trace`` in this process (issue 11's figure);
* ``span``: the cost of a trace's span, the same requests at ``--time-scale 1000`` beside ``--time-scale 1``
  (virtual time jumps from event to event; goal: a ratio of at most ``SPAN_COST_GOAL``).

Results: a table on stdout, each command beside its figure, and ``--out`` (``bench/results/replay``)
``bench_replay.json`` with its table, ``bench_replay.md``. The traces live in a temporary directory (``--workdir`` to keep them), never in
the repository.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import result_files

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "replay"

# The synthetic CSV trace (issue 23)
REQUESTS = 2_000_000
OBJECTS = 500_000
ZIPF_ALPHA = 1.2
SPAN_S = 3600  # times uniform over an hour
OBJ_BYTES = 4096
CSV_CACHE_PAGES = 50_000
SEED = 20260
TRACE_PARAMS = "time-col=1,obj-id-col=2,obj-size-col=3,delimiter=,,has-header=true"
# The Mooncake setting (tests/host_runtime/test_replay_oracle.py)
MOONCAKE_CACHE_PAGES = 16_384
MOONCAKE_TOKENS_PER_HASH = 512
RUNS = 5
RSS_GOAL = 2.0  # chm replay's peak RSS over libCacheSim's, at most (the CSV cases)

# The in-process sections
DEVICE_ONLY_RUNS = 5
SPAN_REQUESTS = 100  # the time-scale comparison's prefix: ~1 s a replay, 20 replays
SPAN_RUNS = 5  # replays per setting, the settings interleaved; the median counts
TIME_SCALES = (1.0, 1000.0)
SPAN_COST_GOAL = 1.5  # wall time at --time-scale 1000 over --time-scale 1


@dataclass
class Case:
    name: str
    trace: str  # "csv" or "mooncake"
    policy: str  # the device policy = libCacheSim's cache
    sequential: bool
    speed_goal: float  # peer wall / chm wall, at least
    rss_goal: float | None  # chm RSS / peer RSS, at most
    runs: dict = field(default_factory=lambda: {"chm": [], "peer": []})


CASES = {
    "csv-lru": Case("csv-lru", "csv", "lru", True, 1.0, RSS_GOAL),
    "csv-s3fifo": Case("csv-s3fifo", "csv", "s3fifo", True, 1.0, RSS_GOAL),
    "mooncake-lru": Case("mooncake-lru", "mooncake", "lru", True, 0.5, None),
    "csv-lru-vt": Case("csv-lru-vt", "csv", "lru", False, 0.3, RSS_GOAL),
    "csv-s3fifo-vt": Case("csv-s3fifo-vt", "csv", "s3fifo", False, 0.3, RSS_GOAL),
    "mooncake-lru-vt": Case("mooncake-lru-vt", "mooncake", "lru", False, 0.3, None),
}
SECTIONS = ("device-only", "span")
LCS_CACHES = {"lru": "LRU", "s3fifo": "S3FIFO"}  # device policy -> libcachesim class (default parameters = ours)


# ---------------------------------------------------------------------------------------------- the traces

def write_zipf_csv(path: Path, requests: int, objects: int = OBJECTS, alpha: float = ZIPF_ALPHA,
                   seed: int = SEED) -> dict:
    """A libCacheSim-format CSV (``time,obj_id,obj_size`` and a header): ``requests`` requests, object ranks
    drawn from a zipf(``alpha``) over ``objects`` objects (ids 1..objects, a seeded permutation of the ranks),
    integer times uniform over ``SPAN_S`` seconds, sorted; every object ``OBJ_BYTES``. Deterministic."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, objects + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(requests), side="right"), objects - 1)
    ids = rng.permutation(objects)[ranks] + 1
    times = np.sort(rng.integers(0, SPAN_S, requests))
    size = str(OBJ_BYTES)
    with path.open("w") as f:
        f.write("time,obj_id,obj_size\n")
        f.writelines(f"{t},{o},{size}\n" for t, o in zip(times.tolist(), ids.tolist()))
    return {"requests": requests, "objects": objects, "distinct_objects": int(np.unique(ids).size),
            "zipf_alpha": alpha, "span_s": SPAN_S, "obj_size": OBJ_BYTES, "seed": seed, "bytes": path.stat().st_size}


def write_mooncake_pages(path: Path, jsonl: Path) -> dict:
    """Every hash id of every request of the Mooncake JSONL, in file order, as an oracleGeneral trace of objects
    of size 1 (the oracle test's access sequence)."""
    from host_runtime.replay.lcs_trace import write_oracle_general

    with jsonl.open() as f:
        ids = [h for line in f if line.strip() for h in json.loads(line)["hash_ids"]]
    write_oracle_general(path, ((0, h, 1) for h in ids))
    return {"requests": len(ids), "objects": len(set(ids))}


# ------------------------------------------------------------------------------------- the two commands

def _exe(name: str) -> str:
    """``name`` beside this interpreter (the project's venv), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def chm_command(case: Case, trace: Path, out: Path, page: int) -> list[str]:
    argv = [_exe("chm"), "replay", str(trace)]
    if case.trace == "csv":
        argv += ["--trace-format", "csv", "--trace-params", TRACE_PARAMS, "--profile", "paper", "--policy", "lru",
                 "--device-policy", case.policy] + (["--sequential"] if case.sequential else []) + \
                ["--block-bytes", "4KiB", "--set", f"dram.size_bytes={CSV_CACHE_PAGES * page}"]
    else:
        argv += ["--profile", "paper", "--policy", "lru", "--device-policy", case.policy] + \
                (["--sequential"] if case.sequential else []) + \
                ["--tokens-per-block", str(MOONCAKE_TOKENS_PER_HASH), "--block-bytes", "2MiB",
                 "--set", f"dram.size_bytes={MOONCAKE_CACHE_PAGES * page}",
                 "--set", f"policy.prefetch_window_bytes={page}"]
    return argv + ["--out", str(out), "--no-plot"]


def peer_command(case: Case, trace: Path) -> list[str]:
    """``python -c``: import libcachesim, open the trace, ``process_trace``, print the (object, byte) miss ratios."""
    from host_runtime.replay.lcs_trace import parse_trace_params

    cache = LCS_CACHES[case.policy]
    if case.trace == "csv":
        params = "; ".join(f"p.{k} = {json.dumps(v) if isinstance(v, str) else repr(v)}"  # "," reads well in '...'
                           for k, v in parse_trace_params(TRACE_PARAMS).items())
        code = (f"import sys, libcachesim as lcs; p = lcs.ReaderInitParam(); {params}; "
                f"r = lcs.TraceReader(sys.argv[1], lcs.TraceType.CSV_TRACE, p); "
                f"c = lcs.{cache}(cache_size={CSV_CACHE_PAGES * OBJ_BYTES}); print(*c.process_trace(r))")
    else:
        code = (f"import sys, libcachesim as lcs; "
                f"r = lcs.TraceReader(sys.argv[1], lcs.TraceType.ORACLE_GENERAL_TRACE); "
                f"c = lcs.{cache}(cache_size={MOONCAKE_CACHE_PAGES}); print(*c.process_trace(r))")
    return [sys.executable, "-c", code, str(trace)]


# Forks and times the measured command from a process of a few MiB. Linux keeps a process's peak RSS across
# exec and starts a child's at its parent's RSS at fork time, so a child of the bench itself (hundreds of MiB
# after writing the trace) would report at least that much, whatever it used.
_LAUNCHER = """import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{time.perf_counter() - t0} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""


def run_process(argv: list[str], log: Path) -> dict:
    """Run ``argv`` as a child (cwd: the repository, stdout and stderr to ``log``), forked by a small launcher
    (``_LAUNCHER``): its wall time from fork to exit, its peak RSS (``os.wait4``'s ``ru_maxrss``: its process
    tree's largest) and its output. A failure raises, with the end of its output."""
    measured = log.with_suffix(".rusage")
    with log.open("wb") as f:
        subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, str(measured), *argv], cwd=ROOT,
                       stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, check=True)
    wall, maxrss_kib, returncode = measured.read_text().split()
    text = log.read_text(errors="replace")
    if int(returncode) != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {returncode}:\n{text[-3000:]}")
    return {"wall_s": float(wall), "rss_bytes": int(maxrss_kib) * 1024, "output": text}


# ------------------------------------------------------------------------------------------- end to end

def _show(argv: list[str], work: Path) -> str:
    """The command line as one would type it: the work directory as $WORK, paths in the repository relative."""
    text = shlex.join(argv).replace(str(work), "$WORK")
    return text.replace(str(ROOT) + "/", "").replace(str(ROOT.parent) + "/", "../")


def end_to_end(cases: list[Case], requests: int, runs: int, work: Path, seed: int) -> tuple[dict, bool]:
    from emulator.config import load_profile
    from emulator.shared_data import mooncake_conversation_trace

    page = load_profile("paper").device.page_size_bytes
    traces, setting = {}, {}
    if any(c.trace == "csv" for c in cases):
        t0 = time.perf_counter()
        traces["csv"] = work / "zipf.csv"
        setting["csv"] = write_zipf_csv(traces["csv"], requests, seed=seed)
        print(f"wrote $WORK/zipf.csv: {requests:,} requests, zipf {ZIPF_ALPHA} over {OBJECTS:,} objects "
              f"({setting['csv']['distinct_objects']:,} touched), times uniform over {SPAN_S} s, {OBJ_BYTES} B each, "
              f"seed {seed} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if any(c.trace == "mooncake" for c in cases):
        traces["mooncake"] = mooncake_conversation_trace()
        traces["mooncake-pages"] = work / "mooncake-pages.oracleGeneral"
        setting["mooncake"] = write_mooncake_pages(traces["mooncake-pages"], traces["mooncake"])
        print(f"wrote $WORK/mooncake-pages.oracleGeneral: the {setting['mooncake']['requests']:,} hash ids of "
              f"{traces['mooncake']} in file order (the peer's trace)", flush=True)
    commands = {}
    for c in cases:
        out = work / "out" / c.name
        chm = chm_command(c, traces[c.trace], out, page)
        peer = peer_command(c, traces["csv" if c.trace == "csv" else "mooncake-pages"])
        commands[c.name] = {"chm": chm, "peer": peer, "out": out}
    ok = True
    for i in range(runs):
        for c in cases:
            cmd = commands[c.name]
            (cmd["out"] / "replay.json").unlink(missing_ok=True)
            chm = run_process(cmd["chm"], work / f"{c.name}-{i}-chm.log")
            report = cmd["out"] / "replay.json"
            if not report.is_file():
                raise RuntimeError(f"{_show(cmd['chm'], work)} wrote no {report}")
            written = json.loads(report.read_text())  # one run: its result; several: a list
            cache = (written[0] if isinstance(written, list) else written)["cache"]
            chm.update(misses=cache["misses"], accesses=cache["accesses"])
            peer = run_process(cmd["peer"], work / f"{c.name}-{i}-peer.log")
            n = setting[c.trace]["requests"]
            miss_ratio = float(peer["output"].split()[0])
            peer.update(misses=round(miss_ratio * n), accesses=n, miss_ratio=miss_ratio)
            for r in (chm, peer):
                del r["output"]
            c.runs["chm"].append(chm)
            c.runs["peer"].append(peer)
            equal = chm["misses"] == peer["misses"] and chm["accesses"] == peer["accesses"]
            if c.sequential and not equal:
                ok = False
            print(f"  run {i + 1}/{runs} {c.name:<16} chm {chm['wall_s']:7.2f} s {chm['rss_bytes'] / 2**20:6.0f} MiB"
                  f"   peer {peer['wall_s']:6.2f} s {peer['rss_bytes'] / 2**20:5.0f} MiB   misses {chm['misses']:,} / "
                  f"{peer['misses']:,}" + ("" if equal or not c.sequential else "  DIFFER"), flush=True)
    summary = [summarize(c, commands[c.name], work) for c in cases]
    print_table(summary, runs, work)
    return {"page_bytes": page, "traces": setting, "cases": summary}, ok


def summarize(c: Case, cmd: dict, work: Path) -> dict:
    med = {who: {k: statistics.median(r[k] for r in c.runs[who]) for k in ("wall_s", "rss_bytes")}
           for who in ("chm", "peer")}
    speed = med["peer"]["wall_s"] / med["chm"]["wall_s"]
    rss = med["chm"]["rss_bytes"] / med["peer"]["rss_bytes"]
    misses_equal = all(a["misses"] == b["misses"] and a["accesses"] == b["accesses"]
                       for a, b in zip(c.runs["chm"], c.runs["peer"]))
    return {
        "case": c.name, "trace": c.trace, "device_policy": c.policy, "sequential": c.sequential,
        "accesses": c.runs["peer"][-1]["accesses"],
        "chm_command": _show(cmd["chm"], work), "peer_command": _show(cmd["peer"], work),
        "median": med, "speed_ratio": speed, "speed_goal": c.speed_goal, "speed_goal_met": speed >= c.speed_goal,
        "rss_ratio": rss, "rss_goal": c.rss_goal, "rss_goal_met": None if c.rss_goal is None else rss <= c.rss_goal,
        "misses": {"chm": c.runs["chm"][-1]["misses"], "peer": c.runs["peer"][-1]["misses"],
                   "equal_every_run": misses_equal, "must_be_equal": c.sequential},
        "runs": c.runs,
    }


def _verdict(met: bool | None) -> str:
    return "" if met is None else ("met" if met else "MISSED")


def print_table(summary: list[dict], runs: int, work: Path) -> None:
    print(f"\nchm replay end to end beside libcachesim process_trace, whole processes, medians of {runs} interleaved "
          f"runs (speed = peer wall / chm wall; RSS = each child's peak)")
    head = (f"  {'case':<16} {'accesses':>10} {'chm s':>8} {'peer s':>7} {'speed':>8} {'goal':>13} "
            f"{'chm MiB':>8} {'peer MiB':>8} {'RSS':>6} {'goal':>12}  misses chm / peer")
    print(head)
    for s in summary:
        m = s["median"]
        rss_goal = f"<={s['rss_goal']:g}x {_verdict(s['rss_goal_met'])}" if s["rss_goal"] else ""
        misses = s["misses"]
        same = ("equal" if misses["equal_every_run"] else "DIFFER") if misses["must_be_equal"] else "(overlap: differ)"
        print(f"  {s['case']:<16} {s['accesses']:>10,} {m['chm']['wall_s']:>8.2f} {m['peer']['wall_s']:>7.2f} "
              f"{s['speed_ratio']:>7.3f}x {'>=' + format(s['speed_goal'], 'g') + 'x ' + _verdict(s['speed_goal_met']):>13} "
              f"{m['chm']['rss_bytes'] / 2**20:>8.0f} {m['peer']['rss_bytes'] / 2**20:>8.0f} {s['rss_ratio']:>5.1f}x "
              f"{rss_goal:>12}  {misses['chm']:,} / {misses['peer']:,} {same}")
        print(f"      chm:  {s['chm_command']}")
        print(f"      peer: {s['peer_command']}")
    print(f"  ($WORK = {work})")


# ------------------------------------------------------------------------------- in process: not what users run

def device_only(runs: int = DEVICE_ONLY_RUNS) -> dict:
    """The sequential Mooncake replay's device operations through ``Controller.run_sequential`` (native), beside
    ``libcachesim``'s ``process_trace`` LRU in this process, on the same page accesses; misses checked equal."""
    import libcachesim as lcs

    from emulator.config import load_profile
    from emulator.controller import Controller, sequential_ops
    from emulator.shared_data import mooncake_conversation_trace
    from host_runtime.replay import MooncakeTrace, Replay, replay_config
    from host_runtime.replay.lcs_trace import write_oracle_general

    page = load_profile("paper").device.page_size_bytes
    cfg = replay_config("paper", "lru", {"dram.size_bytes": MOONCAKE_CACHE_PAGES * page,
                                         "policy.prefetch_window_bytes": page})
    trace = MooncakeTrace(mooncake_conversation_trace(), block_bytes=page, tokens_per_block=MOONCAKE_TOKENS_PER_HASH)
    replay = Replay(cfg, "lru", trace, progress=False, record_ops=True, sequential=True)
    expected = replay.run()["cache"]["misses"]
    ops = replay.ops
    pages = [addr // page for _, addr, _ in ops]  # one page per block in this setting
    arrays = sequential_ops(ops)  # made outside the timed region, as libCacheSim's trace file is
    walls: dict[str, list[float]] = {"device": [], "libcachesim": []}
    with tempfile.TemporaryDirectory(prefix="chm-bench-replay-") as tmp:
        path = write_oracle_general(Path(tmp) / "mooncake-pages.oracleGeneral", ((0, p, 1) for p in pages))
        for _ in range(runs):
            ctl = Controller(cfg, None)
            t0 = time.perf_counter()
            done = ctl.run_sequential(*arrays, 0.0)
            walls["device"].append(time.perf_counter() - t0)
            if done.native_ops != len(ops):
                raise AssertionError(f"only {done.native_ops} of {len(ops)} operations took the native path: "
                                     f"{ctl.native_sequential_problem()}")
            misses = ctl.stats["page_misses"] + done.write_misses
            reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
            cache = lcs.LRU(MOONCAKE_CACHE_PAGES)
            t0 = time.perf_counter()
            miss_ratio, _ = cache.process_trace(reader)
            walls["libcachesim"].append(time.perf_counter() - t0)
            lcs_misses = round(miss_ratio * len(pages))
            if not misses == lcs_misses == expected:
                raise AssertionError(f"misses differ: device path {misses}, replay {expected}, libCacheSim {lcs_misses}")
    med = {name: statistics.median(w) for name, w in walls.items()}
    ratio = med["libcachesim"] / med["device"]
    print(f"\ndevice only (not what users run): the sequential Mooncake replay's {len(pages):,} page accesses "
          f"({MOONCAKE_CACHE_PAGES:,} pages, lru), in this process, median of {runs} interleaved runs")
    print(f"  {'path':<44} {'page acc/s':>12} {'wall s':>7} {'misses':>8}")
    print(f"  {'device: Controller.run_sequential (native)':<44} {len(pages) / med['device']:>12,.0f} "
          f"{med['device']:>7.3f} {expected:>8,}")
    print(f"  {'peer: libcachesim LRU process_trace':<44} {len(pages) / med['libcachesim']:>12,.0f} "
          f"{med['libcachesim']:>7.3f} {lcs_misses:>8,}")
    print(f"  ratio {ratio:.2f}x")
    return {"label": "device only (not what users run)", "accesses": len(pages), "misses": expected,
            "median_wall_s": med, "ratio": ratio, "walls": walls}


def span_cost() -> dict:
    """Wall time of the same requests spread over 1000 times the virtual time, beside the original (in process)."""
    from emulator.shared_data import mooncake_conversation_trace
    from host_runtime.replay import MooncakeTrace, Replay, get_model, replay_config

    block = get_model("llama-3.1-8b").block_bytes(128)
    path = mooncake_conversation_trace()
    traces = {scale: MooncakeTrace(path, block, 128, limit=SPAN_REQUESTS, time_scale=scale) for scale in TIME_SCALES}
    low, high = TIME_SCALES
    print(f"\nspan cost (in process): first {SPAN_REQUESTS} Mooncake requests at --time-scale {high:g} vs {low:g}, "
          f"paper profile, 16 MiB blocks, median of {SPAN_RUNS} interleaved runs (goal: at most {SPAN_COST_GOAL:g}x)")
    print(f"  {'policy':<10} {'time-scale':>10} {'virtual s':>10} {'wall s':>7} {'events':>7}  ratio")
    out = {}
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
            verdict = f"  {ratio:.2f}x ({'goal met' if ratio <= SPAN_COST_GOAL else 'goal MISSED'})" \
                if scale == high else ""
            print(f"  {variant:<10} {scale:>10g} {r['virtual_s']:>10.1f} {median[scale]:>7.2f} "
                  f"{r['speed']['background_events']:>7}{verdict}")
        out[variant] = {"median_wall_s": {str(s): median[s] for s in TIME_SCALES}, "ratio": ratio,
                        "goal": SPAN_COST_GOAL, "goal_met": ratio <= SPAN_COST_GOAL}
    return out


# ------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    known = list(CASES) + list(SECTIONS)
    p = argparse.ArgumentParser(prog="python -m bench.bench_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=REQUESTS, help=f"requests of the CSV trace (default {REQUESTS:,})")
    p.add_argument("--runs", type=int, default=RUNS, help=f"interleaved runs per case (default {RUNS})")
    p.add_argument("--cases", default=",".join(known), help=f"comma-separated, of {', '.join(known)} (default: all)")
    p.add_argument("--seed", type=int, default=SEED, help=f"the CSV trace's seed (default {SEED})")
    p.add_argument("--workdir", type=Path, help="keep the traces, logs and replay.json here (default: a temporary "
                                                "directory, removed afterwards)")
    p.add_argument("--out", type=Path, default=OUT, help="where bench_replay.json goes (default bench/results/replay)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        p.error(f"--cases: {', '.join(bad) or repr(args.cases)} not among {', '.join(known)}")
    for name in ("requests", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be >= 1")
    cases = [CASES[n] for n in CASES if n in names]
    result: dict = {
        "bench": "bench_replay", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(), "python": platform.python_version(),
                 "commit": _git_commit()},
        "setting": {"requests": args.requests, "runs": args.runs, "cases": names, "seed": args.seed},
    }
    ok = True
    if cases:
        work = args.workdir or Path(tempfile.mkdtemp(prefix="chm-bench-replay-"))
        work.mkdir(parents=True, exist_ok=True)
        try:
            result["end_to_end"], ok = end_to_end(cases, args.requests, args.runs, work.resolve(), args.seed)
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        if not ok:
            print("bench_replay: sequential misses DIFFER from libCacheSim's (see the runs above)")
    if "device-only" in names:
        result["device_only"] = device_only()
    if "span" in names:
        result["span_cost"] = span_cost()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_replay.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(result, argv))
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} and its .md")
    return 0 if ok else 1


def markdown(result: dict, argv: list[str] | None = None) -> str:
    """``bench_replay.md``: the table of a run's ``bench_replay.json`` (``result``), which the docs link."""
    host = result["host"]
    meta = {"bench": "bench_replay", "command": ".venv/bin/python -m bench.bench_replay", "arguments": list(argv or ()),
            "utc": result["date"], "commit": (host["commit"] or "")[:7] or None, "cpus": host["cpus"],
            "load_average": [round(x, 2) for x in host["loadavg_at_start"]]}
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    rows = []
    for s in result.get("end_to_end", {}).get("cases", []):
        m, misses = s["median"], s["misses"]
        rows.append((f"`{s['case']}`: {'--sequential' if s['sequential'] else 'virtual time'}, {s['device_policy']}",
                     f"{s['accesses']:,}", f"{m['chm']['wall_s']:.2f} s", f"{m['peer']['wall_s']:.2f} s",
                     f"{s['speed_ratio']:.2f}x (goal >= {s['speed_goal']:g}x: {_verdict(s['speed_goal_met'])})",
                     f"{mib(m['chm']['rss_bytes'])} / {mib(m['peer']['rss_bytes'])} MiB",
                     f"{misses['chm']:,} / {misses['peer']:,}"))
    if "device_only" in result:
        d = result["device_only"]
        rows.append((f"{d['label']}: Controller.run_sequential", f"{d['accesses']:,}",
                     f"{d['median_wall_s']['device']:.3f} s", f"{d['median_wall_s']['libcachesim']:.3f} s",
                     f"{d['ratio']:.2f}x", "", f"{d['misses']:,}"))
    for variant, span in result.get("span_cost", {}).items():
        walls = " / ".join(f"{float(scale):g}: {s:.3f} s" for scale, s in span["median_wall_s"].items())
        rows.append((f"span cost, {variant}: the same requests at each --time-scale", "", walls, "",
                     f"{span['ratio']:.2f}x (goal <= {span['goal']:g}x: {_verdict(span['goal_met'])})", "", ""))
    columns = ("case", "page accesses", "chm replay", "libcachesim", "speed", "peak RSS, chm / peer",
               "misses, chm / peer")
    commands = [f"* `{s['case']}`: `{s['chm_command']}`; peer: `{s['peer_command']}`"
                for s in result.get("end_to_end", {}).get("cases", [])]
    return result_files.markdown(meta, "bench_replay.json", columns, rows) + "\n" + "\n".join(commands) + "\n"


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
