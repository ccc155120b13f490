"""``chm serve``: the emulator as a long-running device process."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile

from emulator import cli
from emulator.config import FIELDS_BY_KEY, load_profile, parse_field_value
from emulator.controller import DRAIN_TIMEOUT_S
from emulator.errors import ChmError

from driver.wire import DEFAULT_NODE, NodeError
from .limits import (DEFAULT_MAP_LEASE_MS, DEFAULT_MAP_MAX_EXPIRED, DEFAULT_MAX_BAD_ENTRIES, MAP_LEASE_MS_RANGE,
                     MAP_MAX_EXPIRED_RANGE, MAX_BAD_ENTRIES_LIMIT)


def parse_override(text: str) -> tuple[str, object]:
    """``section.field=value``; the value is parsed as TOML (so 1e6, true, "lru" work)."""
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected section.field=value, e.g. dram.size_bytes=134217728")
    return key.strip(), parse_field_value(value)


def _policy_name(text: str) -> str:
    try:  # the config's own check of policy.name: one registry of policies
        FIELDS_BY_KEY["policy.name"].check(text, "--policy")
    except ChmError as exc:  # argparse names the option already
        raise argparse.ArgumentTypeError(exc.message.removeprefix("--policy: ")) from None
    return text


def _bad_entries(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= MAX_BAD_ENTRIES_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, {MAX_BAD_ENTRIES_LIMIT}] (0: never detach)")
    return value


def _whole_in(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} must be in [{lo}, {hi}]")
        return value
    return parse


MAX_DRAIN_TIMEOUT_S = 86_400  # a day: beyond this a typo is likelier than intent
MAX_SPIN_US = 100_000


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the device as a process serving libchm clients",
                       description="Start a device from a profile and a media directory, create its device node "
                                   "(/dev/shm/NODE, mode 0600) and serve libchm clients over shared-memory queue "
                                   "pairs until SIGINT/SIGTERM; then drain the write buffer and remove the node.")
    p.add_argument("--profile", default="small", help="profile name (small, paper, cmmh) or path to a TOML config")
    p.add_argument("--media", metavar="DIR",
                   help="media directory holding the SSD backing files (default: a temporary one, removed at exit)")
    p.add_argument("--node", default=DEFAULT_NODE, help="device node name under /dev/shm, or a path (default: chm0)")
    p.add_argument("--policy", metavar="NAME", type=_policy_name,
                   help="override the profile's policy.name (a registered policy; a wrong name lists them)")
    p.add_argument("--set", dest="overrides", action="append", default=[], type=parse_override, metavar="FIELD=VALUE",
                   help="override one profile field, e.g. --set dram.size_bytes=134217728 (repeatable)")
    p.add_argument("--pace", action="store_true",
                   help="hold each completion until wall time reaches its modelled finish")
    p.add_argument("--spin-us", type=cli.float_in(0, MAX_SPIN_US), default=50.0, metavar="US",
                   help=f"spin this long for new commands before sleeping (default 50; 0 sleeps at once; "
                        f"at most {MAX_SPIN_US})")
    p.add_argument("--format", dest="format_media", action="store_true",
                   help="erase the media directory and start empty (needed for foreign, missing or truncated media)")
    p.add_argument("--drain-timeout", type=cli.float_in(0, MAX_DRAIN_TIMEOUT_S), default=DRAIN_TIMEOUT_S,
                   metavar="SECONDS",
                   help=f"at SIGTERM, retry failing flushes for at most this long (default {DRAIN_TIMEOUT_S:g}); "
                        f"what is still unflushed then is reported and lost (exit status 1)")
    p.add_argument("--max-bad-entries", type=_bad_entries, default=DEFAULT_MAX_BAD_ENTRIES, metavar="N",
                   help=f"detach a client after N malformed submission entries (or corrupted ring tails); its next "
                        f"call gets ENODEV (default {DEFAULT_MAX_BAD_ENTRIES}; 0 never detaches)")
    p.add_argument("--map-lease-ms", type=cli.float_in(*MAP_LEASE_MS_RANGE), default=DEFAULT_MAP_LEASE_MS,
                   metavar="MS",
                   help=f"chm_mmap: a client's lease of a frame not acknowledged within MS expires (default "
                        f"{DEFAULT_MAP_LEASE_MS:g}, in [{MAP_LEASE_MS_RANGE[0]:g}, {MAP_LEASE_MS_RANGE[1]:g}])")
    p.add_argument("--map-max-expired", type=_whole_in(*MAP_MAX_EXPIRED_RANGE), default=DEFAULT_MAP_MAX_EXPIRED,
                   metavar="N",
                   help=f"chm_mmap: cut a client off (its faults get EPERM, its access SIGBUS) once N of its leases "
                        f"expired (default {DEFAULT_MAP_MAX_EXPIRED})")
    p.add_argument("--no-native-hits", dest="native_hits", action="store_false",
                   help="serve every command in Python, DRAM-hit reads too (the reference path; slower)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .server import STOP_SIGNALS, DeviceServer, install_signal_handlers

    cfg = load_profile(args.profile)
    changes = dict(args.overrides)
    if args.policy:
        changes["policy.name"] = args.policy
    if changes:
        cfg = cfg.with_overrides(changes)
    owned = None
    media = args.media
    if media is None and cfg.emulation.data:
        owned = media = tempfile.mkdtemp(prefix="chm-media-", dir="/var/tmp")
    try:
        # SIGTERM/SIGINT during startup wait until the handlers are in: they remove the node on the way out.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            server = DeviceServer(cfg, media, node=args.node, pacing=args.pace, spin_us=args.spin_us,
                                  format_media=args.format_media, drain_timeout_s=args.drain_timeout,
                                  native_hits=args.native_hits, max_bad_entries=args.max_bad_entries,
                                  map_lease_ms=args.map_lease_ms, map_max_expired=args.map_max_expired)
            install_signal_handlers(server)
        except NodeError as exc:
            raise ChmError(exc.errno, exc.strerror) from None
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        print(f"chm serve: {cfg.source} ({cfg.policy.name}) at {server.node_path} "
              f"(socket {server.node_path}.sock), media {media or '(none: data off)'}"
              f"{' (temporary)' if owned else ''}, pid {__import__('os').getpid()}; ready", flush=True)
        server.serve_forever()
        if server.drain_error is not None:  # a runtime error: run() prints it and exits 1
            raise ChmError(server.drain_error.errno,
                           f"node removed; write buffer NOT fully drained: {server.drain_error.message}")
        print("chm serve: write buffer drained, node removed", flush=True)
    finally:
        if owned:
            shutil.rmtree(owned, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m emulator.serve ...``: ``chm serve`` without loading every other subcommand."""
    return cli.run_subcommand(register, "serve", argv)


if __name__ == "__main__":
    sys.exit(main())
