"""What the service commands share: addresses, keys and the ready line (binding and serving until a stop signal
are the services' own: serving.py)."""

from __future__ import annotations

import errno
import json
import os

from common.cli import UsageError
from driver.errors import ChmError

from ..serving import PORT_MAX, STOP_SIGNALS  # noqa: F401 (the commands' limits: re-exported)

DEFAULT_STOP_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 60.0
DEFAULT_MAX_RESTARTS = 5     # chm hymcache up: restarts of one child ...
RESTART_WINDOW_S = 60.0      # ... within this long, before it gives up and stops all
PR_SET_PDEATHSIG = 1


def _endpoint(args) -> str:
    if ":" in args.bind and not args.bind.startswith("["):
        raise UsageError(f"--bind {args.bind!r}: a host name or IPv4 address, without a port (see --port)")
    return f"tcp://{args.bind}:{args.port}"


def _curve(args, nodes: int = 0) -> str | None:
    if not getattr(args, "curve_keys", None):
        return None
    from ..rpc import make_curve_keys

    make_curve_keys(args.curve_keys, nodes)
    return args.curve_keys


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


def _ready_line(role: str, **fields) -> None:
    """What a parent (``up``, tests) waits for: one JSON line on stdout."""
    print(json.dumps({"hymcache": role, "pid": os.getpid(), **fields}), flush=True)
