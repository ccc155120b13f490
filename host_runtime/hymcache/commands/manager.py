"""``chm hymcache manager``: one node's KV Manager alone, serving until a stop signal."""

from __future__ import annotations

import errno
import os
import sys

from common.cli import UsageError
from driver.errors import ChmError

from ..serving import serve_until_signal
from .common import _curve, _endpoint, _need, _ready_line


def _manager(args) -> int:
    advertise = args.advertise or args.bind
    if advertise in ("0.0.0.0", "*", "::"):
        raise UsageError(f"--bind {args.bind} needs --advertise HOST: the address the Master and workers reach")
    if len(set(args.devices)) != len(args.devices):
        raise UsageError(f"--device given twice: {', '.join(args.devices)}")
    endpoint = _endpoint(args)
    keys = _curve(args)
    manager_options, start_manager, node_path = _need("manager", ("manager_options", "start_manager", "node_path"))
    for name in args.devices:
        if not os.path.exists(node_path(name)):
            raise ChmError(errno.ENOENT, f"--device {name}: no chm serve device at {node_path(name)} "
                                         f"(start it first: chm serve --node {name})")
    options = manager_options(node=args.node, devices=list(args.devices), master=args.master, endpoint=endpoint,
                              advertise=args.advertise, window_bytes=args.window_bytes, master_timeout_s=args.timeout,
                              curve_keys=keys, key=args.key, insecure=args.insecure, metrics_port=args.metrics_port)
    log = lambda msg: print(f"chm hymcache manager {args.node}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    running = start_manager(options, log=log)
    exporter = running.exporter

    def ready():
        print(f"chm hymcache manager: node {args.node} at {running.endpoint}{' (CurveZMQ)' if keys else ''}, "
              f"devices {', '.join(args.devices)}, master {args.master}"
              f"{f', metrics {exporter.url}' if exporter else ''}, pid {os.getpid()}; ready", flush=True)
        _ready_line("manager", node=args.node, endpoint=running.endpoint, devices=list(args.devices),
                    metrics_port=exporter.port if exporter else 0)

    def cleanup():
        running.close()
        print(f"chm hymcache manager {args.node}: stopped", flush=True)

    serve_until_signal(running, cleanup, ready)
    return 0
