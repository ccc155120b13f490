"""The Master's allocator: placement of a request on a node and device, each device's space, expiry, and the
choice of blocks to evict (past the high watermark, least recently used first, down to the low one).

Allocation (per device, append-only)
------------------------------------
A block goes at the device's write head when it fits before the end; else in
the first freed extent large enough, taken in the order extents were freed
(from the extent's end, so the rest keeps its place). A freed extent merges
with free neighbours; the merged extent counts as freed now. A live block's
bytes are never handed out again: only freed extents are, and a block removed
while leased is freed when its lease ends. A put revoked at its timeout is
freed one more put timeout later: its writer may be slow rather than gone, and
its late writes must not land on another request's block (a put the writer
revokes itself is freed at once). ``fragmentation`` in stats() is
1 - largest free extent / free bytes (the region after the head counts as one
extent): 0 when all free space is one run, near 1 when shattered.
"""

from __future__ import annotations

import errno
import heapq
from collections import OrderedDict

import numpy as np

from driver.errors import ChmError

from .journal import _DropRec, _FreeRec
from .master_table import COMPLETE, DRAINING
from .messages import DeviceInfo


# ---------------------------------------------------------------- one device's space

class _Device:
    """Append-only allocation on one device: a write head, then freed extents in the order freed."""

    __slots__ = ("node", "info", "capacity", "head", "used", "freed", "ends", "evict_retry_ms")

    def __init__(self, node: int, info: DeviceInfo):
        self.node, self.info, self.capacity = node, info, info.capacity_bytes
        self.head = 0
        self.used = 0                                   # bytes of PENDING, COMPLETE and DRAINING blocks
        self.freed: OrderedDict[int, int] = OrderedDict()  # start -> length, oldest freed first
        self.ends: dict[int, int] = {}                  # end -> start, to merge neighbours
        self.evict_retry_ms = 0                         # over the watermark with nothing evictable: skip until then

    def allocate(self, length: int) -> int | None:
        if self.head + length <= self.capacity:
            offset = self.head
            self.head += length
        else:
            for start, size in self.freed.items():
                if size >= length:
                    break
            else:
                return None
            del self.ends[start + size]
            if size == length:
                del self.freed[start]
            else:
                self.freed[start] = size - length       # keeps its place in the freed order
                self.ends[start + size - length] = start
            offset = start + size - length
        self.used += length
        return offset

    def free(self, offset: int, length: int) -> None:
        self.used -= length
        start, end = offset, offset + length
        if start in self.ends:
            prev = self.ends.pop(start)
            del self.freed[prev]
            start = prev
        if end in self.freed:
            end_next = end + self.freed.pop(end)
            del self.ends[end_next]
            end = end_next
        self.freed[start] = end - start
        self.ends[end] = start

    def space(self) -> dict:
        tail = self.capacity - self.head
        free_bytes = tail + sum(self.freed.values())
        largest = max([tail, *self.freed.values()])
        return {"node": self.node, "device": self.info.device, "capacity_bytes": self.capacity,
                "used_bytes": self.used, "free_bytes": free_bytes, "write_head": self.head,
                "freed_extents": len(self.freed), "largest_free_extent": largest,
                "fragmentation": 0.0 if free_bytes == 0 else 1.0 - largest / free_bytes}



class MasterAllocator:
    """Space and eviction of ``Master`` (a mixin over master_table's rows)."""

    def _device(self, node: int, device: int) -> _Device:
        entry = self._nodes.get(node)
        if entry is None:
            raise ChmError(errno.ENOENT, f"node {node} is not registered (registered: {sorted(self._nodes)})")
        dev = entry["devices"].get(device)
        if dev is None:
            raise ChmError(errno.ENOENT, f"device {device} of node {node} is not registered "
                                        f"(its devices: {sorted(entry['devices'])})")
        return dev

    def _all_devices(self):
        for entry in self._nodes.values():
            yield from entry["devices"].values()

    def _add_draining(self, row: int) -> None:
        r = self._table[row]
        extent = (int(r["node"]), int(r["device"]), int(r["offset"]))
        self._draining[extent] = row
        heapq.heappush(self._drain_heap, (int(r["lease_until"]), row, extent))

    def _free_extent(self, row: int) -> None:
        r = self._table[row]
        self._device(int(r["node"]), int(r["device"])).free(int(r["offset"]), int(r["length"]))

    def _drop(self, key: bytes, now_ms: int, leased: bool | None = None, hold_until_ms: int | None = None) -> None:
        """``key`` leaves the index; its space is freed now, or when its read lease ends (``leased``:
        given by journal replay, which has no leases), or at ``hold_until_ms`` (a put that timed out: see
        ``_expire``)."""
        row = self._index.pop(key)
        self._pending.pop(row, None)
        if hold_until_ms is not None:
            self._table["lease_until"][row] = hold_until_ms
            leased = True
        if leased is None:
            leased = bool(self._table["state"][row] == COMPLETE and self._table["lease_until"][row] > now_ms)
        self._log(_DropRec(key, not leased))
        if leased:
            self._table["state"][row] = DRAINING
            self._add_draining(row)
        else:
            self._free_extent(row)
            self._release_row(row)

    def _place(self) -> int:
        nodes = sorted(n for n, e in self._nodes.items() if e["devices"])
        if not nodes:
            raise ChmError(errno.ENODEV, "no storage node is registered: start a KV Manager first")
        if self.placement == "load_aware":
            return min(nodes, key=lambda n: (sum(d.used for d in self._nodes[n]["devices"].values()), n))
        node = nodes[self._next_node % len(nodes)]
        self._next_node += 1
        return node

    def _expire(self, now: int) -> None:
        t = self._table
        while self._pending:
            row = next(iter(self._pending))
            if t["put_deadline"][row] > now:
                break
            # Its writer may still be writing (slow, not dead): the extent waits one more put timeout before
            # it can be handed out again, so a late write lands on no other request's block.
            self._drop(t["key"][row].tobytes(), now, hold_until_ms=now + self._put_timeout_ms)
            self.counters["revoked_blocks"] += 1
        heap, draining = self._drain_heap, self._draining
        while heap:
            _, row, extent = heap[0]
            if draining.get(extent) != row:
                heapq.heappop(heap)  # freed or forgotten meanwhile (its row may hold another block now)
            elif t["lease_until"][row] <= now:
                heapq.heappop(heap)
                del draining[extent]
                self._log(_FreeRec(*extent))
                self._free_extent(row)
                self._release_row(row)
            else:
                break
        for dev in self._all_devices():
            if dev.used > self.high_watermark * dev.capacity and dev.evict_retry_ms <= now:
                self._evict_over_watermark(dev, now)

    def _evictable(self, dev: _Device, now: int) -> np.ndarray:
        """Rows of complete, unleased blocks of ``dev``, least recently used first."""
        t = self._table[:self._rows_used]
        rows = np.flatnonzero((t["state"] == COMPLETE) & (t["node"] == dev.node) & (t["device"] == dev.info.device)
                              & (t["lease_until"] <= now))
        return rows[np.argsort(t["lru"][rows], kind="stable")]

    def _evict_over_watermark(self, dev: _Device, now: int) -> None:
        if dev.used <= self.high_watermark * dev.capacity:
            return
        target = self.low_watermark * dev.capacity
        for row in self._evictable(dev, now).tolist():
            if dev.used <= target:
                break
            self._drop(self._table["key"][row].tobytes(), now)
            self.counters["evictions"] += 1
        if dev.used > self.high_watermark * dev.capacity:
            # nothing more to evict until a lease ends or a put completes (put_end resets this)
            t = self._table[:self._rows_used]
            leased = t["lease_until"][(t["state"] == COMPLETE) & (t["node"] == dev.node)
                                      & (t["device"] == dev.info.device) & (t["lease_until"] > now)]
            dev.evict_retry_ms = int(leased.min()) if leased.size else 1 << 62

