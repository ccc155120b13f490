"""A serving node's host side as the tiers see it: the PCIe link, the staging (transfer) buffer, the NIC ports."""

from __future__ import annotations

import math
from collections import deque

from emulator.timing import Pipe

from ..events import Env


class Staging:
    """The host's staging buffer (bytes): transfer space between the remote tier and the GPU.

    ``take`` waits for room (back-pressure, first come first served), until an optional deadline: past
    it, it gives up (False) and leaves the queue. The HyMCache connector's stores take what is free now
    and skip the rest (transfer space, not a cache); Mooncake's inserts wait up to their timeout."""

    def __init__(self, env: Env, capacity: int):
        self.env, self.capacity, self.used, self.peak = env, capacity, 0, 0
        self.waiters: deque = deque()
        self.waits = 0
        self.timeouts = 0

    def free(self) -> int:
        return self.capacity - self.used

    def take(self, n: int, deadline: float = math.inf):
        """Process: wait until ``n`` bytes are free, then hold them (True); False if ``deadline`` passes first."""
        if n > self.capacity:
            raise ValueError(f"a block of {n} bytes can never fit the staging buffer of {self.capacity} bytes")
        if self.waiters or self.used + n > self.capacity:
            if deadline <= self.env.now:
                self.timeouts += 1
                return False
            self.waits += 1
            ev = self.env.event()
            w = (n, ev)
            self.waiters.append(w)
            if deadline < math.inf:
                self.env.call_at(deadline, lambda: self._expire(w))
            return (yield ev)  # True: give() has taken the bytes for us
        self.hold(n)
        return True

    def _expire(self, w) -> None:
        if w[1].fired:
            return
        self.waiters.remove(w)
        self.timeouts += 1
        w[1].succeed(False)
        self._grant()  # a smaller waiter behind it may fit now

    def hold(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self.waiters and self.waiters[0][0] <= self.capacity - self.used:
            m, ev = self.waiters.popleft()
            self.hold(m)  # taken now, on the waiter's behalf: nobody can overtake it before it resumes
            ev.succeed(True)


class Nic:
    """One RDMA port of a node: a pipe per direction (full duplex), bandwidth in Gbit/s."""

    def __init__(self, name: str, gbps: float, latency_ns: float):
        self.gbps = gbps
        self.rx = Pipe(f"{name}.rx", latency_ns, gbps / 8)
        self.tx = Pipe(f"{name}.tx", latency_ns, gbps / 8)


def rdma(src: "Nic | None", dst: "Nic | None", now: float, nbytes: int) -> float:
    """Arrival of ``nbytes`` sent at ``now`` out of ``src``'s port into ``dst``'s (either may be absent: a link
    modelled elsewhere, or none): both ports are reserved from ``now``; the slower one decides (cut-through)."""
    t = now
    if src is not None:
        t = max(t, src.tx.transfer(now, nbytes))
    if dst is not None:
        t = max(t, dst.rx.transfer(now, nbytes))
    return t


class Host:
    """One serving node's host side: the PCIe link to its GPU (one pipe per direction), its staging buffer and,
    in the PD topology, its NIC ports: ``kv_nic`` (the remote KV tier's traffic) and ``pd_nic`` (P->D)."""

    def __init__(self, env: Env, pcie_gbps: float, pcie_latency_ns: float, staging_bytes: int, *, index: int = 0,
                 kv_nic: Nic | None = None, pd_nic: Nic | None = None):
        self.index = index
        self.h2d = Pipe("pcie.h2d", pcie_latency_ns, pcie_gbps)
        self.d2h = Pipe("pcie.d2h", pcie_latency_ns, pcie_gbps)
        self.staging = Staging(env, staging_bytes)
        self.kv_nic, self.pd_nic = kv_nic, pd_nic
