"""The HyMCache Master: global metadata of every stored KV block.

Entries
-------
One 64-byte row per block in a numpy structured array (``ENTRY_DTYPE``,
packed, little-endian), and an index ``dict[key bytes -> row]``. Freed rows
are reused before the table grows (it doubles).

    offset  field         type  meaning
     0      key           V16   the block key (keys.py: chained SHA-256 truncated to 16 bytes)
    16      offset        u8    byte address of the block on its device
    24      checksum      u8    xxh3_64 of the block's bytes (given at put_end)
    32      lru           u8    LRU stamp: the Master's touch counter at the last put_end/lookup
    40      length        u4    bytes (blocks up to 4 GiB - 1)
    44      version       u4    Master-wide store counter at put_start (wraps at 2^32; only equality matters)
    48      lease_until   u4    read lease end, ms on the Master's time base (0: none)
    52      lease_cap     u4    first grant + lease_max_s, ms: renewals never go past it
    56      put_deadline  u4    put_start + put_timeout_s, ms: revoked then if put_end has not come
    60      node          u2    storage node
    62      device        u1    device within the node
    63      state         u1    FREE 0, PENDING 1 (put_start .. put_end), COMPLETE 2,
                                DRAINING 3 (removed while leased: space freed when the lease ends)

Times are u4 milliseconds since a time base (the clock at start), so three
deadlines fit beside the 8-byte fields; when the base is 2^31 ms (24.8 days)
behind, it moves forward and the columns shift (``_rebase``). Deadlines round
up to the next ms, so a lease or put never ends early.

Bytes per entry including the index: ``Master.metadata_bytes()`` counts the
table, the dict's own hash table (``sys.getsizeof``), one 16-byte ``bytes``
object per key and one ``int`` object per row number; ``measure_bytes_per_entry``
checks that count against ``tracemalloc`` (numpy reports its buffers to it).

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

Crash safety (``state_dir``)
----------------------------
Every mutation appends a record to ``journal-<gen>`` (framing, damage rules and
recovery: ``journal.py``): node registrations, allocations, commits, drops and
frees, in the order they happen, so replay reproduces the allocator exactly.
Records reach the OS at the end of every call (so ``kill -9`` loses nothing
that returned) and are fsync'd before ``put_end`` and ``register_node`` return
(durable against power loss too) and on every server tick. A call whose record
cannot be written (ENOSPC, EIO) fails and is undone, naming the state dir;
lookups go on meanwhile, and puts resume when the disk does. Every
``snapshot_every`` records the whole state goes to ``snapshot.msgpack`` and a
new journal generation starts. On start the snapshot is loaded and its journal
replayed; damage refuses the start, naming the file and the offset, unless
``recover_damaged``. Then put_starts in flight are revoked and leases dropped
(they do not survive a restart: workers time out and recompute, then store
again); LRU order after a restart is put_end order. A lock file keeps a second
Master off the same directory.
"""

from __future__ import annotations

import argparse
import errno
import heapq
import itertools
import math
import os
import signal
import sys
import threading
import tracemalloc
from collections import OrderedDict
from typing import Callable, Union

import msgspec
import numpy as np

from driver.errors import ChmError

from . import auth
from .checks import (MAX_BATCH, MAX_DEVICE, MAX_LENGTH, MAX_NODE, MAX_TIMEOUT_S, PLACEMENTS,  # noqa: F401 (re-exported)
                     _check_int, _check_keys, _check_list, _check_seconds, _check_versions, check_registration,
                     set_options)
from .clock import Clock, WallClock
from .journal import (SNAPSHOT, Journal, JournalDamage, _AllocRec, _CommitRec, _DeviceState, _DropRec, _FreeRec,
                      _NodeRec, _Snapshot, frame_record)
from .messages import KEY_BYTES, MAX_REQUEST_ID, BlockLoc, DeviceInfo, WriteLoc, to
from .rpc import RpcClient, RpcServer, TypedClient

ENTRY_DTYPE = np.dtype([
    ("key", "V16"), ("offset", "<u8"), ("checksum", "<u8"), ("lru", "<u8"),
    ("length", "<u4"), ("version", "<u4"), ("lease_until", "<u4"), ("lease_cap", "<u4"),
    ("put_deadline", "<u4"), ("node", "<u2"), ("device", "u1"), ("state", "u1"),
])
assert ENTRY_DTYPE.itemsize == 64, ENTRY_DTYPE.itemsize
FREE, PENDING, COMPLETE, DRAINING = 0, 1, 2, 3
_ZERO_ROW = np.zeros((), ENTRY_DTYPE)
_BLOCKLOC_FIELDS = ["key", "node", "device", "offset", "length", "checksum", "version"]  # BlockLoc's order

_REBASE_MS = 1 << 31                # move the time base once it is this far behind
_INITIAL_ROWS = 1024
MASTER_METHODS = ("register_node", "nodes", "lookup", "put_start", "put_end", "put_revoke", "remove", "stats")
# Served with keys, who may call what (auth.py): a KV Manager's calls are a node's; monitor is read-only.
MASTER_ROLES = {
    "register_node": {"node"},
    "nodes": {"worker", "node", "admin", "monitor"},
    "lookup": {"worker", "node"},
    "put_start": {"worker"}, "put_end": {"worker"}, "put_revoke": {"worker"},
    "remove": {"admin"},
    "stats": {"admin", "monitor"},
}

_SNAPSHOT_FORMAT = "hymcache-master-v1 " + str(ENTRY_DTYPE.descr)  # a layout change refuses old snapshots


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


# ---------------------------------------------------------------- the Master

class Master:
    """Block metadata, allocation and leases; in process, or served with ``serve_master``."""

    def __init__(self, clock: Clock, state_dir: str | None = None, *, lease_s: float = 10.0,
                 lease_max_s: float = 30.0, put_timeout_s: float = 30.0, high_watermark: float = 0.90,
                 low_watermark: float = 0.85, placement: str = "round_robin", snapshot_every: int = 100_000,
                 log: Callable[[str], None] | None = None, recover_damaged: bool = False):
        set_options(self, lease_s, lease_max_s, put_timeout_s, high_watermark, low_watermark, placement,
                    snapshot_every)
        self.clock, self.log = clock, log or (lambda msg: None)
        self._lease_ms = math.ceil(self.lease_s * 1000)
        # Read leases are MACs under node secrets derived from this (auth.py). Random: this process's alone;
        # a served Master with keys takes the key directory's (auth.load_lease_secret), which outlives it.
        self.lease_secret = os.urandom(auth.SECRET_BYTES)
        self._node_keys: dict[int, str] = {}  # node -> the name of the key that registered it (with keys)
        self._lease_max_ms = math.ceil(self.lease_max_s * 1000)
        self._put_timeout_ms = math.ceil(self.put_timeout_s * 1000)
        self._lock = threading.RLock()  # the Manager may call an in-process Master from several threads
        self._time_base = clock.now()

        self._table = np.zeros(_INITIAL_ROWS, ENTRY_DTYPE)
        self._rows_used = 0                   # rows [0, _rows_used) have been handed out at least once
        self._free_rows: list[int] = []       # rows given back, reused first
        self._index: dict[bytes, int] = {}    # key -> row, PENDING and COMPLETE blocks
        self._pending: OrderedDict[int, None] = OrderedDict()  # PENDING rows in put_start (= deadline) order
        self._draining: dict[tuple[int, int, int], int] = {}    # (node, device, offset) -> DRAINING row
        # (its free time when it began draining, row, extent), a min-heap: _expire frees them in that order
        # without looking at the others (a DRAINING row's lease_until never changes but for _rebase's shift of
        # every row, which keeps the order); an entry whose extent left _draining meanwhile is skipped
        self._drain_heap: list[tuple[int, int, tuple[int, int, int]]] = []
        self._nodes: dict[int, dict] = {}     # node -> {"endpoint", "devices": {index: _Device}, "next_device"}
        self._next_node = 0                   # round-robin cursor
        self._lru_next = 1
        self._version_next = 1
        self.counters = dict.fromkeys((
            "lookup_requests", "lookup_keys", "lookup_hits", "put_requests", "put_blocks", "registered_blocks",
            "revoked_blocks", "removed_blocks", "evictions", "stale_blocks", "put_no_space"), 0)

        self.state_dir = None if state_dir is None else str(state_dir)
        self._journal: Journal | None = None
        self._replaying = False
        if state_dir is not None:
            self._journal = Journal(self.state_dir, self.snapshot_every, self.log)
            try:
                self._recover(recover_damaged)
            except BaseException:
                self._journal.close()
                raise

    # ------------------------------------------------------------ time

    def _now_ms(self) -> int:
        elapsed = self.clock.now() - self._time_base
        if not math.isfinite(elapsed):
            raise ChmError(errno.EINVAL, f"clock time {self.clock.now()!r} must be a finite number of seconds")
        now = int(elapsed * 1000)
        if now >= _REBASE_MS:
            now = self._rebase(now)
        return max(now, 0)

    def _rebase(self, now_ms: int) -> int:
        """Move the time base to now so u4 deadlines keep fitting; times already past become 0."""
        self._time_base += now_ms / 1000
        for column in ("lease_until", "lease_cap", "put_deadline"):
            col = self._table[column]
            if now_ms > 0xFFFFFFFF:  # past every u4 time (and past int64 arithmetic at >= 2^63)
                col[:] = 0
            else:
                col[:] = np.where(col > now_ms, col.astype(np.int64) - now_ms, 0)
        for dev in self._all_devices():
            dev.evict_retry_ms = 0
        return 0

    # ------------------------------------------------------------ rows

    def _new_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        if self._rows_used == len(self._table):
            grown = np.zeros(2 * len(self._table), ENTRY_DTYPE)
            grown[:self._rows_used] = self._table
            self._table = grown
        self._rows_used += 1
        return self._rows_used - 1

    def _release_row(self, row: int) -> None:
        self._table[row] = _ZERO_ROW
        self._free_rows.append(row)

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

    # ------------------------------------------------------------ nodes

    def register_node(self, node: int, endpoint: str, devices: list, *, caller: auth.Identity | None = None) -> None:
        """A KV Manager announces its node. A device whose epoch or capacity changed loses its blocks. ``caller``
        (served with keys): the node key calling; once a key registered a node, only that key may register it
        again. Served, the answer is the node's lease secret (``node_secret``)."""
        node, devices = check_registration(node, endpoint, devices)
        self._check_node_key(node, caller)
        with self._lock:
            now = self._now_ms()
            self._journal_ready("register_node")
            if self._journal is not None:  # durable before it is applied: a failure changes nothing
                self._log(_NodeRec(node, endpoint, devices))
                try:
                    self._journal.flush(durable=True)
                except ChmError as exc:
                    self._journal.discard(1)
                    raise ChmError(exc.errno, f"register_node {node}: not registered: {exc.message}") from None
            self._apply_node(node, endpoint, devices, now)
            self._journal_flush(durable=True)

    def _check_node_key(self, node: int, caller: auth.Identity | None) -> None:
        """A node's endpoint, devices and epochs change only through its own key (EACCES)."""
        if caller is None:
            return  # in process, or served without keys (loopback only)
        if caller.node is not None and caller.node != node:
            raise ChmError(errno.EACCES, f"register_node: key {caller.name!r} is node {caller.node}'s; it may not "
                                         f"register node {node}")
        with self._lock:
            owner = self._node_keys.setdefault(node, caller.name)
        if owner != caller.name:
            raise ChmError(errno.EACCES, f"register_node: node {node} is registered by key {owner!r}; key "
                                         f"{caller.name!r} may not change it (endpoint, devices, epochs)")

    def node_secret(self, node: int) -> bytes:
        """The secret node ``node``'s Manager checks read leases with."""
        return auth.node_secret(self.lease_secret, _check_int(node, "node", 0, MAX_NODE))

    def _apply_node(self, node: int, endpoint: str, devices: list[DeviceInfo], now_ms: int) -> None:
        entry = self._nodes.setdefault(node, {"endpoint": endpoint, "devices": {}, "next_device": 0})
        entry["endpoint"] = endpoint
        old, new = entry["devices"], {d.device: d for d in devices}
        stale = {i for i, dev in old.items()
                 if i not in new or (dev.info.epoch, dev.capacity) != (new[i].epoch, new[i].capacity_bytes)}
        if stale:
            self._forget_devices(node, stale)
        entry["devices"] = {i: (old[i] if i in old and i not in stale else _Device(node, info))
                            for i, info in sorted(new.items())}
        for i, dev in entry["devices"].items():
            dev.info = new[i]  # node_path may change

    def _forget_devices(self, node: int, devices: set[int]) -> None:
        """Every row on these devices goes: their media changed (new epoch) or they left the node."""
        t = self._table[:self._rows_used]
        rows = np.flatnonzero((t["state"] != FREE) & (t["node"] == node) & np.isin(t["device"], list(devices)))
        for row in rows.tolist():
            key = self._table["key"][row].tobytes()
            if self._index.get(key) == row:
                del self._index[key]
                self.counters["stale_blocks"] += 1
            self._pending.pop(row, None)
            self._release_row(row)
        for k in [k for k in self._draining if k[0] == node and k[1] in devices]:
            del self._draining[k]

    def nodes(self) -> dict:
        with self._lock:
            return {node: {"endpoint": e["endpoint"], "devices": [d.info for d in e["devices"].values()]}
                    for node, e in sorted(self._nodes.items())}

    # ------------------------------------------------------------ lookup

    def lookup(self, keys: list, request_id: str | None = None) -> list[BlockLoc]:
        """The longest stored contiguous prefix of ``keys``; each returned block gets a read lease, and with
        ``request_id`` its token (``BlockLoc.lease``): what the block's Manager asks for before it sends the
        bytes to that request."""
        keys = _check_keys(keys)
        if request_id is not None and (not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_REQUEST_ID):
            raise ChmError(errno.EINVAL, f"request_id {request_id!r} must be None or a str of 1 to {MAX_REQUEST_ID} "
                                         "characters")
        with self._lock:
            now = self._now_ms()
            self._expire(now)
            self.counters["lookup_requests"] += 1
            self.counters["lookup_keys"] += len(keys)
            rows = []
            get = self._index.get
            for key in keys:
                row = get(key)
                if row is None:
                    break
                rows.append(row)
            if not rows:
                self._journal_flush(durable=False)
                return []
            rows_arr = np.array(rows, dtype=np.intp)
            sub = self._table[rows_arr]  # a copy: updated, then written back in one go
            not_complete = np.flatnonzero(sub["state"] != COMPLETE)
            if not_complete.size:
                rows_arr, sub = rows_arr[:not_complete[0]], sub[:not_complete[0]]
            n = len(rows_arr)
            if n:
                # a lease that has ended starts a new cap; renewals never pass the cap
                cap = np.where(sub["lease_until"] > now, sub["lease_cap"], now + self._lease_max_ms)
                sub["lease_cap"] = cap
                sub["lease_until"] = np.maximum(sub["lease_until"], np.minimum(now + self._lease_ms, cap))
                sub["lru"] = np.arange(self._lru_next, self._lru_next + n, dtype=np.uint64)
                self._lru_next += n
                self._table[rows_arr] = sub
            self.counters["lookup_hits"] += n
            self._journal_flush(durable=False)
            locs = list(itertools.starmap(BlockLoc, sub[_BLOCKLOC_FIELDS].tolist()))
            return locs if request_id is None else self._leased(locs, sub["lease_until"].tolist(), now, request_id)

    def _leased(self, locs: list[BlockLoc], until_ms: list[int], now_ms: int, request_id: str) -> list[BlockLoc]:
        """``locs`` with their lease tokens for ``request_id``, each ending with the block's lease (in wall time:
        the Managers' processes check it)."""
        wall, secrets, out = auth.now_ms(), {}, []
        for loc, until in zip(locs, until_ms):
            secret = secrets.get(loc.node)
            if secret is None:
                secret = secrets[loc.node] = auth.node_secret(self.lease_secret, loc.node)
            token = auth.lease_token(secret, request_id, loc.key, loc.version, loc.node, wall + int(until) - now_ms)
            out.append(msgspec.structs.replace(loc, lease=token))
        return out

    # ------------------------------------------------------------ puts

    def put_start(self, request_id: str, keys: list, sizes: list) -> list[WriteLoc | None]:
        """Where to write each block: one node (placement) and one device (round robin) for the request.
        None for a key already stored or in flight. ENOSPC (nothing allocated) if the device cannot hold
        the request even after evicting every evictable block."""
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
            raise ChmError(errno.EINVAL, f"request_id {request_id!r} must be a string of 1..256 characters")
        keys = _check_keys(keys)
        sizes = _check_list(sizes, "sizes")
        if len(sizes) != len(keys):
            raise ChmError(errno.EINVAL, f"sizes has {len(sizes)} items for {len(keys)} keys")
        sizes = [_check_int(s, f"sizes[{i}]", 1, MAX_LENGTH) for i, s in enumerate(sizes)]
        with self._lock:
            now = self._now_ms()
            self._journal_ready(f"put_start of request {request_id}")
            self._expire(now)
            self.counters["put_requests"] += 1
            todo, seen = [], set()
            for i, key in enumerate(keys):
                if key not in self._index and key not in seen:
                    todo.append(i)
                    seen.add(key)
            result: list[WriteLoc | None] = [None] * len(keys)
            if not todo:
                self._journal_flush(durable=False)
                return result
            node = self._place()
            entry = self._nodes[node]
            dev_ids = list(entry["devices"])
            dev = entry["devices"][dev_ids[entry["next_device"] % len(dev_ids)]]
            entry["next_device"] += 1
            device = dev.info.device
            need = sum(sizes[i] for i in todo)
            if need > dev.capacity:
                raise ChmError(errno.ENOSPC, f"request {request_id}: {need} bytes exceed device {device} of node "
                                             f"{node} ({dev.capacity} bytes)")
            deadline = now + self._put_timeout_ms
            placed: list[bytes] = []
            victims = None  # evictable rows, least recently used first: found once, when first needed
            for i in todo:
                key, size = keys[i], sizes[i]
                offset = dev.allocate(size)
                while offset is None:
                    if victims is None:
                        victims = iter(self._evictable(dev, now).tolist())
                    row = next(victims, None)
                    if row is None:
                        break
                    self._drop(self._table["key"][row].tobytes(), now)
                    self.counters["evictions"] += 1
                    offset = dev.allocate(size)
                if offset is None:  # all or nothing: give back what this request took
                    for k in placed:
                        self._drop(k, now)
                    self.counters["put_no_space"] += 1
                    self._journal_flush(durable=False)
                    sp = dev.space()
                    raise ChmError(errno.ENOSPC, f"request {request_id}: no room for {size} bytes on device {device} "
                                                 f"of node {node}: {sp['free_bytes']} bytes free, largest extent "
                                                 f"{sp['largest_free_extent']}, the rest leased or in flight")
                version = self._version_next
                self._version_next = (self._version_next + 1) & 0xFFFFFFFF or 1
                self._add_pending(key, node, device, offset, size, version, deadline)
                self._log(_AllocRec(key, node, device, offset, size, version))
                placed.append(key)
                result[i] = WriteLoc(key, node, device, offset, size, version)
            self._evict_over_watermark(dev, now)
            try:
                self._journal_write(durable=False)
            except ChmError as exc:
                for k in placed:  # undone by records of their own: memory stays what the journal replays to
                    self._drop(k, now)
                raise ChmError(exc.errno, f"put_start of request {request_id}: nothing allocated: "
                                          f"{exc.message}") from None
            self.counters["put_blocks"] += len(placed)
            return result

    def _add_pending(self, key: bytes, node: int, device: int, offset: int, length: int, version: int,
                     deadline_ms: int) -> None:
        row = self._new_row()
        self._table[row] = (np.void(key), offset, 0, 0, length, version, 0, 0, deadline_ms, node, device, PENDING)
        self._index[key] = row
        self._pending[row] = None

    def _place(self) -> int:
        nodes = sorted(n for n, e in self._nodes.items() if e["devices"])
        if not nodes:
            raise ChmError(errno.ENODEV, "no storage node is registered: start a KV Manager first")
        if self.placement == "load_aware":
            return min(nodes, key=lambda n: (sum(d.used for d in self._nodes[n]["devices"].values()), n))
        node = nodes[self._next_node % len(nodes)]
        self._next_node += 1
        return node

    def put_end(self, keys: list, checksums: list, versions: list | None = None) -> int:
        """Register written blocks (visible to lookup from now on); durable when it returns.
        Keys not in flight (revoked, never started, already registered) are skipped: the count says.
        ``versions`` (each key's ``WriteLoc.version``) ties the call to its own put_starts: a key whose
        put timed out and was started again by another request has a newer version and is skipped."""
        keys = _check_keys(keys)
        checksums = _check_list(checksums, "checksums")
        if len(checksums) != len(keys):
            raise ChmError(errno.EINVAL, f"checksums has {len(checksums)} items for {len(keys)} keys")
        checksums = [_check_int(c, f"checksums[{i}]", 0, (1 << 64) - 1) for i, c in enumerate(checksums)]
        versions = _check_versions(versions, len(keys))
        with self._lock:
            now = self._now_ms()
            self._journal_ready("put_end")
            self._expire(now)
            committed = []
            for key, checksum, version in zip(keys, checksums, versions):
                if self._started_as(key, version) and self._commit(key, checksum):
                    self._log(_CommitRec(key, checksum))
                    committed.append(key)
            try:
                self._journal_write(durable=True)  # the ack goes out only once its records are durable
            except ChmError as exc:
                for k in committed:  # not leased yet: freed at once, by records of their own
                    self._drop(k, now)
                self.counters["revoked_blocks"] += len(committed)
                raise ChmError(exc.errno, f"put_end: {len(committed)} blocks not registered (their put_starts "
                                          f"are revoked): {exc.message}") from None
            self.counters["registered_blocks"] += len(committed)
            return len(committed)

    def _started_as(self, key: bytes, version: int | None) -> bool:
        """Is ``key`` in flight from the put_start that returned ``version`` (None: from any)?"""
        if version is None:
            return True
        row = self._index.get(key)
        return row is not None and int(self._table["version"][row]) == version

    def _commit(self, key: bytes, checksum: int) -> bool:
        row = self._index.get(key)
        if row is None or self._table["state"][row] != PENDING:
            return False
        t = self._table
        t["state"][row], t["checksum"][row], t["put_deadline"][row] = COMPLETE, checksum, 0
        t["lru"][row] = self._lru_next
        self._lru_next += 1
        del self._pending[row]
        self._device(int(t["node"][row]), int(t["device"][row])).evict_retry_ms = 0
        return True

    def put_revoke(self, keys: list, versions: list | None = None) -> int:
        """Give back put_starts that will not be finished; registered blocks are not touched.
        ``versions`` as for ``put_end``: another request's newer put_start of a key is not revoked."""
        keys = _check_keys(keys)
        versions = _check_versions(versions, len(keys))
        with self._lock:
            now = self._now_ms()
            self._journal_ready("put_revoke")
            self._expire(now)
            revoked = 0
            for key, version in zip(keys, versions):
                row = self._index.get(key)
                if row is not None and self._table["state"][row] == PENDING and self._started_as(key, version):
                    self._drop(key, now)
                    revoked += 1
            self.counters["revoked_blocks"] += revoked
            self._journal_write_after_change("put_revoke", revoked)
            return revoked

    def remove(self, keys: list) -> int:
        """Forget blocks (stored or in flight); a leased block's space is freed when its lease ends."""
        keys = _check_keys(keys)
        with self._lock:
            now = self._now_ms()
            self._journal_ready("remove")
            self._expire(now)
            removed = 0
            for key in keys:
                if key in self._index:
                    self._drop(key, now)
                    removed += 1
            self.counters["removed_blocks"] += removed
            self._journal_write_after_change("remove", removed)
            return removed

    # ------------------------------------------------------------ expiry and eviction

    def expire(self) -> None:
        """Revoke put_starts past their deadline, free removed blocks whose lease ended, evict past the
        high watermark."""
        with self._lock:
            self._expire(self._now_ms())
            self._journal_flush(durable=False)

    def tick(self) -> None:
        """The server's tick: expire, and make the journal durable. Its I/O errors are logged (once, by the
        journal) and retried at the next tick, never raised: a full disk must not end the server."""
        with self._lock:
            self._expire(self._now_ms())
            self._journal_flush(durable=True)

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

    # ------------------------------------------------------------ stats

    def metadata_bytes(self) -> dict:
        """Bytes the metadata holds: the table, the index dict's own table, its key and row objects."""
        n = len(self._index)
        key_object = sys.getsizeof(b"\0" * KEY_BYTES)
        # row numbers above 256 are separate int objects (CPython caches -5..256)
        row_objects = sys.getsizeof(1 << 20) * max(0, n - 257)
        index = sys.getsizeof(self._index) + n * key_object + row_objects
        free_rows = sys.getsizeof(self._free_rows) + sys.getsizeof(1 << 20) * len(self._free_rows)
        table = self._table.nbytes
        total = table + index + free_rows
        return {"table_bytes": table, "index_bytes": index, "free_rows_bytes": free_rows, "total_bytes": total,
                "entries": n, "bytes_per_entry": total / n if n else 0.0}

    def stats(self) -> dict:
        with self._lock:
            self._expire(self._now_ms())
            meta = self.metadata_bytes()
            devices = [dev.space() for dev in self._all_devices()]
            self._journal_flush(durable=False)
            return {**self.counters, "entries": meta["entries"], "bytes_per_entry": meta["bytes_per_entry"],
                    "metadata_bytes": meta["total_bytes"], "pending_blocks": len(self._pending),
                    "blocks": len(self._index) - len(self._pending),  # complete: what lookups can find
                    "used_bytes": sum(d["used_bytes"] for d in devices),
                    "capacity_bytes": sum(d["capacity_bytes"] for d in devices), "devices": devices,
                    # failed journal writes and snapshots; records waiting for the disk (changes refused meanwhile)
                    "journal_errors": self._journal.errors if self._journal else 0,
                    "journal_unwritten_records": self._journal.unwritten if self._journal else 0}

    # ------------------------------------------------------------ journal and snapshot (the files: journal.py)

    def _log(self, rec) -> None:
        if self._journal is not None and not self._replaying:
            self._journal.append(frame_record(rec))

    def _journal_ready(self, call: str) -> None:
        """Before a change: what earlier calls queued is written first, or ``call`` is refused (nothing changed)."""
        if self._journal is not None:
            try:
                self._journal.flush(durable=False)
            except ChmError as exc:
                raise ChmError(exc.errno, f"{call} refused: {exc.message}") from None

    def _journal_write(self, durable: bool) -> None:
        """Write (``durable``: and fsync) what this call queued; a failure raises (``Journal.flush``)."""
        if self._journal is not None:
            self._journal.flush(durable)
            self._maybe_snapshot()

    def _journal_flush(self, durable: bool) -> None:
        """``_journal_write`` for calls with no change of their own to acknowledge (lookups, ticks): on failure the
        records stay queued for the next write (the journal logs it) and the call goes on."""
        try:
            self._journal_write(durable)
        except ChmError:
            pass

    def _journal_write_after_change(self, call: str, count: int) -> None:
        """put_revoke, remove: the change stands in memory (its records wait in the queue), the caller hears."""
        try:
            self._journal_write(durable=False)
        except ChmError as exc:
            raise ChmError(exc.errno, f"{call}: {count} blocks gone here but not yet journaled (a restart before "
                                      f"the journal is written again brings them back): {exc.message}") from None

    def _maybe_snapshot(self) -> None:
        if self._journal.snapshot_due():
            try:
                self._snapshot()
            except ChmError as exc:
                self.log(f"master: {exc.message}")  # the journal goes on; retried snapshot_every records later

    def _snapshot(self) -> None:
        """Write the whole state as the next generation's base (``Journal.write_snapshot``)."""
        gen = self._journal.next_gen()
        t = self._table[:self._rows_used]
        snap = _Snapshot(
            format=_SNAPSHOT_FORMAT, journal_gen=gen, lru_next=self._lru_next, version_next=self._version_next,
            nodes=[_NodeRec(n, e["endpoint"], [d.info for d in e["devices"].values()])
                   for n, e in sorted(self._nodes.items())],
            devices=[_DeviceState(d.node, d.info.device, d.head, d.used, list(d.freed.items()))
                     for d in self._all_devices()],
            rows=t[t["state"] != FREE].tobytes())
        self._journal.write_snapshot(msgspec.msgpack.encode(snap), gen)

    def _recover(self, recover_damaged: bool) -> None:
        """Load the state dir (journal.py says what is damage), revoke what does not survive a restart, and make
        the result the new base."""
        j = self._journal
        loaded = j.load(_SNAPSHOT_FORMAT, recover_damaged)
        snap_path = os.path.join(self.state_dir, SNAPSHOT)
        self._replaying = True
        replayed = 0
        try:
            if loaded.snapshot is not None:
                try:
                    self._load_snapshot(loaded.snapshot, snap_path)
                except ChmError as exc:
                    raise JournalDamage(snap_path, 0, f"it does not load ({exc.message})") from None
            for offset, rec in loaded.scan.records:
                try:
                    self._replay(rec)
                except Exception as exc:  # a valid frame whose change cannot be made: damage too
                    reason = f"the record does not replay ({exc})"
                    if not recover_damaged:
                        raise JournalDamage(loaded.path, offset, reason) from None
                    loaded.damage.append((loaded.path, offset, reason))
                    loaded.aside.append(loaded.path)
                    loaded.lost_records[:0] = [r for _, r in loaded.scan.records[replayed:]]
                    break
                replayed += 1
        finally:
            self._replaying = False
        if loaded.scan.torn:
            self.log(f"master: {loaded.path}: dropped a torn last record, never acknowledged: {loaded.scan.torn}")
        try:
            j.open(loaded)
        except OSError as exc:
            raise ChmError(exc.errno, f"state dir {self.state_dir}: cannot open {loaded.path}: {exc.strerror}") from None
        # leases and put_starts in flight do not survive a restart (records: the journal may go on from here)
        now = self._now_ms()
        for row in list(self._pending):
            self._drop(self._table["key"][row].tobytes(), now)
        for extent, row in list(self._draining.items()):
            del self._draining[extent]
            self._log(_FreeRec(*extent))
            self._free_extent(row)
            self._release_row(row)
        self._drain_heap.clear()
        for column in ("lease_until", "lease_cap", "put_deadline"):
            self._table[column] = 0
        lost = self._lost_report(loaded, replayed) if loaded.aside else []
        aside = j.keep_aside(loaded, lost)
        try:
            self._snapshot()  # the recovered state is the new base; the replayed journal goes
        except ChmError as exc:
            if j.fd < 0:  # nothing to go on with: the damaged files stay as they were
                j.undo_aside(aside)
                raise ChmError(exc.errno, f"state dir {self.state_dir}: the recovered state cannot be written, "
                                          f"nothing was moved or deleted: {exc.message}") from None
            self.log(f"master: {exc.message}")
            self._journal_flush(durable=True)  # the revocations above, appended to the journal replayed
        j.finish(loaded)
        self.log(f"master: recovered {len(self._index)} blocks from {self.state_dir} (snapshot generation "
                 f"{max(loaded.gen, 0)}, {replayed} journal records)")
        if aside:
            for line in lost[:12]:
                self.log(f"master: recovery: {line}")
            self.log(f"master: recovery: the damaged files are kept in {aside}; report.txt there lists what was lost")

    def _lost_report(self, loaded, replayed: int) -> list[str]:
        """What ``recover_damaged`` lost: the damage, and every block registered past it that is not back."""
        lines = [f"damaged: {path} at offset {offset}: {reason}" for path, offset, reason in loaded.damage]
        if loaded.lost_snapshot:
            lines.append("the snapshot is unreadable: every block it held is lost (how many cannot be read), and "
                         "no journal could be replayed without it")
        committed = {rec.key for rec in loaded.lost_records if isinstance(rec, _CommitRec)}
        lost = sorted(k for k in committed
                      if k not in self._index or self._table["state"][self._index[k]] != COMPLETE)
        lines.append(f"recovered: {len(self._index)} blocks ({replayed} journal records replayed); not replayed: "
                     f"{len(loaded.lost_records)} readable records past the damage")
        lines.append(f"lost: {len(lost)} registered blocks (their put_end is in the records not replayed)"
                     + (":" if lost else ""))
        lines += [f"lost block {k.hex()}" for k in lost]
        return lines

    def _load_snapshot(self, snap: _Snapshot, path: str) -> int:
        now = self._now_ms()
        for rec in snap.nodes:
            self._apply_node(rec.node, rec.endpoint, rec.devices, now)
        for ds in snap.devices:
            dev = self._device(ds.node, ds.device)
            dev.head, dev.used = ds.head, ds.used
            for start, length in ds.freed:
                dev.freed[start] = length
                dev.ends[start + length] = start
        rows = np.frombuffer(snap.rows, ENTRY_DTYPE)
        size = _INITIAL_ROWS
        while size < len(rows):
            size *= 2
        self._table = np.zeros(size, ENTRY_DTYPE)
        self._table[:len(rows)] = rows
        self._rows_used = len(rows)
        for row in range(len(rows)):
            state = int(rows["state"][row])
            if state == DRAINING:
                self._add_draining(row)
            else:
                self._index[rows["key"][row].tobytes()] = row
                if state == PENDING:
                    self._pending[row] = None
        for column in ("lease_until", "lease_cap", "put_deadline"):  # times of the previous process
            self._table[column] = 0
        self._lru_next, self._version_next = snap.lru_next, snap.version_next
        return snap.journal_gen

    def _replay(self, rec) -> None:
        """Apply one journal record through the same code as the live call."""
        if isinstance(rec, _NodeRec):
            self._apply_node(rec.node, rec.endpoint, rec.devices, 0)
        elif isinstance(rec, _AllocRec):
            dev = self._device(rec.node, rec.device)
            offset = dev.allocate(rec.length)
            if offset != rec.offset:
                if offset is not None:
                    dev.free(offset, rec.length)  # recover_damaged goes on from the state before this record
                raise ChmError(errno.EIO, f"journal replay: block {rec.key.hex()} was at offset {rec.offset} of "
                                          f"node {rec.node} device {rec.device}, replay allocates {offset}")
            self._add_pending(rec.key, rec.node, rec.device, rec.offset, rec.length, rec.version, 0)
            self._version_next = (rec.version + 1) & 0xFFFFFFFF or 1
        elif isinstance(rec, _CommitRec):
            self._commit(rec.key, rec.checksum)
        elif isinstance(rec, _DropRec):
            if rec.key in self._index:
                self._drop(rec.key, 0, leased=not rec.freed)  # leased: DRAINING until its _FreeRec
        elif isinstance(rec, _FreeRec):
            row = self._draining.pop((rec.node, rec.device, rec.offset), None)
            if row is not None:
                self._free_extent(row)
                self._release_row(row)

    def close(self) -> None:
        """Snapshot (if persistent) and let go of the state dir. A write that fails is logged: everything
        acknowledged is in the journal already."""
        with self._lock:
            j = self._journal
            if j is None:
                return
            if j.fd >= 0:
                for step in (lambda: j.flush(durable=True), self._snapshot):
                    try:
                        step()
                    except ChmError as exc:
                        self.log(f"master: closing: {exc.message}")
            j.close()
            self._journal = None

    def __enter__(self) -> "Master":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- measurement

def measure_bytes_per_entry(entries: int = 1 << 16, block_bytes: int = 16 << 20) -> dict:
    """Fill an in-memory Master with ``entries`` registered blocks and measure its memory per entry with
    tracemalloc (Python objects and numpy buffers), beside ``metadata_bytes()``'s count."""
    from .clock import ManualClock
    entries = _check_int(entries, "entries", 1, 1 << 24)
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        keys = [i.to_bytes(KEY_BYTES, "little") for i in range(entries)]
        base = tracemalloc.get_traced_memory()[0]
        master = Master(ManualClock(), put_timeout_s=MAX_TIMEOUT_S, high_watermark=1.0, low_watermark=1.0)
        master.register_node(0, "", [DeviceInfo(0, "", entries * block_bytes, 1)])
        for start in range(0, entries, 32):
            batch = keys[start:start + 32]
            master.put_start("measure", batch, [block_bytes] * len(batch))
            master.put_end(batch, [0] * len(batch))
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    counted = master.metadata_bytes()
    # the key objects existed before ``base`` (the caller's keys): add them, the index holds them
    traced += entries * sys.getsizeof(keys[0])
    return {"entries": entries, "entry_bytes": ENTRY_DTYPE.itemsize, "traced_bytes_per_entry": traced / entries,
            "counted_bytes_per_entry": counted["bytes_per_entry"], **counted}


# ---------------------------------------------------------------- serving

def serve_master(master: Master, endpoint: str, curve_keys: str | None = None,
                 log: Callable[[str], None] | None = None, *, insecure: bool = False) -> RpcServer:
    """An RpcServer for ``master`` bound to ``endpoint`` (run ``serve_forever``); its tick expires and syncs.
    With ``curve_keys`` (a key directory) only its authorized keys get in, each call within MASTER_ROLES, and
    leases are signed with the directory's lease secret; without, ``endpoint`` must be loopback unless
    ``insecure``."""
    if curve_keys:
        master.lease_secret = auth.load_lease_secret(curve_keys)
    return RpcServer(_ServedMaster(master), MASTER_METHODS, endpoint, tick=master.tick, tick_s=0.05,
                     curve_keys=curve_keys, log=log, roles=MASTER_ROLES, callers=("register_node",), insecure=insecure)


class _ServedMaster:
    """What serve_master exposes: the Master; register_node answers the node's lease secret (to a node key,
    over CurveZMQ, with keys)."""

    def __init__(self, master: Master):
        self.master = master

    def __getattr__(self, name):
        return getattr(self.master, name)

    def register_node(self, node, endpoint, devices, *, caller=None) -> bytes:
        self.master.register_node(node, endpoint, devices, caller=caller)
        return self.master.node_secret(node)


class MasterClient(TypedClient):
    """The Master's methods over ZeroMQ, with typed results. One thread at a time (like RpcClient)."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, curve_keys: str | None = None):
        self.rpc = RpcClient(endpoint, timeout_s, curve_keys=curve_keys)
        self.endpoint = endpoint

    def register_node(self, node: int, endpoint: str, devices: list[DeviceInfo]) -> bytes:
        """Registers the node; its lease secret."""
        return self.rpc.call("register_node", node, endpoint, list(devices))

    def nodes(self) -> dict:
        return {int(n): {"endpoint": e["endpoint"], "devices": to(list[DeviceInfo], e["devices"])}
                for n, e in self.rpc.call("nodes").items()}

    def lookup(self, keys: list[bytes], timeout_s: float | None = None,
               request_id: str | None = None) -> list[BlockLoc]:
        """``request_id``: the request the leases are for (BlockLoc.lease)."""
        args = (list(keys),) if request_id is None else (list(keys), request_id)
        return to(list[BlockLoc], self.rpc.call("lookup", *args, timeout_s=timeout_s))

    def put_start(self, request_id: str, keys: list[bytes], sizes: list[int]) -> list[WriteLoc | None]:
        return to(list[Union[WriteLoc, None]], self.rpc.call("put_start", request_id, list(keys), list(sizes)))

    def put_end(self, keys: list[bytes], checksums: list[int], versions: list[int] | None = None) -> int:
        return self.rpc.call("put_end", list(keys), list(checksums), None if versions is None else list(versions))

    def put_revoke(self, keys: list[bytes], versions: list[int] | None = None) -> int:
        return self.rpc.call("put_revoke", list(keys), None if versions is None else list(versions))

    def remove(self, keys: list[bytes]) -> int:
        return self.rpc.call("remove", list(keys))

    def stats(self) -> dict:
        return self.rpc.call("stats")



def run_master(endpoint: str, state_dir: str | None, *, placement: str = "round_robin", lease_s: float = 10.0,
               lease_max_s: float = 30.0, put_timeout_s: float = 30.0, high_watermark: float = 0.90,
               low_watermark: float = 0.85, snapshot_every: int = 100_000, curve_keys: str | None = None,
               log: Callable[[str], None] | None = None, ready: Callable[[str], None] | None = None) -> int:
    """Serve a Master on ``endpoint`` until SIGTERM/SIGINT; ``ready(bound endpoint)`` once it listens.
    Returns 0 after a clean stop (journal synced, snapshot written)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    master = Master(WallClock(), state_dir, lease_s=lease_s, lease_max_s=lease_max_s, put_timeout_s=put_timeout_s,
                    high_watermark=high_watermark, low_watermark=low_watermark, placement=placement,
                    snapshot_every=snapshot_every, log=log)
    try:
        server = serve_master(master, endpoint, curve_keys=curve_keys, log=log)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: server.stop())
        (ready or (lambda ep: print(f"master: serving on {ep}", flush=True)))(server.endpoint)
        server.serve_forever()
    finally:
        master.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m host_runtime.hymcache.master``: a Master on its own (``chm hymcache master`` is the CLI)."""
    p = argparse.ArgumentParser(prog="python -m host_runtime.hymcache.master")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:0")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--placement", choices=PLACEMENTS, default="round_robin")
    p.add_argument("--snapshot-every", type=int, default=100_000)
    p.add_argument("--curve-keys", default=None)
    args = p.parse_args(argv)
    try:
        return run_master(args.endpoint, args.state_dir, placement=args.placement,
                          snapshot_every=args.snapshot_every, curve_keys=args.curve_keys)
    except ChmError as exc:
        print(f"hymcache master: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
