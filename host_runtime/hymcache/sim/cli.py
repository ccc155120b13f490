"""``chm hymcache simulate``: the serving simulation from the command line (see the package docstring)."""

from __future__ import annotations

import sys

from .config import FIELDS, check, check_settings, load_settings, preset_path, trace_path

EPILOG = """\
Every setting of the preset can be overridden; a value out of range is an error naming the flag, the value
and the range. Output: a table per tier x turn on stdout, a progress bar on stderr, --json (one row per
tier x turn: tier, turn, hit_rate, ttft_p50_ms, ttft_p99_ms, e2e_ms, read_gbps, write_gbps, skipped_inserts,
recomputed_tokens, and more), --plot (PNG, one line per tier).

examples:
  chm hymcache simulate --figure 13
  chm hymcache simulate --figure 13 --tiers hymcache,lmcache-local --dram 128GiB --json out.json --plot out.png
  chm hymcache simulate --figure 13 --conversations 64 --turns 4 --tiers hymcache,cmm-h
  chm hymcache simulate --figure 10                     # PD 4P-1D-1S, Qwen2.5-32B, ~1.5 TB of reusable KV
  chm hymcache simulate --figure 12                     # Fig. 10's setup, staging 10-40 GB per node
  chm hymcache simulate --figure 11                     # Fig. 10's setup, Mooncake over NVMe-oF (XFS volumes)
  chm hymcache simulate --figure 14                     # one node, Qwen2.5-32B, LMCache with Redis over TCP
  chm hymcache simulate --figure 10 --tiers mooncake-dram,hymcache --staging-sweep 10GiB,40GiB
  chm hymcache simulate --figure 10 --client turn-barrier   # a barrier between turns instead of AIPerf's sessions
  chm hymcache simulate --figure 15                     # one node, the device prefetch on and off (hymcache-noprefetch)
  chm hymcache simulate --figure 13 --workload mooncake --trace-limit 2000 --tiers gpu-prefix,hymcache
                                                        # the shared Mooncake trace's first 2,000 requests, open loop
"""


def register(sub) -> None:
    """Add ``simulate`` to the ``chm hymcache`` subcommands."""
    import argparse

    import textwrap

    description = textwrap.fill(
        "Simulate serving a multi-turn workload in virtual time, on one node or PD-disaggregated (prefill workers, "
        "a decode worker, a storage node): vLLM-like workers (chunked prefill, GPU prefix cache) over one remote KV "
        "tier at a time (recompute, gpu-prefix, lmcache-local, mooncake-dram: a DRAM pool over RDMA; mooncake-nvmeof: "
        "SSD volumes behind a file system; lmcache-redis and lmcache-local+redis: a Redis over TCP; hymcache: the "
        "runtime's Master and KV Manager with the emulated device; hymcache-noprefetch: the same without the KV "
        "Manager's window, demand reads; cmm-h: a stock LRU device).", 100)
    p = sub.add_parser("simulate", help="serving simulation in virtual time (the paper's serving figures)",
                       description=description, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings_args(p)
    p.add_argument("--json", metavar="PATH", help="write the rows and summaries as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: TTFT and hit rate per turn, one line per tier")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_simulate)


def add_settings_args(p, figure_default: str | None = "13") -> None:
    """--figure, --preset and a flag per setting (``config.FIELDS``): one definition for simulate and sweep."""
    try:  # the default preset's values, shown in --help
        shown = load_settings(preset_path("13"))
    except ValueError:
        shown = {}
    p.add_argument("--figure", default=figure_default, metavar="N",
                   help="preset: the paper's figure N (host_runtime/hymcache/sim/presets/figN.toml; default 13)")
    p.add_argument("--preset", metavar="TOML", help="a preset file of your own instead of --figure's")
    for f in FIELDS:
        p.add_argument(f.flag, dest=dest(f), metavar="VALUE",
                       help=f"{f.help} (preset's {f.key}; Fig. 13: {_show(shown.get(f.key))})")


def dest(f) -> str:
    """The argparse attribute of field ``f``'s flag."""
    return f"set_{f.section}_{f.name}".replace("-", "_")


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(value)
    return "?" if value is None else str(value)


def preset_settings(args, figure: str | None = None) -> dict:
    """The preset's settings: ``--preset``'s file, else figure ``figure`` (default ``--figure``, else 13)."""
    from common.cli import UsageError

    if args.preset:
        return load_settings(args.preset)  # a bad file is bad input (exit 1), named with its field
    try:
        path = preset_path(figure or args.figure or "13")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return load_settings(path)


def flag_settings(args) -> dict:
    """{key: value} of the setting flags given, each checked (UsageError naming the flag, value and range)."""
    from common.cli import UsageError

    out = {}
    for f in FIELDS:
        value = getattr(args, dest(f))
        if value is not None:
            try:
                out[f.key] = check(f, value, f.flag)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    return out


def settings_from_args(args) -> dict:
    from common.cli import UsageError

    s = preset_settings(args)
    s.update(flag_settings(args))
    try:
        check_settings(s)
        if s["workload.kind"] == "mooncake":
            trace_path(s)  # there, before anything runs
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return s


def _simulate(args) -> int:
    from .report import plot, table
    from .run import simulate, write_json

    s = settings_from_args(args)
    result = simulate(s, progress=not args.no_progress)
    title = s.get("figure.title") or ""
    if s.get("figure.number") is not None:
        title = f"Fig. {s['figure.number']}: {title}"
    print(title)
    print(table(result))
    print(f"simulated {len(s['tiers.run'])} tier(s) in {result['wall_s']:.1f} s of wall time", file=sys.stderr)
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot(result, args.plot, title)
    return 0
