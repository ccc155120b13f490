"""Time for every timeout, lease and deadline of the HyMCache runtime.

Components never call ``time`` themselves: they read an injected clock, so the
same classes run live (wall time) and in the serving simulation (virtual time).
Seconds, as floats.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock (only differences mean anything)."""


class WallClock:
    """Live: monotonic wall time."""

    @staticmethod
    def now() -> float:
        return time.monotonic()


class ManualClock:
    """Tests and virtual time: time moves only when told to."""

    def __init__(self, start: float = 0.0):
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        if not seconds >= 0:  # NaN fails too
            raise ValueError(f"clock advance {seconds!r} must be >= 0")
        self.t += seconds
        return self.t
