"""The served Master: its RPC methods and who may call them, its options (one typed declaration, with ranges),
and the one start-up path (``start_master``) that ``chm hymcache master``, ``run_master`` and the tests take."""

from __future__ import annotations

import signal
import sys
import threading
from typing import TYPE_CHECKING, Annotated, Callable

from msgspec import Meta

from . import auth
from .checks import MAX_ENDPOINT, MasterSettings, check
from .clock import Clock, WallClock
from .serving import PORT_MAX, bind_server
from .rpc import RpcServer

if TYPE_CHECKING:
    from .master_core import Master

MASTER_METHODS = ("register_node", "nodes", "lookup", "put_start", "put_end", "put_revoke", "remove", "stats")
# Served with keys, who may call what (auth.py): a KV Manager's calls are a node's; monitor is read-only.
MASTER_ROLES = {
    "register_node": {"node"},
    "nodes": {"worker", "node", "admin", "monitor"},
    "lookup": {"worker", "node"},
    "put_start": {"worker"}, "put_end": {"worker"}, "put_revoke": {"worker"},
    "remove": {"admin"},
    "stats": {"admin", "monitor"},
}
TICK_S = 0.05                       # the server's tick: expiry and journal sync


class MasterOptions(MasterSettings, kw_only=True, forbid_unknown_fields=True):
    """A served Master: its settings (MasterSettings) and where and how it serves. Built with ``master_options``
    (keywords) or from ``chm hymcache master``'s flags (commands/master.py), checked once, here."""

    endpoint: Annotated[str, Meta(min_length=1, max_length=MAX_ENDPOINT)] = "tcp://127.0.0.1:0"
    state_dir: str | None = None        # snapshot and journal (None: in memory)
    recover_damaged: bool = False       # start from a damaged state dir, keeping what can be read
    curve_keys: str | None = None       # a key directory: CurveZMQ, roles, signed leases
    insecure: bool = False              # without keys on a non-loopback address
    metrics_port: Annotated[int, Meta(ge=0, le=PORT_MAX)] = 0  # Prometheus (0: off)
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recover_damaged and not self.state_dir:
            raise check.fail("recover_damaged", self.recover_damaged, "false without a state_dir")


def master_options(**options) -> MasterOptions:
    """``MasterOptions`` from keywords, each checked (EINVAL naming the option, its value and its range)."""
    return check.convert(options, MasterOptions)


def serve_master(master: Master, endpoint: str, curve_keys: str | None = None,
                 log: Callable[[str], None] | None = None, *, insecure: bool = False) -> RpcServer:
    """An RpcServer for ``master`` bound to ``endpoint`` (run ``serve_forever``); its tick expires and syncs.
    With ``curve_keys`` (a key directory) only its authorized keys get in, each call within MASTER_ROLES, and
    leases are signed with the directory's lease secret; without, ``endpoint`` must be loopback unless
    ``insecure``."""
    if curve_keys:
        master.lease_secret = auth.load_lease_secret(curve_keys)
    return RpcServer(_ServedMaster(master), MASTER_METHODS, endpoint, tick=master.tick, tick_s=TICK_S,
                     curve_keys=curve_keys, log=log, roles=MASTER_ROLES, callers=("register_node",), insecure=insecure)


class _ServedMaster:
    """What serve_master exposes: the Master; register_node answers the node's lease secret (to a node key,
    over CurveZMQ, with keys). The caller's identity comes in as an argument (the server's, per call)."""

    def __init__(self, master: Master):
        self.master = master

    def __getattr__(self, name):
        return getattr(self.master, name)

    def register_node(self, node, endpoint, devices, *, caller=None) -> bytes:
        self.master.register_node(node, endpoint, devices, caller=caller)
        return self.master.node_secret(node)


class RunningMaster:
    """A Master bound to its endpoint (``start_master``): ``serve_forever()`` in one thread until ``stop()``,
    then ``close()`` (journal synced, snapshot written, metrics closed). A context manager that closes."""

    def __init__(self, master: Master, server: RpcServer, exporter=None):
        self.master, self.server, self.exporter = master, server, exporter
        self._thread: threading.Thread | None = None
        self._served = False  # serve_forever closes the socket when it ends; close() does if it never ran

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def serve_forever(self) -> None:
        self._served = True
        self.server.serve_forever()

    def serve_in_thread(self) -> "RunningMaster":
        """Serve on a thread of its own (in-process users: tests, benches); ``stop()`` joins it."""
        self._served = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="hymcache-master", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (safe from a signal handler or another thread)."""
        self.server.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
            self._thread = None

    def close(self) -> None:
        self.stop()
        if not self._served:
            self.server.sock.close(0)
        self.master.close()
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None

    def __enter__(self) -> "RunningMaster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_master(options: MasterOptions, *, clock: Clock | None = None,
                 log: Callable[[str], None] | None = None) -> RunningMaster:
    """The one start-up path: a Master (recovered from ``options.state_dir``), bound to ``options.endpoint``
    (a bind failure: ChmError naming the address), with its metrics exporter; not serving yet. ``clock``: a
    test's ManualClock (default the wall's)."""
    from .master_core import Master
    from .metrics import StatsExporter, chain_tick

    if not isinstance(options, MasterOptions):
        options = check.convert(options, MasterOptions)
    settings = {name: getattr(options, name) for name in MasterSettings.__struct_fields__}
    master = Master(clock or WallClock(), options.state_dir, recover_damaged=options.recover_damaged, log=log,
                    **settings)
    exporter = None
    try:
        server = bind_server(lambda: serve_master(master, options.endpoint, curve_keys=options.curve_keys, log=log,
                                            insecure=options.insecure), options.endpoint)
        if options.metrics_port:
            exporter = StatsExporter("master", master.stats, port=options.metrics_port, host=options.metrics_host)
            chain_tick(server, exporter)
    except BaseException:
        master.close()
        raise
    return RunningMaster(master, server, exporter)


def run_master(endpoint: str, state_dir: str | None, *, placement: str = "round_robin", lease_s: float = 10.0,
               lease_max_s: float = 30.0, put_timeout_s: float = 30.0, high_watermark: float = 0.90,
               low_watermark: float = 0.85, snapshot_every: int = 100_000, curve_keys: str | None = None,
               log: Callable[[str], None] | None = None, ready: Callable[[str], None] | None = None) -> int:
    """``start_master``, then serve until SIGTERM/SIGINT; ``ready(bound endpoint)`` once it listens.
    Returns 0 after a clean stop (journal synced, snapshot written)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    options = master_options(endpoint=endpoint, state_dir=state_dir, placement=placement, lease_s=lease_s,
                             lease_max_s=lease_max_s, put_timeout_s=put_timeout_s, high_watermark=high_watermark,
                             low_watermark=low_watermark, snapshot_every=snapshot_every, curve_keys=curve_keys)
    with start_master(options, log=log) as running:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: running.stop())
        (ready or (lambda ep: print(f"master: serving on {ep}", flush=True)))(running.endpoint)
        running.serve_forever()
    return 0

