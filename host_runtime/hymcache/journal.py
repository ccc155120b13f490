"""The Master's state on disk (``state_dir``): snapshot, journal, lock, and what recovery concludes from them.

Files
-----
``snapshot.msgpack``  the whole state at the start of generation G: a frame (u32 length, u32 CRC32 of the body)
                      around the msgspec MessagePack ``_Snapshot``; written aside (``.tmp``), fsync'd, renamed.
                      (Older Masters wrote the body without the frame: still read.)
``journal-<G>``       every change since, one frame per record (``_NodeRec``, ``_AllocRec``, ...), in the order made
``lock``              flock'd by the Master using the directory; holds its pid
``damaged-<N>/``      what ``recover_damaged`` moved aside, with ``report.txt`` (what was lost)

Writing
-------
Records queue in memory and are written at the end of every call (``flush``). A write that fails (ENOSPC, EIO)
is cut back (ftruncate) to the end of the last whole record and its records stay queued for the next flush, so
a torn record is never followed by a good one; until the cut succeeds nothing more is appended. An fsync that
fails puts everything written since the last good fsync back in the queue (the kernel may have dropped those
pages). A new generation's empty ``journal-<G+1>`` is created *before* the snapshot naming G+1 is renamed in:
a crash between the two leaves an empty journal, which recovery ignores.

Reading: what is damage
-----------------------
Recovery reads the snapshot and ``journal-<G>`` frame by frame. At the first frame that is not whole and valid,
the rest of the file is a *torn tail* (accepted, logged, cut off: it was never acknowledged) when it is all
zeros (a crash after the size grew, before the data came) or when the file ends inside that frame, no valid
frame follows and its body is not whole under a wrong length (a write cut by ``kill -9`` or a crash). Anything
else is *damage*: a frame whose bytes are all there but whose checksum is wrong, a valid frame after a bad one,
a record that does not decode or does not replay, a snapshot that does not decode or fails its checksum, a
non-empty journal of a generation newer than the snapshot's (or any, with no snapshot). On damage the Master
refuses to start, naming the file and the offset, and changes nothing on disk. With ``recover_damaged`` it
keeps what it can read up to the damage, writes that as a new snapshot, moves the damaged files as they are
into ``damaged-<N>/`` and reports there (and in its log) what was lost. Nothing recovery could not fully read is
ever deleted; it deletes only journals a fully read snapshot supersedes, empty ones, and ``snapshot.msgpack.tmp``
(never renamed in, so never acknowledged).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable, Union

import msgspec

from driver.errors import ChmError
from common.fs import fsync_dir

from .messages import DeviceInfo

SNAPSHOT = "snapshot.msgpack"
_JOURNAL_RE = re.compile(r"journal-(\d+)\Z")
_FRAME = struct.Struct("<II")       # record length, CRC32 of the record


# ---------------------------------------------------------------- records

class _NodeRec(msgspec.Struct, tag="n", array_like=True):
    node: int
    endpoint: str
    devices: list[DeviceInfo]


class _AllocRec(msgspec.Struct, tag="a", array_like=True):
    key: bytes
    node: int
    device: int
    offset: int
    length: int
    version: int


class _CommitRec(msgspec.Struct, tag="c", array_like=True):
    key: bytes
    checksum: int


class _DropRec(msgspec.Struct, tag="d", array_like=True):
    key: bytes
    freed: bool          # False: the block was leased; a _FreeRec frees its extent later


class _FreeRec(msgspec.Struct, tag="f", array_like=True):
    node: int
    device: int
    offset: int


_Record = Union[_NodeRec, _AllocRec, _CommitRec, _DropRec, _FreeRec]


class _DeviceState(msgspec.Struct, array_like=True):
    node: int
    device: int
    head: int
    used: int
    freed: list[tuple[int, int]]   # (offset, length) in the order freed


class _Snapshot(msgspec.Struct):
    format: str
    journal_gen: int
    lru_next: int
    version_next: int
    nodes: list[_NodeRec]
    devices: list[_DeviceState]
    rows: bytes                    # the table's rows that are not FREE, raw ENTRY_DTYPE


_rec_encode = msgspec.msgpack.Encoder().encode
_rec_decode = msgspec.msgpack.Decoder(_Record).decode
_snap_decode = msgspec.msgpack.Decoder(_Snapshot).decode


def frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def frame_record(rec) -> bytes:
    return frame(_rec_encode(rec))


# ---------------------------------------------------------------- reading

class JournalDamage(ChmError):
    """A state file recovery cannot fully read (see the module doc); nothing was changed on disk."""

    def __init__(self, path: str, offset: int, reason: str):
        super().__init__(errno.EIO, f"{path} is damaged at offset {offset}: {reason}. The Master refuses to start "
                                    "and changed nothing in its state dir (--recover-damaged: keep what can be read, "
                                    "move the damaged files aside and report what is lost)")
        self.path, self.offset, self.reason = path, offset, reason


@dataclass
class Scan:
    """A journal as read: its whole records (offset, record), where the good part ends, and what follows."""
    records: list = field(default_factory=list)
    end: int = 0
    size: int = 0
    torn: str | None = None                  # why the bytes past ``end`` were dropped (not damage)
    damage: tuple[int, str] | None = None    # (offset, why)


def _whole_frame_at(data: bytes, pos: int):
    """The record of a valid frame at ``pos``, or None."""
    if pos + _FRAME.size > len(data):
        return None
    length, crc = _FRAME.unpack_from(data, pos)
    end = pos + _FRAME.size + length
    if end > len(data) or zlib.crc32(data[pos + _FRAME.size:end]) != crc:
        return None
    try:
        return _rec_decode(data[pos + _FRAME.size:end])
    except msgspec.DecodeError:
        return None


def _after_bad_frame(data: bytes, pos: int, cut_short: bool, why: str) -> tuple[str | None, tuple[int, str] | None]:
    """(torn reason, None) or (None, damage) for a journal whose first bad frame is at ``pos``."""
    rest = len(data) - pos
    if data.count(0, pos) == rest:
        return f"{rest} zero bytes at offset {pos} (a crash before the data came)", None
    if not cut_short:
        return None, (pos, why)
    for q in range(pos + 1, len(data) - _FRAME.size + 1):
        if _whole_frame_at(data, q) is not None:
            return None, (pos, f"{why}, and a valid record follows at offset {q}")
    if rest >= _FRAME.size and zlib.crc32(data[pos + _FRAME.size:]) == _FRAME.unpack_from(data, pos)[1]:
        return None, (pos, "the record's length field is wrong (its body is whole up to the end of the file)")
    return f"a record cut short at offset {pos} ({rest} bytes; {why})", None


def scan_journal(data: bytes) -> Scan:
    scan = Scan(size=len(data))
    pos = 0
    while pos < len(data):
        if pos + _FRAME.size > len(data):
            scan.torn, scan.damage = _after_bad_frame(data, pos, True, "the file ends inside a frame header")
            break
        length, crc = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        if end > len(data):
            scan.torn, scan.damage = _after_bad_frame(data, pos, True, f"a {length}-byte record runs past the end")
            break
        body = data[pos + _FRAME.size:end]
        if zlib.crc32(body) != crc:
            scan.torn, scan.damage = _after_bad_frame(data, pos, False, "checksum mismatch")
            break
        try:
            rec = _rec_decode(body)
        except msgspec.DecodeError as exc:
            scan.torn, scan.damage = _after_bad_frame(data, pos, False, f"the record does not decode ({exc})")
            break
        scan.records.append((pos, rec))
        pos = end
    scan.end = pos
    return scan


def _readable_after(data: bytes, pos: int) -> list:
    """Records of every valid frame from ``pos`` on (resynchronizing past bad bytes): what a damage loses."""
    out, q = [], pos
    while q + _FRAME.size <= len(data):
        rec = _whole_frame_at(data, q)
        if rec is None:
            q += 1
        else:
            out.append(rec)
            q += _FRAME.size + _FRAME.unpack_from(data, q)[0]
    return out


def decode_snapshot(data: bytes, path: str) -> _Snapshot:
    if len(data) >= _FRAME.size and _FRAME.unpack_from(data, 0)[0] == len(data) - _FRAME.size:
        body = data[_FRAME.size:]
        if zlib.crc32(body) != _FRAME.unpack_from(data, 0)[1]:
            raise JournalDamage(path, _FRAME.size, f"checksum mismatch over its {len(body)} bytes")
    else:
        body = data  # written unframed by an older Master
    try:
        return _snap_decode(body)
    except msgspec.DecodeError as exc:
        raise JournalDamage(path, 0, f"the snapshot does not decode ({exc}; {len(data)} bytes)") from None


@dataclass
class Loaded:
    """What recovery found: the snapshot (None: none) and the records of its journal to replay."""
    snapshot: _Snapshot | None = None
    gen: int = 0
    path: str = ""                  # the journal replayed
    scan: Scan = field(default_factory=Scan)
    damage: list = field(default_factory=list)      # [(path, offset, reason)] (recover_damaged only)
    aside: list = field(default_factory=list)       # files to move into damaged-<N>/ once the new snapshot is in
    delete: list = field(default_factory=list)      # superseded or empty journals
    lost_records: list = field(default_factory=list)  # readable records past the damage: not replayed
    lost_snapshot: bool = False     # the snapshot itself was unreadable: all its blocks are lost


# ---------------------------------------------------------------- the state dir

class Journal:
    """The state dir of one Master: lock, recovery reading, the journal's queue and writes, snapshots."""

    def __init__(self, state_dir: str, snapshot_every: int, log: Callable[[str], None]):
        self.dir, self.snapshot_every, self.log = str(state_dir), snapshot_every, log
        try:
            st = os.stat(self.dir)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise ChmError(exc.errno, f"state dir {self.dir}: {exc.strerror}") from None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise ChmError(errno.ENOTDIR, f"state dir {self.dir} exists and is not a directory: give a directory "
                                          "(created if absent)")
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ChmError(exc.errno, f"state dir {self.dir}: cannot create or open it: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise ChmError(errno.EBUSY, f"state dir {self.dir} is in use by another Master "
                                        f"(pid {holder or '?'})") from None
        try:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is for people; a full disk must not stop a restart
        self.fd = -1
        self.gen = 0
        self._next_gen = 1
        self._queue: list[bytes] = []      # frames not yet written
        self._unsynced: list[bytes] = []   # frames written since the last good fsync
        self._end = 0                      # end of the last whole record written
        self._synced_end = 0
        self._cut_needed = False           # bytes past _end from a failed write are still there
        self.records_since_snapshot = 0
        self._snapshot_at = snapshot_every
        self.error: OSError | None = None  # the last failure while writes fail; None when they succeed
        self.errors = 0                    # failed flushes and snapshots, all time

    def path(self, gen: int) -> str:
        return os.path.join(self.dir, f"journal-{gen}")

    # ------------------------------------------------------------ recovery

    def load(self, snapshot_format: str, recover_damaged: bool) -> Loaded:
        """Read the snapshot and its journal. Damage raises JournalDamage, or with ``recover_damaged`` is noted
        in the result (nothing on disk changes here either way)."""
        out = Loaded()

        def damaged(path: str, offset: int, reason: str) -> None:
            if not recover_damaged:
                raise JournalDamage(path, offset, reason)
            out.damage.append((path, offset, reason))

        journals = {}
        for name in os.listdir(self.dir):
            m = _JOURNAL_RE.match(name)
            if m:
                journals[int(m.group(1))] = os.path.join(self.dir, name)
        snap_path = os.path.join(self.dir, SNAPSHOT)
        if os.path.exists(snap_path):
            with open(snap_path, "rb") as f:
                data = f.read()
            try:
                out.snapshot = decode_snapshot(data, snap_path)
            except JournalDamage as exc:
                damaged(exc.path, exc.offset, exc.reason)
                out.lost_snapshot = True
                out.aside.append(snap_path)
            if out.snapshot is not None:
                if out.snapshot.format != snapshot_format:
                    raise ChmError(errno.EINVAL, f"snapshot {snap_path} has format {out.snapshot.format!r}; this "
                                                 f"Master reads {snapshot_format!r}")
                out.gen = out.snapshot.journal_gen
        if out.lost_snapshot:       # no base to replay any journal on
            for gen, path in sorted(journals.items()):
                out.aside.append(path)
                out.lost_records += self._records_of(path)
            out.gen = -1
        else:
            for gen, path in sorted(journals.items()):
                if gen < out.gen:
                    out.delete.append(path)      # its records are in the snapshot
                elif gen > out.gen:
                    if os.path.getsize(path) == 0:
                        out.delete.append(path)  # a new generation whose snapshot never came
                    else:
                        damaged(path, 0, f"journal generation {gen} is newer than "
                                         + (f"the snapshot's ({out.gen})" if out.snapshot is not None else
                                            f"any snapshot: {SNAPSHOT} is missing"))
                        out.aside.append(path)
                        out.lost_records += self._records_of(path)
            out.path = self.path(out.gen)
            try:
                with open(out.path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                data = b""
            out.scan = scan_journal(data)
            if out.scan.damage is not None:
                offset, reason = out.scan.damage
                damaged(out.path, offset, reason)
                out.aside.append(out.path)
                out.lost_records += _readable_after(data, offset)
        self._next_gen = max([out.gen, *journals]) + 1
        return out

    def _records_of(self, path: str) -> list:
        with open(path, "rb") as f:
            return _readable_after(f.read(), 0)

    def open(self, loaded: Loaded) -> None:
        """Append to the journal just replayed (its torn tail cut off); not to a damaged one."""
        if loaded.damage or loaded.gen < 0:
            return
        self.fd = os.open(loaded.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.gen = loaded.gen
        self._end = self._synced_end = loaded.scan.end
        self.records_since_snapshot = len(loaded.scan.records)
        if loaded.scan.size > loaded.scan.end:
            self._cut_needed = True
            self._cut(loaded.scan.end)

    def keep_aside(self, loaded: Loaded, report: list[str]) -> str | None:
        """Before the recovered state replaces them: a copy (hard link) of every damaged file and ``report``'s
        lines in a new ``damaged-<N>/``, its path (None: nothing damaged). A failure refuses the start."""
        if not loaded.aside:
            return None
        n = 1
        while os.path.exists(os.path.join(self.dir, f"damaged-{n}")):
            n += 1
        aside = os.path.join(self.dir, f"damaged-{n}")
        try:
            os.mkdir(aside)
            for path in dict.fromkeys(loaded.aside):
                os.link(path, os.path.join(aside, os.path.basename(path)))
            with open(os.path.join(aside, "report.txt"), "w") as f:
                f.write("\n".join(report) + "\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(aside)
            fsync_dir(self.dir)
        except OSError as exc:
            self.undo_aside(aside)
            raise ChmError(exc.errno, f"state dir {self.dir}: cannot keep the damaged files in {aside} "
                                      f"({exc.strerror}); nothing was moved or deleted") from None
        return aside

    def undo_aside(self, aside: str | None) -> None:
        if aside and os.path.isdir(aside):
            for name in os.listdir(aside):
                _remove(os.path.join(aside, name))
            try:
                os.rmdir(aside)
            except OSError:
                pass

    def finish(self, loaded: Loaded) -> None:
        """Once the recovered state is safe: delete the journals it supersedes, and the damaged files' names
        (their copies stay in damaged-<N>/)."""
        snap_path = os.path.join(self.dir, SNAPSHOT)
        for path in loaded.delete + loaded.aside:
            if path != snap_path:  # a damaged snapshot's name holds the new one now
                _remove(path)
        _remove(os.path.join(self.dir, SNAPSHOT + ".tmp"))

    # ------------------------------------------------------------ writing

    def append(self, frame_bytes: bytes) -> None:
        self._queue.append(frame_bytes)

    def discard(self, n: int) -> None:
        """Take the last ``n`` queued frames back (a call that failed before applying its change)."""
        del self._queue[len(self._queue) - n:]

    @property
    def unwritten(self) -> int:
        return len(self._queue)

    def _cut(self, end: int) -> None:
        try:
            os.ftruncate(self.fd, end)
            self._cut_needed = False
        except OSError:
            self._cut_needed = True  # retried before anything more is appended

    def _failed(self, exc: OSError, what: str) -> ChmError:
        self.errors += 1
        if self.error is None:
            self.log(f"master: {what} in state dir {self.dir} failed: {exc.strerror}; lookups go on, changes are "
                     f"refused until it succeeds (records waiting: {len(self._queue)})")
        self.error = exc
        return ChmError(exc.errno or errno.EIO, f"state dir {self.dir}: the journal write failed ({exc.strerror}); "
                                                "the Master serves lookups but refuses changes until it succeeds")

    def flush(self, durable: bool) -> None:
        """Write the queue (then fsync if ``durable``). A failure is cut back, keeps the queue, and raises
        ChmError with the I/O error's errno, naming the state dir."""
        if self.fd < 0:
            return
        try:
            if self._cut_needed:
                os.ftruncate(self.fd, self._end)
                self._cut_needed = False
            if self._queue:
                data = b"".join(self._queue)
                view = memoryview(data)
                try:
                    while view:
                        view = view[os.write(self.fd, view):]
                except OSError:
                    self._cut(self._end)
                    raise
                self._end += len(data)
                self.records_since_snapshot += len(self._queue)
                self._unsynced += self._queue
                self._queue.clear()
            if durable and self._unsynced:
                try:
                    os.fsync(self.fd)
                except OSError:
                    # the kernel may have dropped those pages: write them again
                    self._queue[:0] = self._unsynced
                    self._unsynced.clear()
                    self._end = self._synced_end
                    self._cut_needed = True
                    self._cut(self._end)
                    raise
                self._unsynced.clear()
                self._synced_end = self._end
        except OSError as exc:
            raise self._failed(exc, "a journal write") from None
        if self.error is not None and not self._queue:
            self.log(f"master: journal writes in state dir {self.dir} succeed again")
            self.error = None

    def snapshot_due(self) -> bool:
        return self.fd >= 0 and self.records_since_snapshot >= self._snapshot_at

    def write_snapshot(self, body: bytes, gen: int) -> None:
        """Start generation ``gen`` (``next_gen()``) from ``body``, the encoded state now (which includes every
        queued record: the queue empties). On failure nothing changes but the files it began are removed."""
        new_path, snap_path = self.path(gen), os.path.join(self.dir, SNAPSHOT)
        tmp = snap_path + ".tmp"
        new_fd = -1
        try:
            new_fd = os.open(new_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            fsync_dir(self.dir)
            with open(tmp, "wb") as f:
                f.write(frame(body))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, snap_path)
        except OSError as exc:
            if new_fd >= 0:
                os.close(new_fd)
                _remove(new_path)
            _remove(tmp)
            self.errors += 1
            self._snapshot_at = self.records_since_snapshot + self.snapshot_every  # not at every call meanwhile
            raise ChmError(exc.errno or errno.EIO, f"state dir {self.dir}: snapshot not written ({exc.strerror}); "
                                                   f"journal-{self.gen} goes on") from None
        old_fd, old_gen = self.fd, self.gen
        self.fd, self.gen, self._next_gen = new_fd, gen, gen + 1
        self._queue.clear()
        self._unsynced.clear()
        self._end = self._synced_end = 0
        self._cut_needed = False
        self.records_since_snapshot = 0
        self._snapshot_at = self.snapshot_every
        if old_fd >= 0:
            os.close(old_fd)
        try:
            fsync_dir(self.dir)  # the rename is durable before the journal it supersedes goes
        except OSError as exc:
            self.log(f"master: state dir {self.dir}: fsync after the snapshot failed ({exc.strerror}); "
                     f"journal-{old_gen} stays (the next start deletes it)")
            return
        if old_fd >= 0:
            _remove(self.path(old_gen))
        if self.error is not None:
            self.log(f"master: journal writes in state dir {self.dir} succeed again (snapshot written)")
            self.error = None

    def next_gen(self) -> int:
        return self._next_gen

    def close(self) -> None:
        """Let go of the files (what was not flushed stays unwritten, as after kill -9)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # gone already, or the disk refuses: a leftover the next start deletes
