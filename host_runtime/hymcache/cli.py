"""``chm hymcache up|master|manager|stats|chat``: the HyMCache processes from the command line.

    chm hymcache up --nodes 1 --devices-per-node 2 --profile small
        a whole set on this machine: a Master, NODES x DEVICES ``chm serve`` devices and one KV Manager
        per node, each its own process on a tcp://127.0.0.1 port; prints their addresses (and one JSON
        line), and stops them all on Ctrl-C/SIGTERM: managers, then the master, then the devices, each
        with SIGTERM and, past --stop-timeout, SIGKILL.
    chm hymcache master [--bind HOST] [--port P] [--state-dir DIR] [--curve-keys DIR] [--metrics-port P]
    chm hymcache manager --master ADDR --node N --device NODE [--device NODE ...] [--advertise HOST]
        one piece alone: the way to put the Master and each node's Manager on different machines
        (bind 0.0.0.0 or the machine's address, --curve-keys on every machine, same key directory).
    chm hymcache stats --master ADDR     the Master's and every Manager's counters
    chm hymcache chat --turns 4 --conversations 3 [--master ADDR] [--json]
        the SmolLM2 multi-turn demo through the KV connector, against a running set or one of its own.

Errors follow ``common.cli.run``: ``chm hymcache CMD: error: ...``, exit 2 for usage, 1 at run time.
``python -m host_runtime.hymcache.cli CMD ...`` is ``chm hymcache CMD ...`` without loading the other
subcommands (the way ``up`` starts its children).
"""

from __future__ import annotations

import argparse
import sys

from common import cli
from common.cli import float_in, int_at_least
from emulator.serve.cli import parse_override

from .checks import PLACEMENTS, MasterSettings
from .commands.chat import CHAT_FIELDS, _chat  # noqa: F401 (re-exported)
from .commands.common import (DEFAULT_MAX_RESTARTS, DEFAULT_STOP_TIMEOUT_S, PORT_MAX,  # noqa: F401 (re-exported)
                              READY_TIMEOUT_S, RESTART_WINDOW_S, STOP_SIGNALS)
from .commands.keys import _auth_roles, _keys_add, _keys_list
from .commands.manager import _manager
from .commands.master import _master
from .commands.stats import _stats
from .commands.up import Child, HyMCacheSet, _up, read_lines  # noqa: F401 (re-exported: tests, benches)


def register(sub) -> None:
    p = sub.add_parser("hymcache", help="HyMCache: Master, KV Managers and devices of the prefix KV-cache tier",
                       description="HyMCache, a multi-turn prefix KV-cache tier over CXL-HM devices: start a set of "
                                   "processes (up) or one piece (master, manager), print counters (stats), run the "
                                   "SmolLM2 demo (chat).")
    hs = p.add_subparsers(dest="hymcache_command", metavar="SUBCOMMAND", required=True)

    u = hs.add_parser("up", help="start a Master, NODES x DEVICES chm serve devices and a KV Manager per node",
                      description="Start a whole HyMCache set on this machine, each piece its own process on a "
                                  "tcp port: a Master, NODES x DEVICES `chm serve` devices, one KV Manager per node. "
                                  "Prints the addresses and one JSON line; Ctrl-C or SIGTERM stops them all "
                                  "(managers, master, devices).")
    _set_shape_args(u, "")
    u.add_argument("--media-root", metavar="DIR",
                   help="keep each device's media in DIR/node<N>-dev<D> (default: temporary, removed at exit)")
    u.add_argument("--set", dest="device_overrides", action="append", default=[], type=_override,
                   metavar="FIELD=VALUE", help="passed to every chm serve as --set (repeatable)")
    _common_server_args(u)
    u.add_argument("--state-dir", metavar="DIR", help="the Master's snapshot and journal (default: none, in memory)")
    u.add_argument("--put-timeout", type=float_in(0, lo_open=True), metavar="S",
                   help=f"the Master's put_start timeout in seconds (default: the Master's, "
                        f"{MasterSettings().put_timeout_s:g})")
    u.add_argument("--metrics-port", type=_port, default=0, metavar="P",
                   help="the Master's Prometheus port; Manager i gets P+1+i (default 0: off)")
    u.add_argument("--stop-timeout", type=float_in(0, lo_open=True), default=DEFAULT_STOP_TIMEOUT_S, metavar="S",
                   help=f"per group of children, SIGTERM then SIGKILL after this long "
                        f"(default {DEFAULT_STOP_TIMEOUT_S:g})")
    u.add_argument("--max-restarts", type=int_at_least(0), default=DEFAULT_MAX_RESTARTS, metavar="N",
                   help=f"a child that exits is restarted, the rest serving on, unless it exited N times within "
                        f"{RESTART_WINDOW_S:g} s: then all stop (default {DEFAULT_MAX_RESTARTS}; 0: stop all at "
                        f"the first exit)")
    u.add_argument("--no-keys", action="store_true",
                   help="no CurveZMQ keys (loopback only, any local process may call anything); default: keys in "
                        "--curve-keys DIR, else STATE_DIR/keys, else a temporary directory removed at exit")
    u.set_defaults(func=_up)

    m = hs.add_parser("master", help="run the Master alone",
                      description="Run the HyMCache Master (global block metadata) on a ZeroMQ ROUTER socket until "
                                  "SIGINT/SIGTERM.")
    _common_server_args(m)
    m.add_argument("--state-dir", metavar="DIR", help="snapshot and journal: a restarted Master recovers from it")
    m.add_argument("--recover-damaged", action="store_true",
                   help="start even if the state dir is damaged: keep what can be read, keep a copy of the damaged "
                        "files in DIR/damaged-N/ and report there what was lost (default: refuse to start)")
    d = MasterSettings()  # the Master's defaults, declared once with their ranges (checks.py)
    m.add_argument("--snapshot-every", type=int_at_least(1), default=d.snapshot_every, metavar="N",
                   help=f"write a snapshot and start a new journal every N records (default {d.snapshot_every})")
    m.add_argument("--lease", type=float_in(0, lo_open=True), default=d.lease_s, metavar="S",
                   help=f"read lease granted by a lookup (default {d.lease_s:g})")
    m.add_argument("--lease-max", type=float_in(0, lo_open=True), default=d.lease_max_s, metavar="S",
                   help=f"a lease is never renewed past this long after its first grant (default {d.lease_max_s:g})")
    m.add_argument("--put-timeout", type=float_in(0, lo_open=True), default=d.put_timeout_s, metavar="S",
                   help=f"a put_start without put_end is revoked after this long (default {d.put_timeout_s:g})")
    m.add_argument("--high-watermark", type=float_in(0, 1, lo_open=True), default=d.high_watermark, metavar="F",
                   help=f"evict when a device's used fraction passes this (default {d.high_watermark:.2f})")
    m.add_argument("--low-watermark", type=float_in(0, 1, lo_open=True), default=d.low_watermark, metavar="F",
                   help=f"... down to this (default {d.low_watermark:.2f})")
    m.add_argument("--placement", choices=PLACEMENTS, default=d.placement,
                   help=f"node chosen per store request (default {d.placement})")
    m.add_argument("--metrics-port", type=_port, default=0, metavar="P", help="Prometheus port (default 0: off)")
    m.set_defaults(func=_master)

    g = hs.add_parser("manager", help="run one node's KV Manager alone",
                      description="Run the KV Manager of one storage node: it opens the node's chm serve devices "
                                  "(libchm, same machine), registers them with the Master and serves prefetch "
                                  "hints, read tokens and remote reads/writes until SIGINT/SIGTERM.")
    g.add_argument("--master", required=True, metavar="ADDR", help="the Master's address (tcp://HOST:PORT)")
    g.add_argument("--node", type=int_at_least(0), required=True, help="this storage node's number")
    g.add_argument("--device", dest="devices", action="append", required=True, metavar="NODE",
                   help="a chm serve device node of this machine (repeatable; order = device index)")
    _common_server_args(g)
    g.add_argument("--advertise", metavar="HOST",
                   help="the host name workers and the Master reach this Manager at (default: --bind; "
                        "required when binding 0.0.0.0)")
    g.add_argument("--window-bytes", type=int_at_least(1), default=128 << 20, metavar="B",
                   help="prefetch window per request in bytes (default 128 MiB; never fewer than 2 blocks)")
    g.add_argument("--timeout", type=float_in(0, lo_open=True), default=10.0, metavar="S",
                   help="calls to the Master time out after this long (default 10)")
    g.add_argument("--key", metavar="NAME", help="with --curve-keys: the node key it calls the Master with "
                                                 "(DIR/NAME.key_secret; default node-NODE)")
    g.add_argument("--metrics-port", type=_port, default=0, metavar="P", help="Prometheus port (default 0: off)")
    g.set_defaults(func=_manager)

    s = hs.add_parser("stats", help="print the Master's and every KV Manager's counters",
                      description="Ask the Master for its counters and its nodes, then every node's KV Manager "
                                  "for its own, and print them (names as in the Prometheus export).")
    s.add_argument("--master", required=True, metavar="ADDR", help="the Master's address")
    s.add_argument("--curve-keys", metavar="DIR", help="CurveZMQ key directory of the set")
    s.add_argument("--key", metavar="NAME", default=None,
                   help="with --curve-keys: the admin or monitor key to call with (default: the set's client key)")
    s.add_argument("--timeout", type=float_in(0, lo_open=True), default=5.0, metavar="S",
                   help="per call (default 5)")
    s.add_argument("--json", action="store_true", help="print {master: {...}, managers: {node: {...}}} as JSON")
    s.set_defaults(func=_stats)

    c = hs.add_parser("chat", help="SmolLM2 multi-turn chat on vllm serve: later turns load earlier turns' KV "
                                   "from the devices",
                      description="Run multi-turn conversations on SmolLM2-135M-Instruct (float32) served by the real "
                                  "vLLM with HyMCache's KV connector, each turn also on a vLLM without a connector, "
                                  "and print a row per turn: prompt tokens, those from vLLM's own prefix cache, those "
                                  "loaded from the devices, recomputed ones, loaded bytes, time to the first token, "
                                  "whether the greedy tokens equal the reference's. Starts the two vllm serve "
                                  "processes (or uses --vllm and --reference) and, without --master, a set of its "
                                  "own (as `up`); stops what it started at the end.")
    c.add_argument("--turns", type=int_at_least(1), default=4, help="turns per conversation (default 4)")
    c.add_argument("--conversations", type=int_at_least(1), default=3, help="conversations (default 3)")
    c.add_argument("--max-tokens", type=int_at_least(1), default=8, help="greedy tokens per turn (default 8)")
    c.add_argument("--master", metavar="ADDR", help="a running set's Master (default: start one)")
    c.add_argument("--curve-keys", metavar="DIR", help="CurveZMQ key directory of the set")
    c.add_argument("--key", default="client", metavar="NAME",
                   help="with --curve-keys: the worker key vLLM's connector calls with (default client)")
    c.add_argument("--prefix-caching", action="store_true",
                   help="vLLM's own prefix cache on too (default off: every reused token comes from HyMCache)")
    c.add_argument("--vllm", metavar="URL", help="a running vllm serve with the HyMCache connector (http://HOST:PORT)")
    c.add_argument("--reference", metavar="URL", help="with --vllm: a running vllm serve of the model without a "
                                                       "connector, for 'identical' (without it: '-')")
    _set_shape_args(c, " of the set it starts")
    c.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    c.set_defaults(func=_chat)

    k = hs.add_parser("keys", help="make and authorize CurveZMQ keys, each with a role",
                      description="The key directory of a set: the servers' key pair, the allow-list (authorized/) "
                                  "with each client key's role, the lease secret. Roles: worker (lookup, put and "
                                  "read blocks), node (a KV Manager registering its devices), admin (remove, stats), "
                                  "monitor (stats, read only).")
    ks = k.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    ka = ks.add_parser("add", help="make key NAME with a role and authorize it",
                       description="Make DIR/NAME.key_secret (0600) and authorize its public key with ROLE. Give "
                                   "the client NAME.key_secret and server.key (e.g. a vLLM engine: the connector's "
                                   "key_dir and key_name).")
    ka.add_argument("name", metavar="NAME")
    ka.add_argument("--role", required=True, help=f"one of {', '.join(_auth_roles())}, or several joined by commas")
    ka.add_argument("--node", type=int_at_least(0), help="a node key: the only node it may register")
    ka.add_argument("--dir", default="hymcache-keys",
                    help="the key directory (default ./hymcache-keys; made if absent)")
    ka.set_defaults(func=_keys_add)
    kl = ks.add_parser("list", help="the authorized keys and their roles")
    kl.add_argument("--dir", default="hymcache-keys", help="the key directory (default ./hymcache-keys)")
    kl.add_argument("--json", action="store_true")
    kl.set_defaults(func=_keys_list)

    from .sim.cli import register as register_simulate  # the serving simulation (sim/): its own options
    register_simulate(hs)
    from .sim.sweep import register as register_sweep  # a grid of simulations on Dask distributed
    register_sweep(hs)
    from .sim.claims import register as register_claims  # the paper's claims, judged at the presets
    register_claims(hs)
    from .sim.calibrate import register as register_calibrate  # a measured worker profile from the real vLLM
    register_calibrate(hs)


def _set_shape_args(p, whose: str) -> None:
    """The shape of a set `up` or `chat` starts: one definition of its options and defaults."""
    p.add_argument("--nodes", type=int_at_least(1), default=1, help=f"storage nodes{whose} (default 1)")
    p.add_argument("--devices-per-node", type=int_at_least(1), default=2, help=f"devices per node{whose} (default 2)")
    p.add_argument("--profile", default="small", help=f"chm serve's device profile{whose} (default small)")


def _common_server_args(p) -> None:
    p.add_argument("--bind", default="127.0.0.1", metavar="HOST",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 or a NIC's address for other machines)")
    p.add_argument("--port", type=_port, default=0, metavar="P", help="port (default 0: a free one)")
    p.add_argument("--curve-keys", metavar="DIR",
                   help="CurveZMQ: authenticate and encrypt with the keys in DIR (created if absent)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --bind without --curve-keys (a warning: no authentication)")


def _port(text: str) -> int:
    value = int_at_least(0)(text)
    if value > PORT_MAX:
        raise argparse.ArgumentTypeError(f"{value} must be <= {PORT_MAX}")
    return value


def _override(text: str) -> str:
    """A device's ``--set``, checked as ``chm serve`` checks it, passed on to it as given."""
    parse_override(text)
    return text


def main(argv: list[str] | None = None) -> int:
    """``python -m host_runtime.hymcache.cli ...``: ``chm hymcache`` without loading every other subcommand."""
    return cli.run_subcommand(register, "hymcache", argv)


if __name__ == "__main__":
    sys.exit(main())
