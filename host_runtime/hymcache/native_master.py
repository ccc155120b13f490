"""The replay's host-side index in C: ``NativeMaster``, the Master's methods replay calls, one node of one device.

``Master`` (master.py) stays the one definition of the decisions; ``native/`` (mt_*.c) makes the same
ones for the calls ``host_runtime/replay/driver.py`` makes -- ``register_node`` (one device), ``lookup``,
``put_start``, ``put_end``, ``put_revoke``, ``expire``/``tick`` on its clock, ``stats`` and ``counters``
-- plus ``remove``, and tests/host_runtime/hymcache/test_native_master.py runs both side by side and demands
the same answers, rows and allocator state (``master_table.h`` lists what is matched). Same signatures,
same validation (the Master's own checks, checks.py), same errors (errno and text), so the replay can take it in
Master's place: ``NativeMaster(clock, **master_options)``.

Not served (no RpcServer), no ``state_dir`` (no journal), one node of one device (a second registration
must repeat the first), no lease tokens (``lookup``'s ``request_id``), ``placement`` accepted and moot.
``stats()``'s ``metadata_bytes`` and ``bytes_per_entry`` count the native table's memory, not Python's.

Per call: the keys go to C as one buffer (``b"".join``), the answers come back in arrays; ``lookup_offsets``
and ``put_start_offsets`` skip building BlockLoc / WriteLoc objects.
"""

from __future__ import annotations

import errno
import functools
import math
from types import ModuleType
from typing import Callable

from driver.errors import ChmError
from driver.native import load_or_build

from . import native_master_build as _build
from .clock import Clock
from .checks import (MAX_LENGTH, _check_keys, _check_per_key, _check_request_id, _check_versions, check,
                     check_registration, set_options)
from .messages import BlockLoc, DeviceInfo, WriteLoc

_COUNTERS = ("lookup_requests", "lookup_keys", "lookup_hits", "put_requests", "put_blocks", "registered_blocks",
             "revoked_blocks", "removed_blocks", "evictions", "stale_blocks", "put_no_space")


def _plain_ints(values: list, lo: int, hi: int) -> bool:
    """All ``int`` (not bool, not numpy) in [lo, hi]: what Master's per-item ``check.int`` passes unchanged."""
    return not values or (set(map(type, values)) == {int} and lo <= min(values) and max(values) <= hi)


@functools.cache
def load_module(mutation: str | None = None) -> ModuleType:
    """The compiled module for the current sources (built first if missing); ``mutation``: a test variant."""
    return load_or_build(_build.module_name(mutation), lambda: _build.build(mutation), _build.LOCK)


class NativeMaster:
    """Master's replay subset in C, on ``clock`` (a ManualClock in replay). Keyword options as Master's."""

    def __init__(self, clock: Clock, state_dir: str | None = None, *, lease_s: float = 10.0,
                 lease_max_s: float = 30.0, put_timeout_s: float = 30.0, high_watermark: float = 0.90,
                 low_watermark: float = 0.85, placement: str = "round_robin", snapshot_every: int = 100_000,
                 log: Callable[[str], None] | None = None, recover_damaged: bool = False,
                 mutation: str | None = None):
        if state_dir is not None:
            raise ChmError(errno.EINVAL, "the native replay index keeps no state dir (state_dir must be None)")
        set_options(self, lease_s=lease_s, lease_max_s=lease_max_s, put_timeout_s=put_timeout_s,  # Master's checks
                    high_watermark=high_watermark, low_watermark=low_watermark, placement=placement,
                    snapshot_every=snapshot_every)
        self.clock, self.log = clock, log or (lambda msg: None)
        self.state_dir = None
        module = load_module(mutation)
        self._ffi, self._lib = ffi, lib = module.ffi, module.lib
        self.mutation = mutation
        table = lib.mt_new(math.ceil(self.lease_s * 1000), math.ceil(self.lease_max_s * 1000),
                           math.ceil(self.put_timeout_s * 1000), self.high_watermark, self.low_watermark,
                           float(clock.now()))
        if table == ffi.NULL:
            raise MemoryError("native replay index: out of memory")
        self._t = ffi.gc(table, lib.mt_free)
        self._node: int | None = None
        self._endpoint = ""
        self._info: DeviceInfo | None = None
        self._cap = 0
        self._grow(1024)
        self._counters = ffi.new("mt_counters *")
        self._space = ffi.new("mt_space *")
        self._detail = ffi.new("int64_t *")

    def _grow(self, n: int) -> None:
        """Answer arrays for ``n`` keys."""
        if n > self._cap:
            cap = max(n, 2 * self._cap)
            new = self._ffi.new
            self._offsets, self._lengths = new("uint64_t[]", cap), new("uint32_t[]", cap)
            self._checksums, self._versions = new("uint64_t[]", cap), new("uint32_t[]", cap)
            self._cap = cap

    def _keys(self, keys: list[bytes]):
        return self._ffi.from_buffer("mt_key[]", b"".join(keys))

    def _check(self, rc: int) -> int:
        if rc >= 0:
            return rc
        lib = self._lib
        if rc == -lib.MT_E_CLOCK:
            raise ChmError(errno.EINVAL, f"clock time {self.clock.now()!r} must be a finite number of seconds")
        if rc == -lib.MT_E_OVERFLOW:
            raise OverflowError("cannot convert float infinity to integer")
        if rc == -lib.MT_E_NOMEM:
            raise MemoryError("native replay index: out of memory (the table is unusable)")
        raise ChmError(errno.EIO, f"native replay index: unexpected status {rc}")

    # ------------------------------------------------------------ nodes

    def register_node(self, node: int, endpoint: str, devices: list, *, caller=None) -> None:
        """One node of one device; registering it again must repeat it (endpoint aside)."""
        node, devices = check_registration(node, endpoint, devices)  # Master's checks
        if len(devices) != 1:
            raise ChmError(errno.EINVAL, f"node {node}: the native replay index holds one device, got {len(devices)}")
        info = devices[0]
        if self._node is not None and (node, info.device, info.capacity_bytes, info.epoch) != \
                (self._node, self._info.device, self._info.capacity_bytes, self._info.epoch):
            raise ChmError(errno.EINVAL, f"the native replay index holds node {self._node} device {self._info.device} "
                                         "only: it takes no other node, device, capacity or epoch")
        rc = self._lib.mt_register(self._t, float(self.clock.now()), info.capacity_bytes)
        if rc != -self._lib.MT_E_ARG or self._node is None:
            self._check(rc)
        self._node, self._endpoint, self._info = node, endpoint, info

    def nodes(self) -> dict:
        if self._node is None:
            return {}
        return {self._node: {"endpoint": self._endpoint, "devices": [self._info]}}

    # ------------------------------------------------------------ lookup

    def lookup(self, keys: list, request_id: str | None = None) -> list[BlockLoc]:
        """Master.lookup (no lease tokens: ``request_id`` must be None)."""
        keys = _check_keys(keys)
        if request_id is not None:
            raise ChmError(errno.EINVAL, "the native replay index gives no lease tokens (request_id must be None)")
        n = self._lookup(keys)
        node, device, unpack = self._node, self._info.device if self._info else 0, self._ffi.unpack
        fields = zip(keys, unpack(self._offsets, n), unpack(self._lengths, n), unpack(self._checksums, n),
                     unpack(self._versions, n))
        return [BlockLoc(key, node, device, offset, length, checksum, version)
                for key, offset, length, checksum, version in fields]

    def lookup_offsets(self, keys: list) -> list[int]:
        """``[loc.offset for loc in lookup(keys)]``."""
        keys = _check_keys(keys)
        return self._ffi.unpack(self._offsets, self._lookup(keys))

    def _lookup(self, keys: list[bytes]) -> int:
        self._grow(len(keys))
        return self._check(self._lib.mt_lookup(self._t, float(self.clock.now()), self._keys(keys), len(keys),
                                               self._offsets, self._lengths, self._checksums, self._versions))

    # ------------------------------------------------------------ puts

    def put_start(self, request_id: str, keys: list, sizes: list) -> list[WriteLoc | None]:
        """Master.put_start."""
        keys, sizes = self._put_start(request_id, keys, sizes)
        n, unpack = len(keys), self._ffi.unpack
        node, device = self._node, self._info.device if self._info else 0
        return [WriteLoc(key, node, device, offset, size, version) if version else None for key, offset, size, version
                in zip(keys, unpack(self._offsets, n), sizes, unpack(self._versions, n))]

    def put_start_offsets(self, request_id: str, keys: list, sizes: list) -> list[int | None]:
        """``[loc and loc.offset for loc in put_start(...)]``."""
        keys, _ = self._put_start(request_id, keys, sizes)
        n, unpack = len(keys), self._ffi.unpack
        return [offset if version else None for offset, version in zip(unpack(self._offsets, n),
                                                                       unpack(self._versions, n))]

    def _put_start(self, request_id, keys, sizes) -> tuple[list[bytes], list[int]]:
        _check_request_id(request_id)
        keys = _check_keys(keys)
        sizes = _check_per_key(sizes, "sizes", len(keys))
        if not _plain_ints(sizes, 1, MAX_LENGTH):  # else Master's check, with its message
            sizes = [check.int(f"sizes[{i}]", s, 1, MAX_LENGTH) for i, s in enumerate(sizes)]
        n = len(keys)
        self._grow(n)
        lib = self._lib
        rc = lib.mt_put_start(self._t, float(self.clock.now()), self._keys(keys), self._ffi.new("uint32_t[]", sizes),
                              n, self._offsets, self._versions, self._detail)
        if rc == -lib.MT_E_NODEV:
            raise ChmError(errno.ENODEV, "no storage node is registered: start a KV Manager first")
        if rc == -lib.MT_E_TOO_BIG:
            raise ChmError(errno.ENOSPC, f"request {request_id}: {self._detail[0]} bytes exceed device "
                                         f"{self._info.device} of node {self._node} "
                                         f"({self._info.capacity_bytes} bytes)")
        if rc == -lib.MT_E_NO_ROOM:
            sp = self._device_space()
            raise ChmError(errno.ENOSPC, f"request {request_id}: no room for {self._detail[0]} bytes on device "
                                         f"{self._info.device} of node {self._node}: {sp['free_bytes']} bytes free, "
                                         f"largest extent {sp['largest_free_extent']}, the rest leased or in flight")
        self._check(rc)
        return keys, sizes

    def put_end(self, keys: list, checksums: list, versions: list | None = None) -> int:
        """Master.put_end."""
        keys = _check_keys(keys)
        checksums = _check_per_key(checksums, "checksums", len(keys))
        if not _plain_ints(checksums, 0, (1 << 64) - 1):
            checksums = [check.int(f"checksums[{i}]", c, 0, (1 << 64) - 1) for i, c in enumerate(checksums)]
        vers = self._versions_arg(versions, len(keys))
        return self._check(self._lib.mt_put_end(self._t, float(self.clock.now()), self._keys(keys),
                                                self._ffi.new("uint64_t[]", checksums), vers, len(keys)))

    def put_revoke(self, keys: list, versions: list | None = None) -> int:
        """Master.put_revoke."""
        keys = _check_keys(keys)
        vers = self._versions_arg(versions, len(keys))
        return self._check(self._lib.mt_put_revoke(self._t, float(self.clock.now()), self._keys(keys), vers,
                                                   len(keys)))

    def _versions_arg(self, versions, n: int):
        if versions is None:
            return self._ffi.NULL
        return self._ffi.new("uint32_t[]", _check_versions(versions, n))

    def remove(self, keys: list) -> int:
        """Master.remove."""
        keys = _check_keys(keys)
        return self._check(self._lib.mt_remove(self._t, float(self.clock.now()), self._keys(keys), len(keys)))

    # ------------------------------------------------------------ expiry

    def expire(self) -> None:
        self._check(self._lib.mt_expire(self._t, float(self.clock.now())))

    def tick(self) -> None:
        self.expire()

    # ------------------------------------------------------------ stats

    @property
    def counters(self) -> dict:
        """Master.counters, as they stand (no expiry)."""
        self._lib.mt_get_counters(self._t, self._counters)
        c = self._counters
        return {name: getattr(c, name) for name in _COUNTERS}

    def _device_space(self) -> dict:
        self._lib.mt_get_space(self._t, self._space)
        s = self._space
        free, largest = s.free_bytes, s.largest_free_extent
        return {"node": self._node, "device": self._info.device, "capacity_bytes": s.capacity_bytes,
                "used_bytes": s.used_bytes, "free_bytes": free, "write_head": s.write_head,
                "freed_extents": s.freed_extents, "largest_free_extent": largest,
                "fragmentation": 0.0 if free == 0 else 1.0 - largest / free}

    def metadata_bytes(self) -> dict:
        self._lib.mt_get_space(self._t, self._space)
        s = self._space
        return {"total_bytes": s.metadata_bytes, "entries": s.entries,
                "bytes_per_entry": s.metadata_bytes / s.entries if s.entries else 0.0}

    def stats(self) -> dict:
        """Master.stats (expires first, as it does)."""
        self.expire()
        devices = [self._device_space()] if self._node is not None else []
        s, meta = self._space, self.metadata_bytes()
        return {**self.counters, "entries": s.entries, "bytes_per_entry": meta["bytes_per_entry"],
                "metadata_bytes": meta["total_bytes"], "pending_blocks": s.pending_blocks,
                "blocks": s.entries - s.pending_blocks, "used_bytes": sum(d["used_bytes"] for d in devices),
                "capacity_bytes": sum(d["capacity_bytes"] for d in devices), "devices": devices,
                "journal_errors": 0, "journal_unwritten_records": 0}

    def state(self) -> dict:
        """Everything that decides later answers (tests compare it with the Master's): rows (row numbers
        included), pending order, the allocator, the counters and the time base."""
        ffi, lib, t = self._ffi, self._lib, self._t
        lib.mt_get_space(t, self._space)
        s = self._space
        view, rows = ffi.new("mt_row_view *"), []
        for row in range(s.rows_used):
            lib.mt_get_row(t, row, view)
            key = (view.key.lo | view.key.hi << 64).to_bytes(16, "little")
            rows.append((key, view.offset, view.checksum, view.lru, view.length, view.version, view.lease_until,
                         view.lease_cap, view.put_deadline, view.state))
        freed = ffi.new("uint64_t[]", 2 * max(1, s.freed_extents))
        lib.mt_get_freed(t, freed, s.freed_extents)
        pending = ffi.new("uint32_t[]", max(1, s.pending_blocks))
        lib.mt_get_pending(t, pending, s.pending_blocks)
        return {"rows": rows, "pending": list(pending)[:s.pending_blocks],
                "head": s.write_head, "used": s.used_bytes,
                "freed": [(freed[2 * i], freed[2 * i + 1]) for i in range(s.freed_extents)],
                "evict_retry_ms": s.evict_retry_ms, "draining": s.draining_blocks, "entries": s.entries,
                "lru_next": lib.mt_lru_next(t), "version_next": lib.mt_version_next(t),
                "time_base": lib.mt_time_base(t), "counters": self.counters}

    def close(self) -> None:
        pass

    def __enter__(self) -> "NativeMaster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def master_state(master) -> dict:
    """``NativeMaster.state()``'s picture of a Python Master (one node of one device), for the tests."""
    t = master._table[:master._rows_used]
    rows = [(bytes(r["key"].tobytes()), int(r["offset"]), int(r["checksum"]), int(r["lru"]), int(r["length"]),
             int(r["version"]), int(r["lease_until"]), int(r["lease_cap"]), int(r["put_deadline"]), int(r["state"]))
            for r in t]
    devs = list(master._all_devices())
    dev = devs[0] if devs else None
    return {"rows": rows, "pending": list(master._pending),
            "head": dev.head if dev else 0, "used": dev.used if dev else 0,
            "freed": list(dev.freed.items()) if dev else [],
            "evict_retry_ms": dev.evict_retry_ms if dev else 0, "draining": len(master._draining),
            "entries": len(master._index), "lru_next": master._lru_next, "version_next": master._version_next,
            "time_base": master._time_base, "counters": dict(master.counters)}
