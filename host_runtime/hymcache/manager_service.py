"""A KV Manager's one start-up path: ``start_manager(options)`` connects to the Master, opens the node's devices,
binds, registers and returns the running service. ``chm hymcache manager`` (commands/manager.py) and
``run_manager`` both start it so, and so do the tests that serve a Manager in process."""

from __future__ import annotations

import threading
from typing import Annotated, Callable

import msgspec
from msgspec import Meta

from host_runtime.hymcache import auth
from host_runtime.hymcache.clock import Clock, WallClock
from host_runtime.hymcache.serving import PORT_MAX, bind_server, serve_until_signal
from host_runtime.hymcache.manager_core import KVManager
from host_runtime.hymcache.manager_server import ManagerServer, serve_manager
from host_runtime.hymcache.manager_state import MAX_NODE, MAX_WINDOW_BYTES, REQUEST_TIMEOUT_S, check
from host_runtime.hymcache.window import WINDOW_BYTES

MASTER_TIMEOUT_S = 10.0  # calls to the Master (the CLI's --timeout)


class ManagerOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one node's Manager runs: the CLI's values and ``run_manager``'s keywords, declared once."""

    node: Annotated[int, Meta(ge=0, le=MAX_NODE)]
    devices: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)]  # chm serve nodes, in order
    master: str = ""                        # the Master's address; "" with an in-process master (start_manager)
    endpoint: str = "tcp://127.0.0.1:0"     # where it binds (port 0: a free one)
    advertise: str | None = None            # the host the Master and workers reach it at (default: as bound)
    window_bytes: Annotated[int, Meta(ge=1, le=MAX_WINDOW_BYTES)] = WINDOW_BYTES
    request_timeout_s: Annotated[float, Meta(gt=0)] = REQUEST_TIMEOUT_S
    master_timeout_s: Annotated[float, Meta(gt=0)] = MASTER_TIMEOUT_S
    curve_keys: str | None = None           # a key directory: CurveZMQ both ways
    key: str | None = None                  # the node key it calls the Master with (default node-NODE)
    insecure: bool = False                  # bind beyond loopback without keys
    metrics_port: Annotated[int, Meta(ge=0, le=PORT_MAX)] = 0  # Prometheus (0: off)


def manager_options(**values) -> ManagerOptions:
    """``ManagerOptions`` from keywords, each checked against its declared range (EINVAL naming it)."""
    return check.convert(values, ManagerOptions)


def _host_of(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` address (where the metrics port binds too)."""
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0] if endpoint.startswith("tcp://") else "127.0.0.1"


class RunningManager:
    """One node's Manager, bound and registered: ``serve_forever()`` (or ``serve_in_background()``), ``stop()``,
    then ``close()``. ``endpoint`` is the address it registered (advertised) with the Master."""

    def __init__(self, manager: KVManager, server: ManagerServer, endpoint: str, master_client=None,
                 exporter=None):
        self.manager, self.server, self.endpoint = manager, server, endpoint
        self.master_client, self.exporter = master_client, exporter  # closed with it (started by start_manager)
        self._thread: threading.Thread | None = None
        self._served = False

    @property
    def bound(self) -> str:
        """The address it bound (a free port picked)."""
        return self.server.endpoint

    def serve_forever(self) -> None:
        self._served = True
        self.server.serve_forever()

    def serve_in_background(self) -> "RunningManager":
        self._thread = threading.Thread(target=self.serve_forever, name="hymcache-manager", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def close(self) -> None:
        """Stop serving (a background thread: joined), then close the Manager, its Master client and metrics."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if not self._served:  # bound, never served: serve_forever's end closes its sockets otherwise
            self.server.sock.disable_monitor()
            self.server.monitor.close(0)
            self.server.sock.close(0)
            self._served = True
        self.manager.close()
        if self.master_client is not None:
            self.master_client.close()
        if self.exporter is not None:
            self.exporter.close()

    def __enter__(self) -> "RunningManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_manager(options: ManagerOptions, *, log: Callable[[str], None] | None = None, master=None,
                  clock: Clock | None = None, open_device=None) -> RunningManager:
    """Start node ``options.node``'s Manager: a MasterClient to ``options.master`` (with keys, as the node's key),
    the devices opened, its Master lookups confirmed on a thread of their own, the server bound to
    ``options.endpoint`` and the node registered under it (or under ``options.advertise``).

    ``master`` (an in-process Master, or any object with its methods) replaces the client to ``options.master``:
    then hints are confirmed at the next call instead of in the background, unless ``options.master`` is given
    too. ``clock`` (default wall time) and ``open_device`` go to KVManager."""
    from host_runtime.hymcache.master import MasterClient  # the Master's module: imported when a Manager runs

    node_key = auth.key_file(options.curve_keys, options.key or f"node-{options.node}")
    master_client = None
    if master is None:
        master = master_client = MasterClient(options.master, timeout_s=options.master_timeout_s,
                                              curve_keys=node_key)
    manager = exporter = None
    try:
        # endpoint "": the server registers the node under the address it bound (a free port with port 0)
        extra = {} if open_device is None else {"open_device": open_device}
        manager = KVManager(options.node, list(options.devices), master, clock or WallClock(),
                            window_bytes=options.window_bytes, request_timeout_s=options.request_timeout_s,
                            endpoint="", log=log, **extra)
        if options.master:  # a hung Master holds up no call here
            manager.confirm_in_background(options.master, options.master_timeout_s, node_key)
        server = bind_server(lambda: serve_manager(manager, options.endpoint, curve_keys=options.curve_keys, log=log,
                                             insecure=options.insecure), options.endpoint)
        public = server.endpoint
        if options.advertise:
            public = f"tcp://{options.advertise}:{server.endpoint.rsplit(':', 1)[1]}"
            manager.register(public)
        if options.metrics_port:
            from host_runtime.hymcache.metrics import StatsExporter, chain_tick

            exporter = StatsExporter("manager", manager.stats, port=options.metrics_port,
                                     host=_host_of(options.endpoint), labels={"node": str(options.node)})
            chain_tick(server, exporter)
    except BaseException:
        if manager is not None:
            manager.close()
        if master_client is not None:
            master_client.close()
        raise
    return RunningManager(manager, server, public, master_client, exporter)


def run_manager(node: int, device_nodes: list[str], master_endpoint: str, endpoint: str = "tcp://127.0.0.1:0", *,
                window_bytes: int = WINDOW_BYTES, request_timeout_s: float = REQUEST_TIMEOUT_S,
                curve_keys: str | None = None, master_timeout_s: float = MASTER_TIMEOUT_S,
                on_ready: Callable[[str], None] | None = None, stop: threading.Event | None = None,
                log: Callable[[str], None] | None = None, key: str | None = None, insecure: bool = False) -> int:
    """`chm hymcache manager` from Python: serve node ``node``'s devices until SIGINT/SIGTERM (or ``stop``); 0 when
    stopped. ``on_ready(endpoint)`` is called once the Manager is registered and bound. With ``curve_keys`` (a key
    directory) it calls the Master with key ``key`` (default ``node-NODE``)."""
    options = manager_options(node=node, devices=list(device_nodes), master=master_endpoint, endpoint=endpoint,
                              window_bytes=window_bytes, request_timeout_s=request_timeout_s,
                              curve_keys=curve_keys, master_timeout_s=master_timeout_s, key=key, insecure=insecure)
    running = start_manager(options, log=log)
    if stop is not None:
        threading.Thread(target=lambda: (stop.wait(), running.stop()), daemon=True).start()

    def ready() -> None:
        if on_ready is not None:
            on_ready(running.endpoint)

    if threading.current_thread() is threading.main_thread():
        serve_until_signal(running, running.close, ready)
    else:  # no signal handlers off the main thread: ``stop`` ends it
        try:
            ready()
            running.serve_forever()
        finally:
            running.close()
    return 0
