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
import ctypes
import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import cli
from common.cli import UsageError, float_in, int_at_least
from common.units import format_bytes
from driver.errors import ChmError
from emulator.serve.cli import parse_override

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_STOP_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 60.0
DEFAULT_MAX_RESTARTS = 5     # chm hymcache up: restarts of one child ...
RESTART_WINDOW_S = 60.0      # ... within this long, before it gives up and stops all
PORT_MAX = 65535
PR_SET_PDEATHSIG = 1


# ----------------------------------------------------------------------------------------------- parsers

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
                   help="the Master's put_start timeout in seconds (default: the Master's, 30)")
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
    m.add_argument("--snapshot-every", type=int_at_least(1), default=100_000, metavar="N",
                   help="write a snapshot and start a new journal every N records (default 100000)")
    m.add_argument("--lease", type=float_in(0, lo_open=True), default=10.0, metavar="S",
                   help="read lease granted by a lookup (default 10)")
    m.add_argument("--lease-max", type=float_in(0, lo_open=True), default=30.0, metavar="S",
                   help="a lease is never renewed past this long after its first grant (default 30)")
    m.add_argument("--put-timeout", type=float_in(0, lo_open=True), default=30.0, metavar="S",
                   help="a put_start without put_end is revoked after this long (default 30)")
    m.add_argument("--high-watermark", type=float_in(0, 1, lo_open=True), default=0.90, metavar="F",
                   help="evict when a device's used fraction passes this (default 0.90)")
    m.add_argument("--low-watermark", type=float_in(0, 1, lo_open=True), default=0.85, metavar="F",
                   help="... down to this (default 0.85)")
    m.add_argument("--placement", choices=("round_robin", "load_aware"), default="round_robin",
                   help="node chosen per store request (default round_robin)")
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


def _endpoint(args) -> str:
    if ":" in args.bind and not args.bind.startswith("["):
        raise UsageError(f"--bind {args.bind!r}: a host name or IPv4 address, without a port (see --port)")
    return f"tcp://{args.bind}:{args.port}"


def _curve(args, nodes: int = 0) -> str | None:
    if not getattr(args, "curve_keys", None):
        return None
    from .rpc import make_curve_keys

    make_curve_keys(args.curve_keys, nodes)
    return args.curve_keys


def _auth_roles() -> tuple:
    from .auth import ROLES

    return ROLES


def _keys_add(args) -> int:
    from . import auth

    auth.make_keys(args.dir)  # the servers' pair and the lease secret, if this is a new directory
    path = auth.add_key(args.dir, args.name, args.role, args.node)
    print(f"chm hymcache keys: {args.name} ({args.role}{'' if args.node is None else f', node {args.node}'}) "
          f"authorized in {args.dir}; give the client {path} and {os.path.join(args.dir, 'server.key')}", flush=True)
    return 0


def _keys_list(args) -> int:
    from . import auth

    if not os.path.isdir(args.dir):
        raise ChmError(errno.ENOENT, f"--dir {args.dir}: no such key directory")
    keys = auth.list_keys(args.dir)
    if args.json:
        print(json.dumps(keys))
    else:
        for k in keys:
            print(f"{k['name']:<24} {','.join(k['roles']):<20} {'' if k['node'] is None else 'node ' + str(k['node'])}")
    return 0


def _need(module: str, names: tuple[str, ...]):
    """The pieces other files of this package provide, with a clear error while one is missing."""
    import importlib

    try:
        mod = importlib.import_module(f"host_runtime.hymcache.{module}")
    except ModuleNotFoundError as exc:
        if exc.name != f"host_runtime.hymcache.{module}":
            raise
        raise ChmError(errno.ENOSYS, f"host_runtime/hymcache/{module}.py is not there yet") from None
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise ChmError(errno.ENOSYS, f"host_runtime/hymcache/{module}.py lacks {', '.join(missing)}")
    return [getattr(mod, n) for n in names]


def _bind(make, endpoint: str):
    """``make()`` (a server binding ``endpoint``), a bind failure as a runtime error naming the address."""
    import zmq

    try:
        return make()
    except zmq.ZMQError as exc:
        raise ChmError(exc.errno or errno.EADDRNOTAVAIL, f"cannot bind {endpoint}: {exc.strerror}") from None


def _ready_line(role: str, **fields) -> None:
    """What a parent (``up``, tests) waits for: one JSON line on stdout."""
    print(json.dumps({"hymcache": role, "pid": os.getpid(), **fields}), flush=True)


def _serve_until_signal(server, cleanup, ready) -> None:
    """Say ``ready()``, serve in this (main) thread until SIGINT/SIGTERM, then ``cleanup()``. The handlers are in
    place before the ready line: a parent that stops us as soon as it reads it gets a clean stop, not a kill."""
    def stop(signum, frame):
        server.stop()

    old = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        ready()
        server.serve_forever()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        cleanup()


# ------------------------------------------------------------------------------------------ master, manager

def _master(args) -> int:
    from .clock import WallClock
    from .metrics import StatsExporter, chain_tick

    if args.low_watermark > args.high_watermark:
        raise UsageError(f"--low-watermark {args.low_watermark:g} must be <= --high-watermark {args.high_watermark:g}")
    if args.lease_max < args.lease:
        raise UsageError(f"--lease-max {args.lease_max:g} must be >= --lease {args.lease:g}")
    endpoint = _endpoint(args)
    keys = _curve(args)
    Master, serve_master = _need("master", ("Master", "serve_master"))
    if args.recover_damaged and not args.state_dir:
        raise UsageError("--recover-damaged needs --state-dir")

    def log(msg: str) -> None:
        print(f"chm hymcache master: {msg}", file=sys.stderr, flush=True)

    master = Master(WallClock(), args.state_dir, lease_s=args.lease, lease_max_s=args.lease_max,
                    put_timeout_s=args.put_timeout, high_watermark=args.high_watermark,
                    low_watermark=args.low_watermark, placement=args.placement, snapshot_every=args.snapshot_every,
                    recover_damaged=args.recover_damaged, log=log)
    exporter = None
    try:
        server = _bind(lambda: serve_master(master, endpoint, curve_keys=keys, log=log, insecure=args.insecure),
                       endpoint)
        if args.metrics_port:
            exporter = StatsExporter("master", master.stats, port=args.metrics_port, host=args.bind)
            chain_tick(server, exporter)
    except BaseException:
        master.close()
        raise
    def ready():
        print(f"chm hymcache master: {server.endpoint}"
              f"{' (CurveZMQ)' if keys else ''}, state dir {args.state_dir or '(none: in memory)'}"
              f"{f', metrics {exporter.url}' if exporter else ''}, pid {os.getpid()}; ready", flush=True)
        _ready_line("master", endpoint=server.endpoint, metrics_port=exporter.port if exporter else 0,
                    state_dir=args.state_dir)

    def cleanup():
        master.close()
        if exporter:
            exporter.close()
        print("chm hymcache master: stopped", flush=True)

    _serve_until_signal(server, cleanup, ready)
    return 0


def _manager(args) -> int:
    from .clock import WallClock
    from .metrics import StatsExporter, chain_tick

    advertise = args.advertise or args.bind
    if advertise in ("0.0.0.0", "*", "::"):
        raise UsageError(f"--bind {args.bind} needs --advertise HOST: the address the Master and workers reach")
    if len(set(args.devices)) != len(args.devices):
        raise UsageError(f"--device given twice: {', '.join(args.devices)}")
    endpoint = _endpoint(args)
    keys = _curve(args)
    KVManager, serve_manager, node_path = _need("manager", ("KVManager", "serve_manager", "node_path"))
    for name in args.devices:
        if not os.path.exists(node_path(name)):
            raise ChmError(errno.ENOENT, f"--device {name}: no chm serve device at {node_path(name)} "
                                         f"(start it first: chm serve --node {name})")
    (MasterClient,) = _need("master", ("MasterClient",))
    from .auth import key_file

    node_key = key_file(keys, args.key or f"node-{args.node}")  # the Manager calls the Master as this node
    master = MasterClient(args.master, timeout_s=args.timeout, curve_keys=node_key)
    log = lambda msg: print(f"chm hymcache manager {args.node}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    manager = exporter = None
    try:
        # endpoint "": the server registers the node under the address it bound (a free port with --port 0)
        manager = KVManager(args.node, list(args.devices), master, WallClock(), window_bytes=args.window_bytes,
                            endpoint="", log=log)
        manager.confirm_in_background(args.master, args.timeout, node_key)  # a hung Master holds up no call here
        server = _bind(lambda: serve_manager(manager, endpoint, curve_keys=keys, log=log, insecure=args.insecure),
                       endpoint)
        public = server.endpoint
        if args.advertise:
            public = f"tcp://{args.advertise}:{server.endpoint.rsplit(':', 1)[1]}"
            manager.register(public)
        if args.metrics_port:
            exporter = StatsExporter("manager", manager.stats, port=args.metrics_port, host=args.bind,
                                     labels={"node": str(args.node)})
            chain_tick(server, exporter)
    except BaseException:
        if manager is not None:
            manager.close()
        master.close()
        raise
    def ready():
        print(f"chm hymcache manager: node {args.node} at {public}{' (CurveZMQ)' if keys else ''}, devices "
              f"{', '.join(args.devices)}, master {args.master}"
              f"{f', metrics {exporter.url}' if exporter else ''}, pid {os.getpid()}; ready", flush=True)
        _ready_line("manager", node=args.node, endpoint=public, devices=list(args.devices),
                    metrics_port=exporter.port if exporter else 0)

    def cleanup():
        manager.close()
        master.close()
        if exporter:
            exporter.close()
        print(f"chm hymcache manager {args.node}: stopped", flush=True)

    _serve_until_signal(server, cleanup, ready)
    return 0


# ------------------------------------------------------------------------------------------------ the set

def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when ``up`` dies (even by SIGKILL); stop signals unblocked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def read_lines(proc: subprocess.Popen, deadline: float, name: str):
    """The lines ``proc`` writes to its stdout pipe (binary, read unbuffered: a line select() no longer
    sees is never stuck in a buffer) until ``deadline``; ChmError if it exits first."""
    fd = proc.stdout.fileno()
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], min(0.5, max(0.0, deadline - time.monotonic())))
        chunk = os.read(fd, 65536) if ready else b""
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode(errors="replace") + "\n"
        if ready and not chunk:  # EOF: it exited (or closed its stdout)
            proc.wait()
            text = buf.decode(errors="replace").strip()
            raise ChmError(errno.EIO, f"{name} exited with status {proc.returncode} before it was ready"
                                      f"{': ' + text if text else ''} (its errors are above)")


def _drain(pipe, timeout_s: float = 2.0) -> str:
    """What is left in an exited child's stdout pipe (bounded: a leftover holder of the pipe never blocks us)."""
    fd, out = pipe.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    pipe.close()
    return out.decode(errors="replace")


@dataclass
class Child:
    """One process of the set, in a process group of its own (Ctrl-C reaches ``up`` alone, which stops
    the children in order)."""

    role: str            # "device", "master", "manager"
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    banner: str = ""
    restarts: list = field(default_factory=list)  # monotonic times it was started again

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL,
                                     process_group=0, preexec_fn=_die_with_parent)

    def wait_ready(self, deadline: float) -> None:
        """Until the child's ready line: a JSON line for master/manager, ``...; ready`` for chm serve."""
        for line in read_lines(self.proc, deadline, self.name):
            if self.role == "device":
                self.banner += line
                if line.rstrip().endswith("ready"):
                    return
            elif line.startswith("{"):
                self.info = json.loads(line)
                return
            else:
                self.banner += line
        raise ChmError(errno.ETIMEDOUT, f"{self.name} not ready within {READY_TIMEOUT_S:g} s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class HyMCacheSet:
    """A Master, NODES x DEVICES ``chm serve`` devices and one KV Manager per node, as processes.

    ``start()`` returns once every piece is ready (or stops what started and raises); ``stop()`` stops
    them in order: managers, master, devices; each group SIGTERM, then SIGKILL past ``stop_timeout_s``.
    Used by ``chm hymcache up`` and ``chat``, by the tests and by the bench.
    """

    def __init__(self, nodes: int = 1, devices_per_node: int = 2, *, profile: str = "small",
                 media_root: str | None = None, bind: str = "127.0.0.1", master_port: int = 0,
                 curve_keys: str | None = None, state_dir: str | None = None, metrics_port: int = 0,
                 put_timeout_s: float | None = None, device_overrides: list[str] = (),
                 stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S, tag: str | None = None,
                 label: str = "chm hymcache up", verbose: bool = True, insecure: bool = False):
        self.nodes, self.devices_per_node = nodes, devices_per_node
        self.insecure = insecure  # children may bind a non-loopback --bind without keys
        self.profile, self.media_root, self.bind = profile, media_root, bind
        self.master_port, self.curve_keys, self.state_dir = master_port, curve_keys, state_dir
        self.metrics_port, self.put_timeout_s = metrics_port, put_timeout_s
        self.device_overrides, self.stop_timeout_s = list(device_overrides), stop_timeout_s
        self.tag = tag or f"hymcache-{os.getpid()}"
        self.label, self.verbose = label, verbose  # verbose: a line per stopped child on stdout
        self.devices: list[Child] = []
        self.master: Child | None = None
        self.managers: list[Child] = []
        self.exit_codes: dict[str, int] = {}

    def device_node(self, node: int, device: int) -> str:
        return f"{self.tag}-n{node}d{device}"

    @property
    def children(self) -> list[Child]:
        return [*self.managers, *([self.master] if self.master else []), *self.devices]

    def start(self) -> "HyMCacheSet":
        py = sys.executable
        if self.curve_keys:  # each Manager calls the Master with its own node key
            from .rpc import make_curve_keys

            make_curve_keys(self.curve_keys, self.nodes)
        try:
            for n in range(self.nodes):
                for d in range(self.devices_per_node):
                    node = self.device_node(n, d)
                    cmd = [py, "-m", "emulator.serve", "--node", node, "--profile", self.profile]
                    if self.media_root:
                        cmd += ["--media", os.path.join(self.media_root, f"node{n}-dev{d}")]
                    for o in self.device_overrides:
                        cmd += ["--set", o]
                    self.devices.append(Child("device", f"device {node}", cmd))
            for c in self.devices:
                c.start()
            cmd = [py, "-m", "host_runtime.hymcache.cli", "master", "--bind", self.bind,
                   "--port", str(self.master_port)]
            if self.state_dir:
                cmd += ["--state-dir", self.state_dir]
            if self.curve_keys:
                cmd += ["--curve-keys", self.curve_keys]
            if self.insecure:
                cmd += ["--insecure"]
            if self.metrics_port:
                cmd += ["--metrics-port", str(self.metrics_port)]
            if self.put_timeout_s is not None:
                cmd += ["--put-timeout", repr(self.put_timeout_s)]
            self.master = Child("master", "master", cmd)
            self.master.start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            for c in (self.master, *self.devices):
                c.wait_ready(deadline)
            for n in range(self.nodes):
                cmd = [py, "-m", "host_runtime.hymcache.cli", "manager", "--master", self.master_endpoint,
                       "--node", str(n), "--bind", self.bind]
                for d in range(self.devices_per_node):
                    cmd += ["--device", self.device_node(n, d)]
                if self.curve_keys:
                    cmd += ["--curve-keys", self.curve_keys, "--key", f"node-{n}"]
                if self.insecure:
                    cmd += ["--insecure"]
                if self.metrics_port:
                    cmd += ["--metrics-port", str(self.metrics_port + 1 + n)]
                self.managers.append(Child("manager", f"manager {n}", cmd))
            for c in self.managers:
                c.start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            for c in self.managers:
                c.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def master_endpoint(self) -> str:
        return self.master.info["endpoint"]

    def describe(self) -> dict:
        return {
            "master": self.master_endpoint,
            "master_pid": self.master.proc.pid,
            "master_metrics_port": self.master.info.get("metrics_port", 0),
            "state_dir": self.state_dir,
            "curve_keys": self.curve_keys,
            "managers": [{"node": n, "endpoint": c.info["endpoint"], "pid": c.proc.pid,
                          "metrics_port": c.info.get("metrics_port", 0), "devices": c.info.get("devices", [])}
                         for n, c in enumerate(self.managers)],
            "devices": [{"node": i // self.devices_per_node, "device": i % self.devices_per_node,
                         "path": f"/dev/shm/{self.device_node(i // self.devices_per_node, i % self.devices_per_node)}",
                         "pid": c.proc.pid} for i, c in enumerate(self.devices)],
        }

    def restart(self, c: Child) -> None:
        """Start an exited child again with its command, until it is ready (else ChmError). The Master gets
        the port it had, so the Managers and workers that know its address find it again; a Manager or a
        device comes back as at the start (a device on the same media; the Manager reopens it)."""
        if c.proc is not None and c.proc.stdout is not None:
            for line in _drain(c.proc.stdout).splitlines():
                if line.strip():
                    print(f"  [{c.name}] {line}", file=sys.stdout if self.verbose else sys.stderr, flush=True)
        if c is self.master and "endpoint" in c.info:
            at = c.cmd.index("--port") + 1
            c.cmd[at] = c.info["endpoint"].rsplit(":", 1)[1]
        c.restarts.append(time.monotonic())
        c.info, c.banner = {}, ""
        c.start()
        c.wait_ready(time.monotonic() + READY_TIMEOUT_S)

    def dead(self) -> list[Child]:
        """Children that exited on their own."""
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None
                and c.name not in self.exit_codes]

    def stop(self) -> dict[str, int]:
        """Stop every child, in order; {name: exit status} (negative: killed by that signal)."""
        for group in (self.managers, [self.master] if self.master else [], self.devices):
            started = [c for c in group if c.proc is not None]
            for c in started:
                if c.proc.poll() is None:
                    try:
                        os.kill(c.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + self.stop_timeout_s
            for c in started:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"{self.label}: {c.name} (pid {c.proc.pid}) did not stop within "
                          f"{self.stop_timeout_s:g} s of SIGTERM: SIGKILL", file=sys.stderr, flush=True)
                    c.proc.kill()
                    c.proc.wait()
                self.exit_codes.setdefault(c.name, c.proc.returncode)
                if c.proc.stdout is not None:
                    rest = _drain(c.proc.stdout)
                    for line in rest.splitlines():
                        if line.strip():
                            print(f"  [{c.name}] {line}", file=sys.stdout if self.verbose else sys.stderr, flush=True)
                if self.verbose:
                    print(f"{self.label}: stopped {c.name} (exit status {c.proc.returncode})", flush=True)
        return dict(self.exit_codes)

    def __enter__(self) -> "HyMCacheSet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _up(args) -> int:
    if args.no_keys and args.curve_keys:
        raise UsageError("--no-keys and --curve-keys: give one or the other")
    temp_keys = None
    if not args.no_keys and not args.curve_keys:  # secure by default: keys and roles for its own processes
        args.curve_keys = temp_keys = tempfile.mkdtemp(prefix="chm-hymcache-keys-", dir="/var/tmp")
    try:
        return _up_with(args, _curve(args, args.nodes))
    finally:
        if temp_keys:
            import shutil

            shutil.rmtree(temp_keys, ignore_errors=True)


def _up_with(args, keys: str | None) -> int:
    _endpoint(args)  # validates --bind
    if args.metrics_port and args.metrics_port + args.nodes > PORT_MAX:
        raise UsageError(f"--metrics-port {args.metrics_port}: the Managers' ports would pass {PORT_MAX}")
    # Stop signals wait until every child is started, so a Ctrl-C during startup still stops them in order.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    hset = HyMCacheSet(args.nodes, args.devices_per_node, profile=args.profile, media_root=args.media_root,
                       bind=args.bind, master_port=args.port, curve_keys=keys, state_dir=args.state_dir,
                       metrics_port=args.metrics_port, put_timeout_s=args.put_timeout,
                       device_overrides=args.device_overrides, stop_timeout_s=args.stop_timeout,
                       insecure=args.insecure)
    try:
        hset.start()
        desc = hset.describe()
        print(f"chm hymcache up: master {desc['master']} (pid {desc['master_pid']})"
              f"{', CurveZMQ keys ' + keys if keys else ''}", flush=True)
        for m in desc["managers"]:
            print(f"  node {m['node']}: manager {m['endpoint']} (pid {m['pid']}), devices "
                  f"{', '.join('/dev/shm/' + d for d in m['devices'])}", flush=True)
        print(f"  chm hymcache stats --master {desc['master']}{' --curve-keys ' + keys if keys else ''}; "
              f"Ctrl-C stops all", flush=True)
        print(json.dumps(desc), flush=True)
        while True:
            got = signal.sigtimedwait(STOP_SIGNALS, 0.5)
            if got is not None:
                print(f"chm hymcache up: {signal.Signals(got.si_signo).name}: stopping managers, master, devices",
                      flush=True)
                break
            for c in hset.dead():  # restarted, the rest serving on, unless it keeps exiting
                now = time.monotonic()
                recent = [t for t in c.restarts if now - t < RESTART_WINDOW_S]
                why = f"{c.name} (pid {c.proc.pid}) exited with status {c.proc.returncode}"
                if len(recent) >= args.max_restarts:
                    raise ChmError(errno.EIO, f"{why}, restarted {len(recent)} times in the last "
                                              f"{RESTART_WINDOW_S:g} s (--max-restarts {args.max_restarts}); "
                                              f"stopped the rest")
                print(f"chm hymcache up: {why}: restarting it", flush=True)
                hset.restart(c)
                print(f"chm hymcache up: {c.name} restarted (pid {c.proc.pid}"
                      f"{', ' + c.info['endpoint'] if c.info.get('endpoint') else ''})", flush=True)
    finally:
        codes = hset.stop()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    bad = {name: code for name, code in codes.items() if code != 0}
    if bad:
        raise ChmError(errno.EIO, "not every piece stopped cleanly: "
                                  + ", ".join(f"{n} exit status {c}" for n, c in bad.items()))
    print("chm hymcache up: all stopped", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------- stats, chat

def _stats(args) -> int:
    from .metrics import rows

    MasterClient, = _need("master", ("MasterClient",))
    ManagerClient, = _need("manager", ("ManagerClient",))
    keys = args.curve_keys
    if keys and not os.path.isdir(keys):
        raise ChmError(errno.ENOENT, f"--curve-keys {keys}: no such directory")
    if keys and args.key:
        from .auth import key_file

        keys = key_file(keys, args.key)
    master = MasterClient(args.master, timeout_s=args.timeout, curve_keys=keys)
    try:
        mstats = master.stats()
        nodes = master.nodes()
    finally:
        master.close()
    managers, failed = {}, []
    for node, desc in sorted(nodes.items(), key=lambda kv: int(kv[0])):
        endpoint = desc["endpoint"] if isinstance(desc, dict) else desc.endpoint
        client = ManagerClient(endpoint, timeout_s=args.timeout, curve_keys=keys)
        try:
            managers[str(node)] = {"endpoint": endpoint, **client.stats()}
        except ChmError as exc:
            managers[str(node)] = {"endpoint": endpoint, "error": str(exc)}
            failed.append(f"manager of node {node}: {exc}")
        finally:
            client.close()
    if args.json:
        print(json.dumps({"master": mstats, "managers": managers}, indent=2, default=str))
    else:
        print(f"master {args.master}")
        for name, value in rows(mstats):
            print(f"  {name:<28} {value}")
        for node, st in managers.items():
            print(f"manager of node {node} at {st['endpoint']}")
            for name, value in rows({k: v for k, v in st.items() if k != "endpoint"}):
                print(f"  {name:<28} {value}")
    if failed:
        raise ChmError(errno.EHOSTUNREACH, "; ".join(failed))
    return 0


CHAT_FIELDS = ("conversation", "turn", "prefix_tokens", "reused_tokens", "recomputed_tokens", "loaded_bytes",
               "skipped_stores", "identical")


def _chat(args) -> int:
    from .hf_model import ensure_hf_folder
    from .vllm_serve import VllmServer, chat, connector_config, kv_bytes_per_token

    hset = None
    master = args.master
    if args.curve_keys and master is not None and not os.path.isdir(args.curve_keys):
        raise ChmError(errno.ENOENT, f"--curve-keys {args.curve_keys}: no such directory (copy the set's keys here)")
    if args.reference and not args.vllm:
        raise UsageError("--reference goes with --vllm (the server with the connector it is compared with)")

    def stop(signum, frame):  # SIGTERM as Ctrl-C: what it started stops in order
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    keys = args.curve_keys
    workdir = tempfile.mkdtemp(prefix="chm-hymcache-chat-", dir="/var/tmp")
    servers: list = []
    try:
        model = ensure_hf_folder()
        if args.vllm:
            servers = [VllmServer(url=args.vllm)] + ([VllmServer(url=args.reference)] if args.reference else [])
        else:
            if master is None:
                keys = args.curve_keys = args.curve_keys or os.path.join(workdir, "keys")  # keys and roles too
                _curve(args, args.nodes)  # created here, before the children read them
                hset = HyMCacheSet(args.nodes, args.devices_per_node, profile=args.profile, curve_keys=keys,
                                   state_dir=os.path.join(workdir, "state"), label="chm hymcache chat",
                                   verbose=False)
                print(f"chm hymcache chat: starting a set ({args.nodes} node(s) x {args.devices_per_node} "
                      f"device(s))", file=sys.stderr, flush=True)
                hset.start()
                master = hset.master_endpoint
            print("chm hymcache chat: starting vllm serve with HyMCache, and a reference without a connector "
                  "(about a minute)", file=sys.stderr, flush=True)
            servers = [VllmServer(model, prefix_caching=args.prefix_caching,
                                  kv_transfer=connector_config(master, keys, args.key),
                                  log=Path(workdir) / "vllm-hymcache.log"),
                       VllmServer(model, prefix_caching=False, log=Path(workdir) / "vllm-reference.log")]
        for server in servers:
            server.wait_ready()
        rows = chat(servers[0], servers[1] if len(servers) > 1 else None, args.turns, args.conversations, max_tokens=args.max_tokens,
                    bytes_per_token=kv_bytes_per_token(model))
    finally:
        for server in servers:
            server.stop()
        if hset is not None:
            hset.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
        return 0 if all(r["identical"] is not False for r in rows) else 1
    cols = [("conv", "conversation", 4), ("turn", "turn", 4), ("prefix", "prefix_tokens", 7),
            ("vLLM hit", "vllm_cached_tokens", 8), ("HyMCache", "reused_tokens", 8),
            ("recomputed", "recomputed_tokens", 10), ("loaded", "loaded_bytes", 10), ("TTFT ms", "ttft_ms", 8),
            ("identical", "identical", 9)]
    print("  ".join(f"{h:>{w}}" for h, _, w in cols))
    for r in rows:
        cells = []
        for _, key, w in cols:
            v = r[key]
            if key == "loaded_bytes":
                v = format_bytes(v)
            elif v is None:
                v = "-"
            elif isinstance(v, float):
                v = f"{v:.1f}"
            cells.append(f"{v!s:>{w}}")
        print("  ".join(cells))
    if not all(r["identical"] is not False for r in rows):
        raise ChmError(errno.EIO, "greedy tokens differ from vLLM without the connector in some turn (see 'identical')")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m host_runtime.hymcache.cli ...``: ``chm hymcache`` without loading every other subcommand."""
    return cli.run_subcommand(register, "hymcache", argv)


if __name__ == "__main__":
    sys.exit(main())
