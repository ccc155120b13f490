"""``chm replay``: drive the emulator's controller from a trace or generator, in virtual time."""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from .driver import DEFAULT_WINDOW_BYTES, VARIANTS, Replay, replay_config
from .models import MODELS, get_model, parse_bytes
from .report import format_summary, format_table, write_outputs
from .traces import ConversationGenerator, HymcacheMicrobench, MooncakeTrace, RandomReadBench

GENERATORS = ("microbench", "conversation", "randread")


def register(sub) -> None:
    p = sub.add_parser(
        "replay", help="replay a trace or generated workload on the device model (virtual time, data off)",
        description="Replay a Mooncake JSONL trace or a generated workload on the emulator's controller with "
                    "emulation.data = false, and report per turn (or per time window) read/write bandwidth, DRAM "
                    "hit rate, refused writes and modelled block-read latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("trace", metavar="TRACE_OR_GENERATOR",
                   help=f"a Mooncake JSONL file, or a generator: {', '.join(GENERATORS)}")
    p.add_argument("--profile", default="paper", help="device profile (small, paper, cmmh) or TOML path")
    p.add_argument("--policy", default="hymcache", choices=list(VARIANTS), help="how requests use the device")
    p.add_argument("--compare", metavar="P1,P2", help="run several policies on the same workload into one table/plot")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="profile override, e.g. --set dram.size_bytes=1073741824 (repeatable)")
    g = p.add_argument_group("KV blocks")
    g.add_argument("--model", default="llama-3.1-8b", help=f"KV block size from the model table: {', '.join(MODELS)}")
    g.add_argument("--tokens-per-block", type=int, default=128, help="tokens per KV block")
    g.add_argument("--block-bytes", help="explicit KV block size (e.g. 64MiB); overrides --model")
    g.add_argument("--window-bytes", default=str(DEFAULT_WINDOW_BYTES),
                   help="hymcache: KV bytes a request keeps prefetched ahead (never fewer than 2 blocks)")
    g = p.add_argument_group("workload")
    g.add_argument("--concurrency", type=int, help="microbench: concurrent requests (64); randread: clients (8)")
    g.add_argument("--blocks-per-turn", type=int, default=32, help="microbench: new blocks per request per turn")
    g.add_argument("--turns", type=int, default=6, help="microbench: turns")
    g.add_argument("--sessions", type=int, default=200, help="conversation: sessions")
    g.add_argument("--mean-turns", type=float, default=2.0, help="conversation: mean turns per session")
    g.add_argument("--mean-prompt-tokens", type=float, default=69.5, help="conversation: mean new user tokens per turn")
    g.add_argument("--mean-response-tokens", type=float, default=214.5, help="conversation: mean response tokens per turn")
    g.add_argument("--think-s", type=float, default=30.0, help="conversation: mean think time between turns")
    g.add_argument("--rate", type=float, default=1.0, help="conversation: sessions started per second")
    g.add_argument("--system-prompt-tokens", type=int, default=0, help="conversation: shared leading prefix")
    g.add_argument("--region-bytes", default="256GiB", help="randread: populated region")
    g.add_argument("--reads-per-client", type=int, default=256, help="randread: objects each client reads")
    g.add_argument("--limit", type=int, help="trace: replay only the first N requests")
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply timestamps (<1: more load)")
    g.add_argument("--seed", type=int, default=0, help="generators: random seed")
    g = p.add_argument_group("output")
    g.add_argument("--window-s", type=float, default=600.0, help="report row width for time-ordered workloads")
    g.add_argument("--out", metavar="DIR", help="write replay.json and replay.png here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r} must be KEY=VALUE (e.g. dram.size_bytes=1073741824)")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value.strip()
    return out


def build_workload(args):
    block = parse_bytes(args.block_bytes, "--block-bytes") if args.block_bytes else \
        get_model(args.model).block_bytes(args.tokens_per_block)
    if args.trace == "microbench":
        return HymcacheMicrobench(block, args.concurrency or 64, args.blocks_per_turn, args.turns)
    if args.trace == "conversation":
        return ConversationGenerator(block, args.tokens_per_block, args.sessions, args.mean_turns,
                                     args.mean_prompt_tokens, args.mean_response_tokens, system_prompt_tokens=args.system_prompt_tokens, mean_think_s=args.think_s,
                                     sessions_per_s=args.rate, seed=args.seed)
    if args.trace == "randread":
        return RandomReadBench(block, parse_bytes(args.region_bytes, "--region-bytes"), args.concurrency or 8,
                               args.reads_per_client, args.seed)
    if not Path(args.trace).is_file():
        raise ValueError(f"TRACE_OR_GENERATOR = {args.trace!r} is neither a file nor one of {', '.join(GENERATORS)}")
    return MooncakeTrace(args.trace, block, args.tokens_per_block, args.limit, args.time_scale)


def run(args) -> int:
    try:
        variants = [v.strip() for v in args.compare.split(",")] if args.compare else [args.policy]
        for v in variants:
            if v not in VARIANTS:
                raise ValueError(f"--compare policy {v!r} is not one of {', '.join(VARIANTS)}")
        if not args.window_s > 0:
            raise ValueError(f"--window-s = {args.window_s!r} must be > 0")
        workload = build_workload(args)
        overrides = _overrides(args.set)
        window_bytes = parse_bytes(args.window_bytes, "--window-bytes")
        replays = [Replay(replay_config(args.profile, v, overrides), v, workload, window_bytes=window_bytes,
                          bucket_ns=args.window_s * 1e9, progress=not args.no_progress) for v in variants]
    except ValueError as exc:
        print(f"chm replay: error: {exc}", file=sys.stderr)
        return 2
    results = []
    for replay in replays:
        results.append(replay.run())
    print(f"{workload.name}: {workload.describe()}; block {workload.block_bytes / 2**20:g} MiB; profile {results[0]['profile']}")
    print(format_table(results))
    for r in results:
        print(format_summary(r))
    if args.out:
        json_path, png_path = write_outputs(results, args.out, "replay")
        print(f"wrote {json_path} and {png_path}")
    return 0
