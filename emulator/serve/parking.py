"""Parked waits: a prefetch wait whose object still has media reads in flight is set aside, and the device
serves the other clients until the reads land; then the spin after a staged wait. Methods of DeviceServer.
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING, NamedTuple

from emulator.errors import ChmError

if TYPE_CHECKING:
    from .clients import Client

PARKED_POLL_NS = 50_000  # while a wait is parked, the C loop hands back this often to look at its media reads
# After a prefetch wait is answered the device spins at least this long before sleeping: reads of the staged
# object usually follow (often from another client: a KV Manager stages, its worker reads), and a sleeping
# device takes a wake-up, tens of microseconds to a millisecond on a virtual machine, to serve them.
STAGED_SPIN_NS = 500_000


class ParkedWait(NamedTuple):
    """A prefetch wait whose object still has media reads in flight: the device serves others meanwhile."""
    user_data: int
    handle: int
    timeout_ns: int   # < 0: none
    start: float      # the command's virtual start: its finish is computed from it, as if it had not waited


class _Park(Exception):
    """Raised by _execute for a wait that would block on media reads (see ParkedWait)."""


class Parking:
    """Parked prefetch waits and the spin after a staged one (a DeviceServer mixin)."""

    def _park(self, c: Client, wait: ParkedWait) -> None:
        """Answer ``c``'s wait once its object's media reads land; nothing else of ``c`` runs meanwhile."""
        c.parked = wait
        if not self.parked and self._media_fd is not None:
            self.poller.register(self._media_fd, select.POLLIN)
        self.parked.append(c)

    def _unpark(self, c: Client) -> None:
        c.parked = None
        self.parked.remove(c)
        if not self.parked and self._media_fd is not None:
            self.poller.unregister(self._media_fd)

    def _unpark_landed(self) -> None:
        """Answer every parked wait whose media reads have landed (or failed)."""
        for c in list(self.parked):
            w = c.parked
            timeout = None if w.timeout_ns < 0 else float(w.timeout_ns)
            try:
                if self.ctl.wait_would_block(w.handle, w.start, timeout):
                    continue
                res, finish = 0, self.ctl.wait(w.handle, w.start, timeout)
                self._staged()
            except ChmError as exc:
                res, finish = self._failed(c, exc, w.start, w.timeout_ns)
            except Exception:  # a device bug must not take every client down
                res, finish = self._crashed(c, w.start)
            self._unpark(c)
            self._complete(c, w.user_data, w.start, res, finish)

    def _spin_ns(self) -> int:
        """How long to spin for new commands before sleeping: ``spin_us``, longer just after a staged wait."""
        if self._staged_spin_until:
            left = self._staged_spin_until - self.clock.monotonic_ns()
            if left > self.spin_ns:
                return left
            self._staged_spin_until = 0
        return self.spin_ns

    def _staged(self) -> None:
        """A prefetch wait was answered: its object's reads are likely next (see STAGED_SPIN_NS)."""
        if self.spin_ns:
            self._staged_spin_until = self.clock.monotonic_ns() + STAGED_SPIN_NS
