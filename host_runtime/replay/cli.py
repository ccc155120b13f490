"""``chm replay``: drive the emulator's controller from a trace or generator, in virtual time."""

from __future__ import annotations

import argparse
import os
import sys

from common.cli import UsageError, float_in, int_at_least
from emulator.config import FIELDS_BY_KEY
from emulator.errors import ConfigError

from .driver import DEFAULT_WINDOW_BYTES, VARIANTS
from .lcs_trace import TRACE_FORMATS, parse_trace_params, trace_format
from .models import MODELS
from .prefill import DEFAULT_GPU, FALLBACK_MODEL, gpu_names, load_gpu
from .report import format_recompute, format_summary, format_table, write_outputs, wrote
# configs and prefill_model: re-exported for chm replay's callers
from .runs import (GENERATORS, MOONCAKE, _overrides, build_workload, configs, prefill_model,  # noqa: F401
                   replay_results)
from .traces import TIME_SCALE_RANGE, WINDOW_S_RANGE


def register(sub) -> None:
    p = sub.add_parser(
        "replay", help="replay a trace or generated workload on the device model (virtual time, data off)",
        description="Replay a trace (Mooncake JSONL, or any format libCacheSim reads) or a generated workload on "
                    "the emulator's controller with emulation.data = false, and report per turn (or per time "
                    "window) read/write bandwidth, DRAM hit rate, refused writes, modelled block-read latency, and "
                    "the cost of what the device did not serve: blocks recomputed, their modelled prefill time on "
                    "--gpu, and the time to serve the turn with it (device read time + recomputation). "
                    "Two policies are chosen separately: --policy is how requests use the device (what they "
                    "read, write and prefetch); --device-policy is the DRAM policy inside the device (default: the "
                    "one --policy implies). --sequential replays requests one at a time, in file order, with "
                    "write-back drained before each access, so the DRAM's misses equal a cache simulator's (e.g. "
                    "libCacheSim's) on the same page sequence. --sweep runs a grid of such replays as Dask tasks.",
        epilog="example: chm replay TRACE.jsonl --sequential --device-policy lru,fifo --tokens-per-block 512 "
               "--block-bytes 2MiB --set dram.size_bytes=8589934592 --set policy.prefetch_window_bytes=2097152   "
               "(a device of 4096 2 MiB pages, one page per Mooncake hash id)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("trace", metavar="TRACE_OR_GENERATOR",
                   help=f"a trace file (format: --trace-format), or a generator: {', '.join(GENERATORS)}")
    p.add_argument("--profile", default="paper", help="device profile (small, paper, cmmh) or TOML path")
    p.add_argument("--policy", default="hymcache", choices=list(VARIANTS),
                   help="how requests use the device: lru = demand reads and writes; hymcache = prefetched reads "
                        "and admitted writes; hymcache-noprefetch = demand reads and admitted writes. Each implies "
                        "a device policy (" + ", ".join(f"{v}: {d}" for v, (d, _) in VARIANTS.items()) + ")")
    p.add_argument("--compare", metavar="P1,P2", type=_policy_list,
                   help="run several --policy values on the same workload into one table/plot")
    p.add_argument("--device-policy", metavar="NAME[,NAME...]", type=_device_policy_list,
                   help="the device's DRAM policy (config policy.name; any the emulator registers), instead of the "
                        "one --policy implies; several: one run each, in one table")
    p.add_argument("--sequential", action="store_true",
                   help="one request at a time in file order (no overlap in virtual time), one block in flight, "
                        "write-back drained before the next access: the DRAM's misses equal a cache simulator's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="profile override, e.g. --set dram.size_bytes=1073741824 (repeatable)")
    g = p.add_argument_group("trace format")
    g.add_argument("--trace-format", default=MOONCAKE, metavar="FORMAT", type=_trace_format,
                   help=f"{MOONCAKE}: Mooncake JSONL (timestamp in ms, hash_ids); or any format libCacheSim reads, "
                        f"read by libCacheSim's own reader: {', '.join(TRACE_FORMATS)}. Each request of those is "
                        f"one object access at its clock time (seconds): a read of the object's blocks "
                        f"(ceil(obj_size / block)), a write at the first touch")
    g.add_argument("--trace-params", metavar="KEY=VALUE,...", type=_trace_params,
                   help="libCacheSim formats: libCacheSim's trace parameters, as its cachesim -t takes them, e.g. "
                        "'time-col=1,obj-id-col=2,obj-size-col=3,delimiter=,,has-header=true' (csv) or "
                        "'format=<IQI,obj-id-col=2' (binary)")
    g.add_argument("--ignore-obj-size", action="store_true",
                   help="libCacheSim formats: every object is one block, whatever its obj_size")
    g = p.add_argument_group("KV blocks")
    g.add_argument("--model", type=str.lower, choices=list(MODELS),
                   help=f"KV block size from the model table (default {FALLBACK_MODEL}), and the model whose prefill "
                        f"recomputes unserved blocks (with --block-bytes and no --model: the model whose 128-token "
                        f"block is that size, e.g. 64MiB: llama-2-7b, 168MiB: opt-30b; else {FALLBACK_MODEL})")
    g.add_argument("--tokens-per-block", type=int_at_least(1), default=128, help="tokens per KV block")
    g.add_argument("--block-bytes", help="explicit KV block size (e.g. 64MiB); overrides --model. libCacheSim "
                                          "formats: the block an object is cut into (default: one device page)")
    g.add_argument("--window-bytes", default=str(DEFAULT_WINDOW_BYTES),
                   help="hymcache: KV bytes a request keeps prefetched ahead (never fewer than 2 blocks)")
    g.add_argument("--gpu", default=DEFAULT_GPU, metavar="NAME|TOML", type=_gpu,
                   help=f"GPU profile that recomputes unserved blocks: {', '.join(gpu_names())}, or a TOML path "
                        f"(name, peak_flops, mfu, count)")
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
    g.add_argument("--time-scale", type=float_in(*TIME_SCALE_RANGE), default=1.0,
                   help="trace: multiply timestamps (<1: more load)")
    g.add_argument("--seed", type=int, default=0, help="generators: random seed")
    g = p.add_argument_group("output")
    g.add_argument("--window-s", type=float_in(*WINDOW_S_RANGE), default=600.0,
                   help="report row width for time-ordered workloads")
    g.add_argument("--out", metavar="DIR", help="write replay.json and replay.png here (--sweep: sweep.json and "
                                                "sweep.png)")
    g.add_argument("--no-plot", action="store_true", help="--out: write the JSON only, no PNG (no matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is not a terminal)")
    g = p.add_argument_group("sweep (Dask distributed)")
    g.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2,...",
                   help="an axis of a grid of replays, each point one Dask task (repeatable; the grid is the product). "
                        "FIELD: " + _sweep_fields_help())
    from .sweep import add_dask_args

    add_dask_args(g, "--sweep: ")
    p.set_defaults(func=run)


def _sweep_fields_help() -> str:
    from .sweep import sweep_fields_help

    return sweep_fields_help()


def _gpu(text: str):
    try:
        return load_gpu(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device_policy_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no device policy")
    for name in names:  # the config's own check of policy.name: one list of registered policies
        try:
            FIELDS_BY_KEY["policy.name"].check(name, "--device-policy")
        except ConfigError as exc:  # argparse names the option already
            raise argparse.ArgumentTypeError(exc.message.removeprefix("--device-policy: ")) from None
    return names


def _trace_format(text: str) -> str:
    if text.lower() == MOONCAKE:
        return MOONCAKE
    try:
        return trace_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _trace_params(text: str) -> dict:
    try:
        return parse_trace_params(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _policy_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise argparse.ArgumentTypeError(f"policy {v!r} is not one of {', '.join(VARIANTS)}")
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no policy; allowed: {', '.join(VARIANTS)}")
    return names


def run(args) -> int:
    if args.sweep:
        return run_sweep_command(args)
    for option in ("scheduler", "workers"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option} is for --sweep")
    workload = build_workload(args)
    for warning in getattr(workload, "warnings", ()):
        print(f"chm replay: libCacheSim: {warning}", file=sys.stderr)
    results = replay_results(args, workload=workload)
    print(f"{workload.name}: {workload.describe()}; block {workload.block_bytes / 2**20:g} MiB; "
          f"profile {results[0]['profile']}" + ("; sequential" if args.sequential else ""))
    print(format_recompute(results[0]))
    print(format_table(results))
    for r in results:
        print(format_summary(r))
    if args.out:
        print(wrote(*write_outputs(results, args.out, "replay", png=not args.no_plot)))
    return 0


def run_sweep_command(args) -> int:
    from .sweep import check_points, format_sweep, grid, parse_sweep, run_sweep, write_sweep

    axes = parse_sweep(args.sweep, GENERATORS)
    for name, option, given in (("variant", "--compare", args.compare), ("device_policy", "--device-policy",
                                                                          args.device_policy)):
        if name in axes and given:
            raise UsageError(f"--sweep {name} and {option} both choose it: give one")
    if args.compare or (args.device_policy and len(args.device_policy) > 1):
        raise UsageError("--compare and several --device-policy values are axes of a sweep: use --sweep variant=... "
                         "or --sweep device_policy=...")
    set_keys = set(_overrides(args.set))
    for name in axes:
        key = {"dram": "dram.size_bytes", "write_buffer": "policy.write_buffer_fraction",
               "device_policy": "policy.name"}.get(name, name)
        if key in set_keys:
            raise UsageError(f"--sweep {name} and --set {key} both choose it: give one")
    if "block" in axes and args.model:
        raise UsageError("--sweep block and --model both choose the KV block size: give one")
    specs = check_points(args, grid(axes))
    gpu = args.gpu if not isinstance(args.gpu, str) else load_gpu(args.gpu)
    for spec in specs:  # the GPU profile travels as its path (a worker loads it again)
        spec["args"]["gpu"] = gpu.source
    print(f"sweep: {len(specs)} points ({' x '.join(f'{n} {len(v)}' for n, v in axes.items())}) on "
          + (f"the scheduler {args.scheduler}" if args.scheduler else
             f"a LocalCluster of {args.workers or min(len(specs), os.cpu_count() or 1)} single-threaded workers"),
          flush=True)
    results = run_sweep(specs, args.scheduler, args.workers, progress=not args.no_progress)
    print(format_recompute(results[0]))
    print(format_sweep(results))
    if args.out:
        print(wrote(*write_sweep(results, args.out, png=not args.no_plot)))
    return 0
