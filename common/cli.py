"""The ``chm`` CLI's argparse pieces, for every component's subcommands.

Errors, one convention for every subcommand, applied by ``run()`` alone: ``chm CMD: error: MESSAGE`` on stderr;
exit 2 for usage errors (argparse's, or a ``UsageError`` the subcommand raises; the usage line comes first), exit
1 for runtime errors (a ``ReportedError`` such as the device's ``ChmError`` incl. ``ConfigError``, ``OSError``,
``ValueError``: bad input), a traceback and exit 1 for anything else (a bug).
"""

from __future__ import annotations

import argparse
import math
import sys

from .errors import ReportedError

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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ReportedError):
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
    except (ReportedError, OSError, ValueError) as exc:
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
