"""``chm hymcache manager``: one node's KV Manager alone, serving until a stop signal."""

from __future__ import annotations

import errno
import os
import sys

from common.cli import UsageError
from driver.errors import ChmError

from .common import _bind, _curve, _endpoint, _need, _ready_line, _serve_until_signal


def _manager(args) -> int:
    from ..clock import WallClock
    from ..metrics import StatsExporter, chain_tick

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
    from ..auth import key_file

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
