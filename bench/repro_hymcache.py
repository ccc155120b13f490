"""Reproduce the HyMCache paper's device-level results by trace replay (``make repro``).

    python -m bench.repro_hymcache                  # everything (tens of minutes)
    python -m bench.repro_hymcache fig5 randread    # some of it

Experiments (all in virtual time on the emulator's controller, data off):

* ``fig5``      -- cmmh profile (256 GiB DRAM as LRU, 200 Gbps link), 64 requests x 32 blocks per
                   turn, 16/64/168 MiB blocks: read bandwidth per turn and the turn it collapses.
* ``hymcache``  -- paper profile (64 GiB DRAM) with hymcache, the same workload: read bandwidth
                   per turn, staging bounded by the windows, refused writes.
* ``randread``  -- random whole-object reads from a populated 256 GiB region, hymcache with
                   prefetch on vs off, for 1..8 clients (the paper: +37% with prefetch).
* ``mooncake``  -- the Mooncake conversation trace, lru vs hymcache, paper profile, Llama-3.1-8B
                   blocks: per-window and whole-hour bandwidth and hit rate.

Every run is a fresh process, so its wall time and peak RSS are its own. Results (JSON + PNG)
go to ``bench/results/replay/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "replay"
MiB, GiB = 1 << 20, 1 << 30
FIG5_TURNS = {16: 6, 64: 6, 168: 5}
LINK_GBPS = 25.0


def _run(spec: dict) -> dict:
    """One replay in this (fresh) process."""
    from host_runtime.replay import (HymcacheMicrobench, MooncakeTrace, RandomReadBench, Replay, get_model,
                                     replay_config)

    kind = spec["workload"]
    if kind == "microbench":
        w = HymcacheMicrobench(spec["block_mib"] * MiB, 64, 32, spec["turns"])
    elif kind == "randread":
        w = RandomReadBench(spec["block_mib"] * MiB, 256 * GiB, spec["clients"], spec["reads"], seed=1)
    else:
        w = MooncakeTrace(spec["trace"], get_model("llama-3.1-8b").block_bytes(128), 128)
    rp = Replay(replay_config(spec["profile"], spec["policy"]), spec["policy"], w, bucket_ns=spec.get("window_s", 600) * 1e9,
                progress=sys.stderr.isatty(), record_ops=spec.get("reference", False))
    result = rp.run()
    if rp.ops is not None:  # the same page stream through a plain OrderedDict LRU
        from host_runtime.replay.reference import ordered_dict_lru

        ref = ordered_dict_lru(rp.ops, rp.cfg.device.page_size_bytes, rp.cfg.dram_frames)
        result["reference_lru"] = {"hit_pages": ref.read_hits, "miss_pages": ref.read_misses}
    return result


def _run_all(specs: list[dict]) -> list[dict]:
    results = []
    with ProcessPoolExecutor(max_workers=1, max_tasks_per_child=1) as pool:
        for spec, result in zip(specs, pool.map(_run, specs)):
            result["spec"] = spec
            s = result["speed"]
            print(f"  [{spec['name']}] {s['block_accesses']} block accesses in {s['wall_s']:.1f} s wall "
                  f"= {s['block_accesses_per_s']:.0f} blocks/s ({s['page_accesses_per_s']:.0f} pages/s), "
                  f"peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
            results.append(result)
    return results


def _save(name: str, results: list[dict], title: str, labels: list[str] | None = None) -> None:
    from host_runtime.replay.report import plot

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    shown = [dict(r, policy=label) for r, label in zip(results, labels)] if labels else results
    plot(shown, OUT / f"{name}.png", title)
    print(f"  wrote {OUT / name}.json and .png")


def _collapse_turn(rows: list[dict]) -> str:
    """First turn whose reads mostly miss DRAM (hit rate < 50%)."""
    for i, row in enumerate(rows):
        if i and row["hit_rate"] < 0.5:
            return f"{i} -> {i + 1}"
    return "none"


def fig5() -> None:
    print("== Figure 5: cmmh (256 GiB DRAM as LRU), 64 requests x 32 blocks per turn ==")
    specs = [{"name": f"fig5-{b}MiB", "workload": "microbench", "profile": "cmmh", "policy": "lru", "block_mib": b,
              "turns": FIG5_TURNS[b]} for b in (16, 64, 168)]
    results = _run_all(specs)
    turns = max(FIG5_TURNS.values())
    print(f"  {'turn':>4}  " + "  ".join(f"{b:>4} MiB: read GB/s  hit %" for b in (16, 64, 168)))
    for t in range(turns):
        cells = []
        for r in results:
            row = r["rows"][t] if t < len(r["rows"]) else None
            cells.append(f"{row['read_gbps']:>19.2f}  {row['hit_rate']:>5.0%}" if row else f"{'':>26}")
        print(f"  {t + 1:>4}  " + "  ".join(cells))
    for r in results:
        foot = 64 * 32 * r["spec"]["block_mib"] * MiB
        print(f"  {r['spec']['block_mib']:>3} MiB blocks: {foot / GiB:.0f} GiB per turn; collapse between turns "
              f"{_collapse_turn(r['rows'])}; collapsed read bandwidth {min(x['read_gbps'] for x in r['rows'][1:]):.2f} GB/s "
              f"(paper: ~5 GB/s; link {LINK_GBPS:g} GB/s)")
    _save("fig5_cmmh_lru", results, "Figure 5: CMM-H-class LRU device, 64 req x 32 blocks/turn",
          [f"{r['spec']['block_mib']} MiB blocks" for r in results])


def hymcache() -> None:
    print("== HyMCache: paper profile (64 GiB DRAM, hymcache), the same workload ==")
    specs = [{"name": f"hymcache-{b}MiB", "workload": "microbench", "profile": "paper", "policy": "hymcache",
              "block_mib": b, "turns": FIG5_TURNS[b]} for b in (16, 64, 168)]
    results = _run_all(specs)
    for r in results:
        d = r["dram"]
        print(f"  {r['spec']['block_mib']} MiB blocks, window {r['window_blocks']} blocks/request: peak staged "
              f"{d['peak_staged_bytes'] / GiB:.1f} GiB (windows allow {d['window_bound_bytes'] / GiB:.1f} GiB), "
              f"peak write buffer {d['peak_write_buffer_bytes'] / GiB:.1f} of {d['write_buffer_bytes'] / GiB:.0f} GiB")
        print(f"    {'turn':>6}  {'read GB/s':>9}  {'write GB/s':>10}  {'blocks read':>11}  {'written':>7}  "
              f"{'refused':>7}  {'p99 ms':>7}")
        for row in r["rows"]:
            print(f"    {row['bucket']:>6}  {row['read_gbps']:>9.2f}  {row['write_gbps']:>10.2f}  {row['blocks_read']:>11}  "
                  f"{row['blocks_written']:>7}  {row['refused_writes']:>7}  {row['read_p99_ms']:>7.1f}")
    _save("hymcache_paper", results, "HyMCache on the paper prototype, 64 req x 32 blocks/turn",
          [f"{r['spec']['block_mib']} MiB blocks" for r in results])


def randread() -> None:
    print("== Random whole-object reads, 16 MiB objects from a populated 256 GiB region (paper profile) ==")
    clients = (1, 2, 4, 8)
    specs = [{"name": f"randread-{p}-{c}", "workload": "randread", "profile": "paper", "policy": p, "block_mib": 16,
              "clients": c, "reads": 1024 // c} for c in clients for p in ("hymcache", "hymcache-noprefetch")]
    results = _run_all(specs)
    print(f"  {'clients':>7}  {'prefetch on GB/s':>16}  {'off GB/s':>8}  {'gain':>6}   (paper: +37%)")
    for i, c in enumerate(clients):
        on, off = results[2 * i]["total"]["read_gbps"], results[2 * i + 1]["total"]["read_gbps"]
        print(f"  {c:>7}  {on:>16.2f}  {off:>8.2f}  {on / off - 1:>+6.0%}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "randread.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"  wrote {OUT / 'randread.json'}")


def mooncake(window_s: float = 600) -> None:
    from emulator.shared_data import mooncake_conversation_trace

    print("== Mooncake conversation trace, paper profile, Llama-3.1-8B (16 MiB per 128-token block) ==")
    trace = str(mooncake_conversation_trace())
    specs = [{"name": f"mooncake-{p}", "workload": "mooncake", "profile": "paper", "policy": p, "trace": trace,
              "window_s": window_s, "reference": p == "lru"} for p in ("lru", "hymcache")]
    results = _run_all(specs)
    lru, ref = results[0]["total"], results[0]["reference_lru"]
    same = (lru["hit_pages"], lru["miss_pages"]) == (ref["hit_pages"], ref["miss_pages"])
    print(f"  lru device: {lru['hit_pages']} hit / {lru['miss_pages']} miss pages; OrderedDict LRU over the same pages: "
          f"{ref['hit_pages']} / {ref['miss_pages']} -> {'equal' if same else 'DIFFERENT'}")
    from host_runtime.replay.report import format_table

    print("\n".join("  " + line for line in format_table(results).splitlines()))
    print(f"  (rows: {window_s:g} s windows of the one-hour trace; 'total' is the whole hour)")
    _save("mooncake_compare", results, "Mooncake conversation trace: lru vs hymcache (paper profile)")


EXPERIMENTS = {"fig5": fig5, "hymcache": hymcache, "randread": randread, "mooncake": mooncake}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repro_hymcache", description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help=f"experiments (default: all): {', '.join(EXPERIMENTS)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.only if n not in EXPERIMENTS]
    if unknown:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}; known: {', '.join(EXPERIMENTS)}")
    t0 = time.perf_counter()
    for name in args.only or EXPERIMENTS:
        EXPERIMENTS[name]()
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
