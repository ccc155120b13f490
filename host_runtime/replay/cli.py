"""``chm replay``: drive the emulator's controller from a trace or generator, in virtual time."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from emulator.cli import UsageError, float_in, int_at_least

from .driver import DEFAULT_WINDOW_BYTES, VARIANTS, Replay, replay_config
from .models import MODELS, get_model, parse_bytes
from .report import format_summary, format_table, write_outputs
from .traces import (ConversationGenerator, HymcacheMicrobench, MooncakeTrace, RandomReadBench,
                     check_mooncake_tokens_per_block)

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
    p.add_argument("--compare", metavar="P1,P2", type=_policy_list, help="run several policies on the same workload into one table/plot")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="profile override, e.g. --set dram.size_bytes=1073741824 (repeatable)")
    g = p.add_argument_group("KV blocks")
    g.add_argument("--model", default="llama-3.1-8b", type=str.lower, choices=list(MODELS),
                   help="KV block size from the model table")
    g.add_argument("--tokens-per-block", type=int_at_least(1), default=128, help="tokens per KV block")
    g.add_argument("--block-bytes", help="explicit KV block size (e.g. 64MiB); overrides --model")
    g.add_argument("--window-bytes", default=str(DEFAULT_WINDOW_BYTES),
                   help="hymcache: KV bytes a request keeps prefetched ahead (never fewer than 2 blocks)")
    g = p.add_argument_group("workload")
    g.add_argument("--concurrency", type=int_at_least(1), help="microbench: concurrent requests (64); randread: clients (8)")
    g.add_argument("--blocks-per-turn", type=int_at_least(1), default=32, help="microbench: new blocks per request per turn")
    g.add_argument("--turns", type=int_at_least(1), default=6, help="microbench: turns")
    g.add_argument("--sessions", type=int_at_least(1), default=200, help="conversation: sessions")
    g.add_argument("--mean-turns", type=float_in(1), default=2.0, help="conversation: mean turns per session")
    g.add_argument("--mean-prompt-tokens", type=float_in(0, lo_open=True), default=69.5, help="conversation: mean new user tokens per turn")
    g.add_argument("--mean-response-tokens", type=float_in(0, lo_open=True), default=214.5, help="conversation: mean response tokens per turn")
    g.add_argument("--think-s", type=float_in(0), default=30.0, help="conversation: mean think time between turns")
    g.add_argument("--rate", type=float_in(0, lo_open=True), default=1.0, help="conversation: sessions started per second")
    g.add_argument("--system-prompt-tokens", type=int_at_least(0), default=0, help="conversation: shared leading prefix")
    g.add_argument("--region-bytes", default="256GiB", help="randread: populated region")
    g.add_argument("--reads-per-client", type=int_at_least(1), default=256, help="randread: objects each client reads")
    g.add_argument("--limit", type=int_at_least(1), help="trace: replay only the first N requests")
    g.add_argument("--time-scale", type=float_in(0, lo_open=True), default=1.0, help="trace: multiply timestamps (<1: more load)")
    g.add_argument("--seed", type=int, default=0, help="generators: random seed")
    g = p.add_argument_group("output")
    g.add_argument("--window-s", type=float_in(0, lo_open=True), default=600.0, help="report row width for time-ordered workloads")
    g.add_argument("--out", metavar="DIR", help="write replay.json and replay.png here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _policy_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise argparse.ArgumentTypeError(f"policy {v!r} is not one of {', '.join(VARIANTS)}")
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no policy; allowed: {', '.join(VARIANTS)}")
    return names


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set {item!r} must be KEY=VALUE (e.g. dram.size_bytes=1073741824)")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value.strip()
    return out


def _size(text: str, option: str) -> int:
    try:
        return parse_bytes(text, option)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def build_workload(args):
    """The workload the arguments name; a bad argument is a UsageError, a bad trace file a ValueError."""
    block = _size(args.block_bytes, "--block-bytes") if args.block_bytes else \
        get_model(args.model).block_bytes(args.tokens_per_block)
    if args.trace not in GENERATORS and not Path(args.trace).is_file():
        raise UsageError(f"TRACE_OR_GENERATOR = {args.trace!r} is neither a file nor one of {', '.join(GENERATORS)}")
    try:  # the workloads check their parameters, which come from the command line
        if args.trace == "microbench":
            return HymcacheMicrobench(block, args.concurrency or 64, args.blocks_per_turn, args.turns)
        if args.trace == "conversation":
            return ConversationGenerator(block, args.tokens_per_block, args.sessions, args.mean_turns,
                                         args.mean_prompt_tokens, args.mean_response_tokens,
                                         system_prompt_tokens=args.system_prompt_tokens, mean_think_s=args.think_s,
                                         sessions_per_s=args.rate, seed=args.seed)
        if args.trace == "randread":
            return RandomReadBench(block, _size(args.region_bytes, "--region-bytes"), args.concurrency or 8,
                                   args.reads_per_client, args.seed)
        check_mooncake_tokens_per_block(args.tokens_per_block)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return MooncakeTrace(args.trace, block, args.tokens_per_block, args.limit, args.time_scale)  # reads the file


def run(args) -> int:
    variants = args.compare or [args.policy]
    overrides = _overrides(args.set)
    window_bytes = _size(args.window_bytes, "--window-bytes")
    workload = build_workload(args)
    replays = [Replay(replay_config(args.profile, v, overrides), v, workload, window_bytes=window_bytes,
                      bucket_ns=args.window_s * 1e9, progress=not args.no_progress) for v in variants]
    results = [replay.run() for replay in replays]
    print(f"{workload.name}: {workload.describe()}; block {workload.block_bytes / 2**20:g} MiB; profile {results[0]['profile']}")
    print(format_table(results))
    for r in results:
        print(format_summary(r))
    if args.out:
        json_path, png_path = write_outputs(results, args.out, "replay")
        print(f"wrote {json_path} and {png_path}")
    return 0
