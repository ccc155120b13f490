"""What one ``chm replay`` run does with its parsed arguments: the workload they name, the profiles of its runs,
the prefill that recomputes an unserved block, and the runs' results. The CLI (cli.py) and a sweep's grid points
(sweep.py) both call these, so neither imports the other."""

from __future__ import annotations

import sys
from pathlib import Path

from common.cli import UsageError
from common.units import parse_bytes
from emulator.config import load_profile, parse_field_value

from .driver import Replay, replay_config
from .lcs_trace import LibCacheSimTrace
from .models import get_model
from .prefill import FALLBACK_MODEL, load_gpu, prefill_for_block
from .traces import (ConversationGenerator, HymcacheMicrobench, MooncakeTrace, RandomReadBench,
                     check_mooncake_tokens_per_block)

GENERATORS = ("microbench", "conversation", "randread")
MOONCAKE = "mooncake"  # --trace-format of the Mooncake JSONL reader (ours); every other format is libCacheSim's


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set {item!r} must be KEY=VALUE (e.g. dram.size_bytes=1073741824)")
        out[key.strip()] = parse_field_value(value.strip())
    return out


def _size(text: str, option: str) -> int:
    try:
        return parse_bytes(text, option)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def build_workload(args):
    """The workload the arguments name; a bad argument is a UsageError, a bad trace file a ValueError."""
    block = _size(args.block_bytes, "--block-bytes") if args.block_bytes else \
        get_model(args.model or FALLBACK_MODEL).block_bytes(args.tokens_per_block)
    if args.trace not in GENERATORS and not Path(args.trace).is_file():
        raise UsageError(f"TRACE_OR_GENERATOR = {args.trace!r} is neither a file nor one of {', '.join(GENERATORS)}")
    libcachesim_format = args.trace_format != MOONCAKE
    if args.trace in GENERATORS and libcachesim_format:
        raise UsageError(f"--trace-format {args.trace_format} is for a trace file, not the {args.trace} generator")
    if not libcachesim_format:
        for given, option in ((args.trace_params, "--trace-params"), (args.ignore_obj_size, "--ignore-obj-size")):
            if given:
                raise UsageError(f"{option} is for the libCacheSim formats; --trace-format is {args.trace_format}")
    if libcachesim_format:
        if not args.block_bytes:  # an object is cut into device pages
            block = load_profile(args.profile).device.page_size_bytes
        return LibCacheSimTrace(args.trace, args.trace_format, block, args.trace_params or {}, args.ignore_obj_size,
                                args.limit, args.time_scale)  # reads the file
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


def configs(args) -> list[tuple[str, object]]:
    """(variant, profile) of every run the arguments ask for; a bad override is a ConfigError."""
    overrides = _overrides(args.set)
    if args.device_policy and "policy.name" in overrides:
        raise UsageError("--device-policy and --set policy.name both choose the device policy: give one")
    return [(v, replay_config(args.profile, v, overrides, device_policy))
            for v in (args.compare or [args.policy]) for device_policy in (args.device_policy or [None])]


def prefill_model(args, block_bytes: int):
    """What recomputes an unserved block: --model's prefill (or the model the block size names) on --gpu."""
    model = args.model if args.model or args.block_bytes else FALLBACK_MODEL
    gpu = args.gpu if not isinstance(args.gpu, str) else load_gpu(args.gpu)
    return prefill_for_block(block_bytes, model, gpu)


def replay_results(args, progress: bool | None = None, workload=None) -> list[dict]:
    """Every run the arguments ask for, on one workload (built here unless given)."""
    runs = configs(args)
    window_bytes = _size(args.window_bytes, "--window-bytes")
    if workload is None:
        workload = build_workload(args)
    prefill = prefill_model(args, workload.block_bytes)
    show = (not args.no_progress and sys.stderr.isatty()) if progress is None else progress  # no bar in a log
    return [Replay(cfg, v, workload, window_bytes=window_bytes, bucket_ns=args.window_s * 1e9, progress=show,
                   sequential=args.sequential, prefill=prefill).run() for v, cfg in runs]
