"""``chm``: one command line, subcommands contributed by each component.

Subcommands are found through the ``chm.commands`` entry points (see
pyproject.toml): each is a function ``register(subparsers)`` that adds a
parser whose ``func(args)`` runs it and returns the exit status. A command line
naming a subcommand loads only that entry point (``build_parser(command)``), so a
subcommand's start pays for its own imports alone.

Errors follow one convention for every subcommand, applied by ``common.cli.run``.
"""

from __future__ import annotations

import argparse
import sys

from common.cli import (  # noqa: F401 (re-exported)
    ChmArgumentParser,
    UsageError,
    float_in,
    int_at_least,
    run,
    run_subcommand,
)
from common.units import format_bytes


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """``chm``'s parser with every subcommand, or only ``command``'s if an entry point has that name (a command
    line naming one loads only that component: its start does not pay for every other's imports)."""
    from importlib.metadata import (
        entry_points,  # here: a module importing this one's helpers need not pay for it
    )

    parser = ChmArgumentParser(prog="chm", description="CXL hybrid-memory device emulator and tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    eps = sorted(entry_points(group="chm.commands"), key=lambda e: e.name)
    if any(ep.name == command for ep in eps):
        eps = [ep for ep in eps if ep.name == command]
    for ep in eps:
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(build_parser(argv[0] if argv else None), argv)


def register_info(sub) -> None:
    p = sub.add_parser("info", help="print a profile's modelled hardware",
                       description="Print the modelled hardware of a device profile (shipped name or TOML path).")
    p.add_argument("--profile", default="small", help="profile name (small, paper, cmmh) or path to a TOML file")
    p.add_argument("--json", action="store_true", help="print the whole validated profile as JSON")
    p.add_argument("--device", metavar="NODE", help="describe the running device at this node (chm serve) instead")
    p.set_defaults(func=_info)


def _info(args) -> int:
    import json

    if args.device:  # a running device: the driver reads its node (lazy import: the emulator does not need it)
        from emulator.serve.node_info import print_device_info

        return print_device_info(args.device, args.json)

    from .config import load_profile
    from .policies import policy_class

    cfg = load_profile(args.profile)
    if args.json:
        print(json.dumps({"source": cfg.source, **cfg.as_dict(), "derived": {
            "capacity_bytes": cfg.capacity_bytes, "dram_frames": cfg.dram_frames,
            "write_buffer_frames": cfg.write_buffer_frames, "read_staging_frames": cfg.read_staging_frames}}, indent=2))
        return 0
    page = cfg.device.page_size_bytes
    rows = [
        ("device", cfg.device.name),
        ("capacity", f"{format_bytes(cfg.capacity_bytes)} on {cfg.ssd.count} SSD(s) of {format_bytes(cfg.ssd.capacity_bytes)}, "
                     f"striped in {format_bytes(cfg.ssd.stripe_bytes)} units"),
        ("DRAM", f"{format_bytes(cfg.dram.size_bytes)} = {cfg.dram_frames} frames of {format_bytes(page)}, "
                 f"{cfg.dram.latency_ns:g} ns, {cfg.dram.bandwidth_gbps:g} GB/s"),
        ("policy", policy_class(cfg.policy.name).describe(cfg)),
        ("prefetch window", f"{format_bytes(cfg.policy.prefetch_window_bytes)}, {cfg.policy.prefetch_max_handles} handles"),
        ("host link", f"{cfg.host_link.kind}, {cfg.host_link.latency_ns:g} ns, {cfg.host_link.bandwidth_gbps:g} GB/s"),
        ("controller", f"{cfg.controller.clock_mhz:g} MHz; cycles: command {cfg.controller.cycles_per_command}, "
                       f"lookup {cfg.controller.cycles_per_lookup}, admission {cfg.controller.cycles_per_admission}, "
                       f"prefetch page {cfg.controller.cycles_per_prefetch_page}"),
        ("SSD", f"read {cfg.ssd.read_latency_ns / 1000:g} us / {cfg.ssd.read_bandwidth_gbps:g} GB/s, "
                f"write {cfg.ssd.write_latency_ns / 1000:g} us / {cfg.ssd.write_bandwidth_gbps:g} GB/s, "
                f"parallelism {cfg.ssd.parallelism}, reads x{cfg.ssd.read_slowdown_under_writes:g} under writes"),
    ]
    print(f"profile: {cfg.source}")
    for key, value in rows:
        print(f"  {key:<16} {value}")
    return 0
