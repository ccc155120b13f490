"""The Master's side of crash safety: what each change journals, the snapshot of the whole state, and recovery
(the files, their framing and damage rules: journal.py).

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

import errno
import os

import msgspec
import numpy as np

from driver.errors import ChmError

from .journal import (SNAPSHOT, JournalDamage, _AllocRec, _CommitRec, _DeviceState, _DropRec, _FreeRec, _NodeRec,
                      _Snapshot, frame_record)
from .master_table import _INITIAL_ROWS, COMPLETE, DRAINING, ENTRY_DTYPE, FREE, PENDING

_SNAPSHOT_FORMAT = "hymcache-master-v1 " + str(ENTRY_DTYPE.descr)  # a layout change refuses old snapshots


class MasterRecovery:
    """Journal and snapshot of ``Master`` (a mixin)."""

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
            raise ChmError(exc.errno, f"state dir {self.state_dir}: cannot open {loaded.path}: "
                                      f"{exc.strerror}") from None
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

