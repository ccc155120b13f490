"""The Master's table: one row per block (entries, leases, versions, LRU stamps), its index and its time base.

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
object per key and one ``int`` object per row number; bench/master_footprint.py
checks that count against ``tracemalloc`` (numpy reports its buffers to it).
"""

from __future__ import annotations

import errno
import itertools
import math
import sys

import msgspec
import numpy as np

from driver.errors import ChmError

from . import auth
from .checks import _check_keys, _check_request_id
from .messages import KEY_BYTES, BlockLoc

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


class MasterTable:
    """The rows of ``Master`` (a mixin: the Master's ``__init__`` makes the table, allocator.py frees rows)."""

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

    def _add_pending(self, key: bytes, node: int, device: int, offset: int, length: int, version: int,
                     deadline_ms: int) -> None:
        row = self._new_row()
        self._table[row] = (np.void(key), offset, 0, 0, length, version, 0, 0, deadline_ms, node, device, PENDING)
        self._index[key] = row
        self._pending[row] = None


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

    # ------------------------------------------------------------ lookup

    def lookup(self, keys: list, request_id: str | None = None) -> list[BlockLoc]:
        """The longest stored contiguous prefix of ``keys``; each returned block gets a read lease, and with
        ``request_id`` its token (``BlockLoc.lease``): what the block's Manager asks for before it sends the
        bytes to that request."""
        keys = _check_keys(keys)
        request_id = _check_request_id(request_id, optional=True)
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

    # ------------------------------------------------------------ footprint

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

