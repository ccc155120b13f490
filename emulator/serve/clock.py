"""The device server's wall clock, injected: what it reads for idle time, pacing, timeouts and log rate
limits, and how it waits in ``poll()`` while idle.

The emulator keeps its own (it must not import host_runtime, whose hymcache/clock.py is the runtime's);
the server's time is the ``time`` module's monotonic clock, so this protocol has its two readings.
"""

from __future__ import annotations

import math
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds (only differences mean anything)."""

    def monotonic_ns(self) -> int:
        """The same clock in nanoseconds."""

    def poll(self, poller, timeout_ms: float | None) -> list[tuple[int, int]]:
        """``poller.poll(timeout_ms)``: the idle sleep, ended by an event or the timeout (None: no timeout)."""


class WallClock:
    """Live: ``source``'s monotonic clock (the ``time`` module, or a stand-in with its functions)."""

    def __init__(self, source=time):
        self.source = source

    def monotonic(self) -> float:
        return self.source.monotonic()

    def monotonic_ns(self) -> int:
        return self.source.monotonic_ns()

    @staticmethod
    def poll(poller, timeout_ms: float | None) -> list[tuple[int, int]]:
        return poller.poll(timeout_ms)


class ManualClock:
    """Tests: time moves only when told to, and an idle sleep takes no wall time: it returns what is ready
    now, or, with nothing ready, moves the clock on to its timeout."""

    def __init__(self, start_ns: int = 0):
        self.t_ns = int(start_ns)

    def monotonic(self) -> float:
        return self.t_ns / 1e9

    def monotonic_ns(self) -> int:
        return self.t_ns

    def advance(self, seconds: float) -> int:
        """Move the clock ``seconds`` on; returns the new reading in nanoseconds."""
        if not seconds >= 0:  # NaN fails too
            raise ValueError(f"clock advance {seconds!r} must be >= 0")
        self.t_ns += math.ceil(seconds * 1e9)
        return self.t_ns

    def poll(self, poller, timeout_ms: float | None) -> list[tuple[int, int]]:
        events = poller.poll(0)
        if not events and timeout_ms is not None:
            self.advance(timeout_ms / 1e3)
        return events
