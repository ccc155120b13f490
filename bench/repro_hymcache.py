"""Reproduce the HyMCache paper's device-level results by trace replay (``make repro``).

    python -m bench.repro_hymcache                  # everything (tens of minutes)
    python -m bench.repro_hymcache fig5 randread    # some of it

Experiments (all in virtual time on the emulator's controller, data off):

* ``fig5``      -- cmmh profile (256 GiB DRAM as LRU, 200 Gbps link), 64 requests x 32 blocks per
                   turn, 16/64/168 MiB blocks: read bandwidth per turn and the turn it collapses. Then
                   the same workload on the paper prototype, lru and hymcache side by side with the
                   cost of what was not served: blocks recomputed, their modelled prefill time (A100,
                   host_runtime/replay/prefill.py) and the time to serve each turn including it; and
                   hymcache with one mechanism changed (flushes also during reads; a 45% write buffer)
                   to say which one is responsible.
* ``hymcache``  -- paper profile (64 GiB DRAM) with hymcache, the same workload: read bandwidth
                   per turn, staging bounded by the windows, refused writes.
* ``randread``  -- random whole-object reads from a populated 256 GiB region, hymcache with
                   prefetch on vs off, for 1..8 clients (the paper: +37% with prefetch).
* ``mooncake``  -- the Mooncake conversation trace, lru vs hymcache, paper profile, Llama-3.1-8B
                   blocks: per-window and whole-hour bandwidth and hit rate.
* ``sim13``, ``sim10``, ``sim12``, ``sim11``, ``sim14``, ``sim15`` -- the serving simulation's presets (``chm hymcache
                   simulate --figure N``: Fig. 13 single node, Fig. 10 PD 4P-1D-1S, Fig. 12 its staging sweep,
                   Fig. 11 Mooncake over NVMe-oF, Fig. 14 LMCache with a Redis tier, Fig. 15b/c the device
                   prefetch on and off),
                   every tier of the preset; the table as the command prints it, JSON and PNG to
                   ``bench/results/sim/figN.{json,png}``.
* ``claims``    -- every claim of the paper's serving evaluation judged at the presets (``chm hymcache claims``);
                   ``bench/results/claims/claims.{json,md}`` (the README's table).
* ``claims-map`` -- the claims map (``chm hymcache sweep --claims``): every parameter the paper leaves open
                   (host_runtime/hymcache/sim/claims_map.py PARAMETERS), each value one simulation of its figure's
                   preset on Dask, judged by the paper's claims; ``bench/results/claims_map/claims_map.{json,md,png}``.

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
PAGE = 2 * MiB  # the paper and cmmh profiles' page


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
    rp = Replay(replay_config(spec["profile"], spec["policy"], spec.get("overrides")), spec["policy"], w, bucket_ns=spec.get("window_s", 600) * 1e9,
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


# fig5's counterfactuals: hymcache on the paper profile with one mechanism changed
FIG5_HYMCACHE_CHANGES = {
    "flush during reads": {"policy.flush_max_reads_in_flight": 1 << 20},  # read priority off: flush whenever due
    "45% write buffer": {"policy.write_buffer_fraction": 0.45},  # 28.8 GiB buffer (the read staging keeps 35.2 GiB)
}


def fig5() -> None:
    print("== Figure 5: cmmh (256 GiB DRAM as LRU), 64 requests x 32 blocks per turn ==")
    sizes = (16, 64, 168)
    specs = [{"name": f"fig5-{b}MiB", "workload": "microbench", "profile": "cmmh", "policy": "lru", "block_mib": b,
              "turns": FIG5_TURNS[b]} for b in sizes]
    paper = [{"name": f"fig5-paper-{p}-{b}MiB", "workload": "microbench", "profile": "paper", "policy": p,
              "block_mib": b, "turns": FIG5_TURNS[b]} for b in sizes for p in ("lru", "hymcache")]
    changed = [{"name": f"fig5-paper-hymcache-{b}MiB-{c.replace(' ', '-').replace('%', 'pct')}",
                "workload": "microbench", "profile": "paper", "policy": "hymcache", "block_mib": b,
                "turns": FIG5_TURNS[b], "overrides": ov, "change": c}
               for b in sizes for c, ov in FIG5_HYMCACHE_CHANGES.items()]
    everything = _run_all(specs + paper + changed)
    results, paper_results, changed_results = everything[:3], everything[3:9], everything[9:]
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
    print("  recomputed blocks (cmmh lru): " + ", ".join(f"{r['spec']['block_mib']} MiB {r['total']['recomputed_blocks']}"
                                                       for r in results))
    _save("fig5_cmmh_lru", results, "Figure 5: CMM-H-class LRU device, 64 req x 32 blocks/turn",
          [f"{r['spec']['block_mib']} MiB blocks" for r in results])
    _fig5_recompute(results, paper_results, changed_results)


def _fig5_recompute(cmmh: list[dict], paper: list[dict], changed: list[dict]) -> None:
    """lru and hymcache side by side with what was not served counted (driver.py's docstring)."""
    p = paper[1]["recompute"]
    print(f"\n== Figure 5 with recomputation counted: paper profile (64 GiB DRAM, 2 SSDs), lru vs hymcache ==\n"
          f"  an unserved block of an earlier turn is recomputed: prefill of {p['tokens_per_block']} tokens/block on "
          f"{p['gpus']} x {p['gpu']} at {p['mfu']:.0%} of {p['peak_flops'] / 1e12:g} TFLOP/s\n"
          f"  (16 MiB: llama-3.1-8b, 64 MiB: llama-2-7b, 168 MiB: opt-30b); serve s = read s + recomp s")
    head = (f"  {'block':>7} {'turn':>5} | {'cmmh lru':>8} | {'lru: read GB/s':>14} {'blk read':>8} {'serve s':>8} | "
            f"{'hymcache: read GB/s':>19} {'blk read':>8} {'refused':>7} {'recomp blk':>10} {'read s':>7} "
            f"{'recomp s':>8} {'serve s':>8} | {'hym/lru':>7}")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for i, r in enumerate(cmmh):
        b = r["spec"]["block_mib"]
        lru, hym = paper[2 * i], paper[2 * i + 1]
        for c, l, h in zip(r["rows"] + [r["total"]], lru["rows"] + [lru["total"]], hym["rows"] + [hym["total"]]):
            ratio = f"{h['serve_s'] / l['serve_s']:.2f}x" if l["serve_s"] else "-"
            print(f"  {b:>4} MiB {str(h['bucket']).replace('turn ', ''):>5} | {c['serve_s']:>8.2f} | "
                  f"{l['read_gbps']:>14.2f} {l['blocks_read']:>8} {l['serve_s']:>8.2f} | {h['read_gbps']:>19.2f} "
                  f"{h['blocks_read']:>8} {h['refused_writes']:>7} {h['recomputed_blocks']:>10} {h['read_s']:>7.2f} "
                  f"{h['recompute_s']:>8.2f} {h['serve_s']:>8.2f} | {ratio:>7}")
    print("  (cmmh lru: the Figure-5 device's serve s, nothing recomputed; lru on the paper profile recomputes "
          f"{sum(x['total']['recomputed_blocks'] for x in paper[0::2])} blocks in all)")
    print("\n  hymcache, one mechanism changed (totals over all turns):")
    print(f"  {'block':>7}  {'hymcache':<20} {'written':>7} {'refused':>7} {'recomp blk':>10} {'read s':>7} "
          f"{'recomp s':>8} {'serve s':>8}  {'flushed GiB':>11}  {'peak write buffer':>17}")
    for i, r in enumerate(cmmh):
        b = r["spec"]["block_mib"]
        for name, x in [("as built", paper[2 * i + 1])] + [(c["spec"]["change"], c) for c in changed[2 * i:2 * i + 2]]:
            t, d = x["total"], x["dram"]
            print(f"  {b:>4} MiB  {name:<20} {t['blocks_written']:>7} {t['refused_writes']:>7} {t['recomputed_blocks']:>10} "
                  f"{t['read_s']:>7.2f} {t['recompute_s']:>8.2f} {t['serve_s']:>8.2f}  "
                  f"{x['device']['flushed_pages'] * PAGE / GiB:>11.1f}  "
                  f"{d['peak_write_buffer_bytes'] / GiB:>7.1f} of {d['write_buffer_bytes'] / GiB:>4.1f} GiB")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fig5_recompute.json").write_text(json.dumps(paper + changed, indent=1) + "\n")
    _plot_fig5_recompute(paper, OUT / "fig5_recompute.png")
    print(f"  wrote {OUT / 'fig5_recompute'}.json and .png")


def _plot_fig5_recompute(paper: list[dict], path: Path) -> None:
    """Per block size: each turn's serve time, device read (solid) + recomputation (hatched), lru beside hymcache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, lru, hym in zip(axes, paper[0::2], paper[1::2]):
        turns = [row["bucket"].replace("turn ", "") for row in lru["rows"]]
        xs = range(len(turns))
        for off, r, color in ((-0.2, lru, "tab:blue"), (0.2, hym, "tab:orange")):
            read = [row["read_s"] for row in r["rows"]]
            ax.bar([x + off for x in xs], read, 0.4, color=color, label=f"{r['policy']}: device read")
            ax.bar([x + off for x in xs], [row["recompute_s"] for row in r["rows"]], 0.4, bottom=read, color=color,
                   alpha=0.45, hatch="//", label=f"{r['policy']}: recomputation")
        ax.set_xticks(list(xs), turns)
        ax.set_xlabel("turn")
        ax.set_title(f"{lru['workload']['block_bytes'] >> 20} MiB blocks ({lru['recompute']['model']})", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("time to serve the turn (s)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Figure 5 workload on the paper profile: serve time with recomputation counted (A100 prefill)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


SIM_OUT = ROOT / "bench" / "results" / "sim"


def _sim(fig: str) -> None:
    """``chm hymcache simulate --figure FIG --json ... --plot ...`` (the preset unchanged), in this process."""
    from host_runtime.hymcache.sim.config import load_settings, preset_path
    from host_runtime.hymcache.sim.report import plot, table
    from host_runtime.hymcache.sim.run import simulate, write_json

    s = load_settings(preset_path(fig))
    title = f"Fig. {fig}: {s.get('figure.title', '')}"
    print(f"== {title} ==")
    result = simulate(s, progress=sys.stderr.isatty())
    print("\n".join("  " + line for line in table(result).splitlines()))
    print(f"  simulated {len(result['summary'])} run(s) in {result['wall_s']:.1f} s of wall time")
    SIM_OUT.mkdir(parents=True, exist_ok=True)
    write_json(result, str(SIM_OUT / f"fig{fig}.json"))
    plot(result, str(SIM_OUT / f"fig{fig}.png"), title)
    print(f"  wrote {SIM_OUT / f'fig{fig}'}.json and .png")


def sim13() -> None:
    _sim("13")


def sim10() -> None:
    _sim("10")


def sim12() -> None:
    _sim("12")


def sim11() -> None:
    _sim("11")


def sim14() -> None:
    _sim("14")


def sim15() -> None:
    _sim("15")


CLAIMS_OUT = ROOT / "bench" / "results" / "claims"
CLAIMS_MAP_OUT = ROOT / "bench" / "results" / "claims_map"


def claims() -> None:
    """``chm hymcache claims --out bench/results/claims``: every claim's verdict at the presets."""
    from host_runtime.hymcache.sim.claims import figures, judge, markdown, write_verdicts

    print("== The paper's serving claims at the presets (chm hymcache claims) ==")
    verdicts = judge(figures(), progress=sys.stderr.isatty())
    print("\n".join("  " + line for line in markdown(verdicts).splitlines()))
    print(f"  wrote {', '.join(str(p) for p in write_verdicts(verdicts, CLAIMS_OUT))}")


def claims_map() -> None:
    """``chm hymcache sweep --claims --out bench/results/claims_map`` (a LocalCluster of one worker per CPU)."""
    from host_runtime.hymcache.sim.claims_map import claims_map as run_map
    from host_runtime.hymcache.sim.claims_map import format_map, write_map

    print("== The claims map: each claim of the paper over every parameter it leaves open ==")
    m = run_map(progress=sys.stderr.isatty(), announce=True)
    print("\n".join("  " + line for line in format_map(m).splitlines()))
    paths = write_map(m, CLAIMS_MAP_OUT)
    print(f"  wrote {', '.join(str(p) for p in paths)}")


EXPERIMENTS = {"fig5": fig5, "hymcache": hymcache, "randread": randread, "mooncake": mooncake,
               "sim13": sim13, "sim10": sim10, "sim12": sim12, "sim11": sim11, "sim14": sim14, "sim15": sim15,
               "claims": claims, "claims-map": claims_map}


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
