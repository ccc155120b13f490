"""``chm hymcache master``: the Master alone, serving until a stop signal."""

from __future__ import annotations

import os
import sys

from common.cli import UsageError

from .common import _bind, _curve, _endpoint, _need, _ready_line, _serve_until_signal


def _master(args) -> int:
    from ..clock import WallClock
    from ..metrics import StatsExporter, chain_tick

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
