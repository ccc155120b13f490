"""``chm serve``: the emulator as a long-running device process."""

from __future__ import annotations

import argparse
import errno
import shutil
import sys
import tempfile

from emulator import cli
from emulator.config import load_profile
from emulator.errors import ChmError

from .wire import DEFAULT_NODE, NodeError


def _override(text: str) -> tuple[str, object]:
    """``section.field=value``; the value is parsed as TOML (so 1e6, true, "lru" work)."""
    import tomllib

    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected section.field=value, e.g. dram.size_bytes=134217728")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value  # a bare word: a string
    return key.strip(), parsed


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the device as a process serving libchm clients",
                       description="Start a device from a profile and a media directory, create its device node "
                                   "(/dev/shm/NODE, mode 0600) and serve libchm clients over shared-memory queue "
                                   "pairs until SIGINT/SIGTERM; then drain the write buffer and remove the node.")
    p.add_argument("--profile", default="small", help="profile name (small, paper, cmmh) or path to a TOML config")
    p.add_argument("--media", metavar="DIR",
                   help="media directory holding the SSD backing files (default: a temporary one, removed at exit)")
    p.add_argument("--node", default=DEFAULT_NODE, help="device node name under /dev/shm, or a path (default: chm0)")
    p.add_argument("--policy", help="override the profile's policy.name (lru, hymcache)")
    p.add_argument("--set", dest="overrides", action="append", default=[], type=_override, metavar="FIELD=VALUE",
                   help="override one profile field, e.g. --set dram.size_bytes=134217728 (repeatable)")
    p.add_argument("--pace", action="store_true",
                   help="hold each completion until wall time reaches its modelled finish")
    p.add_argument("--spin-us", type=float, default=50.0, metavar="US",
                   help="spin this long for new commands before sleeping (default 50; 0 sleeps at once)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .server import DeviceServer, install_signal_handlers

    if not 0 <= args.spin_us <= 100_000:
        raise ChmError(errno.EINVAL, f"--spin-us {args.spin_us} is out of range [0, 100000]")
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
        try:
            server = DeviceServer(cfg, media, node=args.node, pacing=args.pace, spin_us=args.spin_us)
        except NodeError as exc:
            raise ChmError(exc.errno, exc.strerror) from None
        install_signal_handlers(server)
        print(f"chm serve: {cfg.source} ({cfg.policy.name}) at {server.node_path} "
              f"(socket {server.node_path}.sock), media {media or '(none: data off)'}"
              f"{' (temporary)' if owned else ''}, pid {__import__('os').getpid()}; ready", flush=True)
        server.serve_forever()
        print("chm serve: write buffer drained, node removed", flush=True)
    finally:
        if owned:
            shutil.rmtree(owned, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m driver.serve ...``: ``chm serve`` without loading every other subcommand."""
    parser = argparse.ArgumentParser(prog="chm")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return cli.run(parser, ["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
