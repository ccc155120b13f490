"""``chm hymcache master``: the Master alone, serving until a stop signal (``start_master``, the one start-up path
tests take too)."""

from __future__ import annotations

import os
import sys

from common.cli import UsageError

from ..serving import serve_until_signal
from .common import _curve, _endpoint, _need, _ready_line


def master_options_of(args, endpoint: str, curve_keys: str | None):
    """The flags as ``MasterOptions`` (master_service.py declares them, with their ranges, once)."""
    (master_options,) = _need("master", ("master_options",))
    return master_options(
        endpoint=endpoint, state_dir=args.state_dir, recover_damaged=args.recover_damaged, curve_keys=curve_keys,
        insecure=args.insecure, metrics_port=args.metrics_port, metrics_host=args.bind, lease_s=args.lease,
        lease_max_s=args.lease_max, put_timeout_s=args.put_timeout, high_watermark=args.high_watermark,
        low_watermark=args.low_watermark, placement=args.placement, snapshot_every=args.snapshot_every)


def _master(args) -> int:
    # the settings' cross-checks in the flags' own words (the options repeat them in the options' words)
    if args.low_watermark > args.high_watermark:
        raise UsageError(f"--low-watermark {args.low_watermark:g} must be <= --high-watermark {args.high_watermark:g}")
    if args.lease_max < args.lease:
        raise UsageError(f"--lease-max {args.lease_max:g} must be >= --lease {args.lease:g}")
    endpoint = _endpoint(args)
    keys = _curve(args)
    (start_master,) = _need("master", ("start_master",))
    if args.recover_damaged and not args.state_dir:
        raise UsageError("--recover-damaged needs --state-dir")

    def log(msg: str) -> None:
        print(f"chm hymcache master: {msg}", file=sys.stderr, flush=True)

    running = start_master(master_options_of(args, endpoint, keys), log=log)
    exporter = running.exporter

    def ready():
        print(f"chm hymcache master: {running.endpoint}"
              f"{' (CurveZMQ)' if keys else ''}, state dir {args.state_dir or '(none: in memory)'}"
              f"{f', metrics {exporter.url}' if exporter else ''}, pid {os.getpid()}; ready", flush=True)
        _ready_line("master", endpoint=running.endpoint, metrics_port=exporter.port if exporter else 0,
                    state_dir=args.state_dir)

    def cleanup():
        running.close()
        print("chm hymcache master: stopped", flush=True)

    serve_until_signal(running, cleanup, ready)
    return 0
