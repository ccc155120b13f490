"""``chm``: one command line, subcommands contributed by each component.

Subcommands are found through the ``chm.commands`` entry points (see
pyproject.toml): each is a function ``register(subparsers)`` that adds a
parser whose ``func(args)`` runs it and returns the exit status. A command line
naming a subcommand loads only that entry point (``build_parser(command)``), so a
subcommand's start pays for its own imports alone.

Errors, one convention for every subcommand, applied by ``run()`` alone:
``chm CMD: error: MESSAGE`` on stderr; exit 2 for usage errors (argparse's, or
a ``UsageError`` the subcommand raises; the usage line comes first), exit 1
for runtime errors (``ChmError`` incl. ``ConfigError``, ``OSError``,
``ValueError``: bad input), a traceback and exit 1 for anything else (a bug).
"""

from __future__ import annotations

import argparse
import math
import sys

from .errors import ChmError
from .units import format_bytes

# the parser of the (innermost) subcommand that parsed the arguments: run() prints its usage and prog
_PARSER_ATTR = "_chm_parser"


class UsageError(Exception):
    """A bad command line (option value out of range, options that do not go together): exit 2."""


class ChmArgumentParser(argparse.ArgumentParser):
    """argparse, with its errors handed to ``run()`` instead of exiting on the spot."""

    def error(self, message: str):
        exc = UsageError(message)
        exc.parser = self
        raise exc

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if not hasattr(ns, _PARSER_ATTR):  # subparsers parse first: the innermost one is kept
            setattr(ns, _PARSER_ATTR, self)
        return ns, rest


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """``chm``'s parser with every subcommand, or only ``command``'s if an entry point has that name (a command
    line naming one loads only that component: its start does not pay for every other's imports)."""
    from importlib.metadata import entry_points  # here: a module importing this one's helpers need not pay for it

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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ChmError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        names = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{names}: {exc.strerror}" if names else exc.strerror
    return str(exc) or type(exc).__name__


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` (a ``ChmArgumentParser``) and run the chosen subcommand; every error
    becomes the message and exit status of the convention above."""
    try:
        args, extras = parser.parse_known_args(argv)
    except UsageError as exc:
        return _usage_error(getattr(exc, "parser", parser), str(exc))
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    command = getattr(args, _PARSER_ATTR, parser)
    if extras:  # named by the subcommand they were given to, not by the top-level parser
        return _usage_error(command, f"unrecognized arguments: {' '.join(extras)}")
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args) or 0
    except UsageError as exc:
        return _usage_error(getattr(exc, "parser", command), str(exc))
    except (ChmError, OSError, ValueError) as exc:
        print(f"{command.prog}: error: {_describe(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def run_subcommand(register, command: str, argv: list[str] | None = None) -> int:
    """``chm COMMAND ...`` with only ``register``'s subcommands loaded (``python -m`` of a component: no entry
    point lookup; ``chm COMMAND`` loads only COMMAND's component too, ``chm --help`` every one)."""
    parser = ChmArgumentParser(prog="chm")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return run(parser, [command, *(sys.argv[1:] if argv is None else argv)])


def int_at_least(lo: int):
    """An argparse ``type=``: an int >= ``lo`` (a bad value is a usage error naming the value and the bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} must be >= {lo}")
        return value
    return parse


def float_in(lo: float, hi: float = math.inf, lo_open: bool = False):
    """An argparse ``type=``: a number in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    allowed = (f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi < math.inf
               else f"{'>' if lo_open else '>='} {lo:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((value > lo if lo_open else value >= lo) and value <= hi):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{value:g} must be {allowed}")
        return value
    return parse


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
