"""How a HyMCache service runs as a process: its bind failure named as a runtime error, and serving until a stop
signal (what ``start_master``/``start_manager`` and the ``chm hymcache`` commands share)."""

from __future__ import annotations

import errno
import signal

from driver.errors import ChmError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PORT_MAX = 65535


def bind_server(make, endpoint: str):
    """``make()`` (a server binding ``endpoint``), a bind failure as a runtime error naming the address."""
    import zmq

    try:
        return make()
    except zmq.ZMQError as exc:
        raise ChmError(exc.errno or errno.EADDRNOTAVAIL, f"cannot bind {endpoint}: {exc.strerror}") from None


def serve_until_signal(server, cleanup, ready) -> None:
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
