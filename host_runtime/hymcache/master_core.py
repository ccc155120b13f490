"""The HyMCache Master's coordinator, ``Master``: the calls (register_node, lookup, put_start, put_end, put_revoke,
remove, stats), each checked, locked, journaled and acknowledged as its pieces say (master.py lists them)."""

from __future__ import annotations

import errno
import math
import os
import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from driver.errors import ChmError

from . import auth
from .allocator import MasterAllocator, _Device
from .checks import (MAX_BATCH, MAX_DEVICE, MAX_LENGTH, MAX_NODE, MAX_TIMEOUT_S, PLACEMENTS,  # noqa: F401
                     _check_keys, _check_per_key, _check_request_id, _check_versions, check,
                     check_registration, set_options)
from .clock import Clock
from .journal import Journal, _AllocRec, _CommitRec, _NodeRec
from .master_recovery import MasterRecovery
from .master_table import (_INITIAL_ROWS, COMPLETE, DRAINING, ENTRY_DTYPE, FREE, PENDING,  # noqa: F401
                           MasterTable)
from .messages import DeviceInfo, WriteLoc


class Master(MasterTable, MasterAllocator, MasterRecovery):
    """Block metadata, allocation and leases; in process, or served (``start_master``)."""

    def __init__(self, clock: Clock, state_dir: str | None = None, *, lease_s: float = 10.0,
                 lease_max_s: float = 30.0, put_timeout_s: float = 30.0, high_watermark: float = 0.90,
                 low_watermark: float = 0.85, placement: str = "round_robin", snapshot_every: int = 100_000,
                 log: Callable[[str], None] | None = None, recover_damaged: bool = False):
        set_options(self, lease_s=lease_s, lease_max_s=lease_max_s, put_timeout_s=put_timeout_s,
                    high_watermark=high_watermark, low_watermark=low_watermark, placement=placement,
                    snapshot_every=snapshot_every)
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
        return auth.node_secret(self.lease_secret, check.int("node", node, 0, MAX_NODE))

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

    # ------------------------------------------------------------ puts

    def put_start(self, request_id: str, keys: list, sizes: list) -> list[WriteLoc | None]:
        """Where to write each block: one node (placement) and one device (round robin) for the request.
        None for a key already stored or in flight. ENOSPC (nothing allocated) if the device cannot hold
        the request even after evicting every evictable block."""
        request_id = _check_request_id(request_id)
        keys = _check_keys(keys)
        sizes = _check_per_key(sizes, "sizes", len(keys))
        sizes = [check.int(f"sizes[{i}]", s, 1, MAX_LENGTH) for i, s in enumerate(sizes)]
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

    def put_end(self, keys: list, checksums: list, versions: list | None = None) -> int:
        """Register written blocks (visible to lookup from now on); durable when it returns.
        Keys not in flight (revoked, never started, already registered) are skipped: the count says.
        ``versions`` (each key's ``WriteLoc.version``) ties the call to its own put_starts: a key whose
        put timed out and was started again by another request has a newer version and is skipped."""
        keys = _check_keys(keys)
        checksums = _check_per_key(checksums, "checksums", len(keys))
        checksums = [check.int(f"checksums[{i}]", c, 0, (1 << 64) - 1) for i, c in enumerate(checksums)]
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

    # ------------------------------------------------------------ stats

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

    # ------------------------------------------------------------ closing

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

