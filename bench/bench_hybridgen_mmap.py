"""HybridGen's decode with CXL-resident V rows mapped (loads through ``libchm.Device.mmap``) vs explicit reads.

SmolLM2-135M decodes greedily with HybridGen (post-QKᵀ pinned at K, so both paths do the same work) under a
host-DRAM budget that holds the offloaded K alone: the offloaded V rows live in the CXL tier, a real
``chm serve --policy lru`` (the small profile: 64 KiB pages). Two paths, in interleaved rounds (their
order alternating, so load from other processes hits both alike), each a fresh engine per round:

* ``read``: V rows by explicit ``chm_read`` requests, one per run of selected slots (the baseline;
  ``--baseline in-process`` runs it on an ``emulator.Device`` in this process, HybridGen's default tier);
* ``mapped``: V rows as a tensor over a mapping of the same served device (``v_tier="mapped"``).

Figures: the median wall time of a decode step per path (over every step of every round) and the median
transfer time of a step (``StepStats.t_tx``: fetching the selected rows), and whether both decoded the same
tokens. The device's DRAM holds every page: this is the hit path, the cost of the access method itself.

Results: ``bench/results/bench_hybridgen_mmap.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import result_files

PATHS = ("read", "mapped")
BASELINES = ("served", "in-process")


def decode(model, ids: list[int], opts, cxl, steps: int) -> tuple[list[int], list[float], list[float]]:
    """Prefill (untimed), then ``steps`` greedy steps: (tokens, wall seconds per step, t_tx per step)."""
    from host_runtime.hybridgen.engine import Engine

    with Engine(model, opts, cxl=cxl) as eng:
        logits = eng.prefill(torch.tensor(ids))
        tokens, walls = [], []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            t0 = time.perf_counter()
            logits = eng.step(tokens[-1])
            walls.append(time.perf_counter() - t0)
        return tokens, walls, [s.t_tx for s in eng.steps]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_hybridgen_mmap", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length, tokens (default 1024)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round and path (default 32)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--k", type=int, default=128, help="offloaded tokens selected per step and layer (default 128)")
    ap.add_argument("--resident-budget", type=int, default=32, help="tokens per layer on the accelerator")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--baseline", default="served", choices=BASELINES,
                    help="where the read path's tier is: the same chm serve (default) or in this process")
    args = ap.parse_args(argv)
    for name in ("prompt_tokens", "steps", "rounds", "k", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} is outside the allowed range: >= 1")
    if args.resident_budget < 0:
        ap.error(f"--resident-budget {args.resident_budget} is outside the allowed range: >= 0")

    import libchm
    from host_runtime.hybridgen.engine import EngineOptions
    from host_runtime.hybridgen.evaluate import long_english_text
    from host_runtime.hybridgen.model import SmolLM2
    from host_runtime.hybridgen.tokenizer import Tokenizer
    from tests.emulator.serve.serving import Server

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    model = SmolLM2.load()
    tok = Tokenizer.from_gguf(model.tokenizer_reader)
    text_ids = tok.encode(long_english_text())
    if args.prompt_tokens > len(text_ids):
        ap.error(f"--prompt-tokens {args.prompt_tokens} is outside the allowed range: [1, {len(text_ids)}]")
    ids = text_ids[:args.prompt_tokens]
    cfg = model.cfg
    row_all_layers = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # one token's K over every layer, fp32
    # host DRAM for the K of every token offloaded by the last step: K never spills, and V goes to the CXL
    # tier (all but the newest ``steps`` tokens' after the prompt, all of it by the last step)
    offloaded = max(0, args.prompt_tokens - args.resident_budget) + args.steps
    base = dict(method="hybridgen", strategy="post", k_min=args.k, k_max=args.k,
                resident_budget=args.resident_budget, capacity=args.prompt_tokens + args.steps + 8,
                host_dram_bytes=offloaded * row_all_layers)
    walls = {p: [] for p in PATHS}
    txs = {p: [] for p in PATHS}
    tokens = {}
    try:
        with tempfile.TemporaryDirectory(prefix="chm-bench-hgmmap-", dir="/var/tmp") as work, \
                Server(Path(work), None, "--policy", "lru", "--format") as srv, libchm.Device(srv.node) as dev:
            for r in range(args.rounds):
                for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    if path == "mapped":
                        opts, cxl = EngineOptions(**base, v_tier="mapped"), dev
                    else:
                        opts, cxl = EngineOptions(**base), (dev if args.baseline == "served" else None)
                    got, w, t = decode(model, ids, opts, cxl, args.steps)
                    walls[path] += w
                    txs[path] += t
                    tokens.setdefault(path, got)
                    if got != tokens[path]:
                        raise RuntimeError(f"path {path} decoded {got} in round {r}, {tokens[path]} before")
            stats = dev.stats()
    finally:
        torch.set_num_threads(threads)
    same = tokens["read"] == tokens["mapped"]
    ms = {p: 1e3 * statistics.median(walls[p]) for p in PATHS}
    tx = {p: 1e3 * statistics.median(txs[p]) for p in PATHS}
    print(f"SmolLM2-135M, {args.prompt_tokens}-token prompt, {args.steps} steps x {args.rounds} rounds per path, "
          f"K {args.k}, {args.resident_budget} resident, {args.threads} thread(s); read path's tier: {args.baseline}")
    for p in PATHS:
        print(f"  {p:<7} decode step {ms[p]:8.2f} ms (median)   transfer {tx[p]:7.2f} ms (median t_tx)")
    print(f"  mapped / read: step {ms['mapped'] / ms['read']:.2f}x, transfer {tx['mapped'] / tx['read']:.2f}x; "
          f"same tokens: {same}")
    rows = [("HybridGen decode step, V mapped (median)", f"{ms['mapped']:.2f} ms",
             f"explicit reads ({args.baseline}) {ms['read']:.2f} ms ({ms['mapped'] / ms['read']:.2f}x)", "≤ 1.00x"),
            ("V transfer per step, mapped (median t_tx)", f"{tx['mapped']:.2f} ms",
             f"explicit reads {tx['read']:.2f} ms ({tx['mapped'] / tx['read']:.2f}x)", "≤ 1.00x"),
            ("same tokens on both paths", str(same), "", "True")]
    result_files.write("bench_hybridgen_mmap", rows, {
        "prompt_tokens": args.prompt_tokens, "steps": args.steps, "rounds": args.rounds, "k": args.k,
        "resident_budget": args.resident_budget, "threads": args.threads, "baseline": args.baseline,
        "step_ms_median": ms, "t_tx_ms_median": tx, "step_s": walls, "t_tx_s": txs, "tokens": tokens,
        "device_map_counters": {k: v for k, v in stats.items() if k.startswith("map_")}}, argv)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
