"""The Master's journal never loses an acknowledged block (issue 21, part 3).

The issue's scenarios on a real 256 KiB tmpfs with real ``chm hymcache master`` processes killed with SIGKILL:
a full state disk (puts refused with ENOSPC naming the state dir and undone, lookups served, the Master never
exits, every acknowledged put found after the restart), a flipped byte and a lost snapshot (the Master refuses
to start naming the file and offset, and nothing is deleted; ``--recover-damaged`` keeps a copy and reports
what was lost), a torn last record (accepted). Then what is damage, record by record, and the undo paths in
process (memory always equals what the journal replays to)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from driver.errors import ChmError
from host_runtime.hymcache import journal as journal_module
from host_runtime.hymcache.clock import ManualClock
from host_runtime.hymcache.journal import _AllocRec, _CommitRec, frame_record, scan_journal
from host_runtime.hymcache.master import Master, MasterClient
from host_runtime.hymcache.messages import DeviceInfo
from host_runtime.hymcache.rpc import RemoteError

from .procs import start_piece
from tests.emulator.media_trouble import small_tmpfs
from tests.emulator.serve.serving import ROOT

BLOCK = 4096
DEVICE = DeviceInfo(0, "/dev/shm/hymcache-journal-test", 1 << 30, 1)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def tmpfs(tmp_path):
    """A real 256 KiB tmpfs (root mounts it; skipped only where mount is refused)."""
    with small_tmpfs(tmp_path / "tmpfs", 256 << 10) as where:
        yield where


def fill(fs) -> str:
    """Fill the file system ``fs`` to ENOSPC; the filler's path (remove it to give the space back)."""
    path = os.path.join(fs, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"f" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return path


class Proc:
    """``chm hymcache master`` (the CLI's code) as a process, and a client to it."""

    def __init__(self, state_dir, *args: str):
        self.proc, info = start_piece("master", "--port", "0", "--state-dir", str(state_dir), *args)
        self.client = MasterClient(info["endpoint"], timeout_s=20)

    def put(self, i: int) -> RemoteError | None:
        """One block's put_start and put_end: None when put_end acknowledged it, else the error."""
        try:
            self.client.put_start(f"req{i}", [key(i)], [BLOCK])
            assert self.client.put_end([key(i)], [i]) == 1
        except RemoteError as exc:
            return exc
        return None

    def found(self, ids) -> set[int]:
        return {i for i in ids if self.client.lookup([key(i)])}

    def kill9(self) -> str:
        """SIGKILL; its stderr."""
        self.client.close()
        self.proc.send_signal(signal.SIGKILL)
        _, err = self.proc.communicate(timeout=30)
        return err.decode(errors="replace")


def refused_start(state_dir, *args: str) -> subprocess.CompletedProcess:
    """A Master that must refuse to start: its exit and stderr."""
    return subprocess.run([sys.executable, "-m", "host_runtime.hymcache.cli", "master", "--port", "0", "--state-dir",
                           str(state_dir), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def tree(d) -> dict[str, bytes]:
    """Every file under ``d`` with its bytes (the lock file's pid aside)."""
    out = {}
    for base, _, names in os.walk(d):
        for name in names:
            if name != "lock":
                with open(os.path.join(base, name), "rb") as f:
                    out[os.path.relpath(os.path.join(base, name), d)] = f.read()
    return out


def wait_for(cond, what: str, timeout: float = 30.0):
    """Poll ``cond`` (a state of the other process: nothing to wait on but its answers) until it holds."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # the poll's interval: the other process's own clock (its put timeout) is under test
    return value


# ---------------------------------------------------------------- a full state disk, as processes

def test_a_full_state_disk_refuses_puts_undoes_them_serves_lookups_and_loses_no_acknowledged_block(tmpfs):
    state = tmpfs / "state"
    m = Proc(state)
    try:
        m.client.register_node(0, "tcp://manager0", [DEVICE])
        assert [m.put(i) for i in range(200)] == [None] * 200
        filler = fill(tmpfs)
        full = {i: m.put(i) for i in range(200, 300)}    # a few may fit in the journal's last page
        refused = {i: e for i, e in full.items() if e is not None}
        assert len(refused) > 50
        for exc in refused.values():                      # the bad client: a clear error naming the state dir
            assert exc.errno == errno.ENOSPC and str(state) in str(exc) and "No space left" in str(exc)
        s = m.client.stats()
        assert s["pending_blocks"] == 0                   # every refused put's allocation was undone
        assert s["blocks"] == 200 + len(full) - len(refused) and s["journal_errors"] > 0
        assert m.found(range(200)) == set(range(200))     # the good client: lookups go on
        with pytest.raises(RemoteError) as exc:           # and a malformed call is still answered
            m.client.lookup([b"short"])
        assert exc.value.errno == errno.EINVAL
        os.remove(filler)
        assert [m.put(i) for i in range(300, 400)] == [None] * 100   # space is back: puts resume
        assert m.client.stats()["journal_unwritten_records"] == 0
        acked = set(range(200)) | {i for i, e in full.items() if e is None} | set(range(300, 400))
        err = m.kill9()
        assert "Traceback" not in err and "No space left on device" in err   # logged, once per episode
        m = Proc(state)
        assert m.found(range(400)) == acked               # every put_end that returned success
    finally:
        m.kill9()


def test_a_full_disk_and_a_timed_out_put_do_not_end_the_master(tmpfs):
    state = tmpfs / "state"
    m = Proc(state, "--put-timeout", "1")
    try:
        m.client.register_node(0, "tcp://manager0", [DEVICE])
        assert [m.put(i) for i in range(20)] == [None] * 20
        m.client.put_start("abandoned", [key(99)], [BLOCK])   # never finished: the tick revokes it
        filler = fill(tmpfs)
        i = 1000
        while m.put(i) is None:                            # until the journal's last page is full too
            i += 1
        exc = m.put(20)
        assert exc is not None and exc.errno == errno.ENOSPC and str(state) in str(exc)
        # the tick's revocation cannot be journaled either: logged, retried, never fatal
        wait_for(lambda: m.client.stats()["revoked_blocks"] == 1, "the tick to revoke the abandoned put")
        assert m.proc.poll() is None and m.client.stats()["journal_unwritten_records"] > 0
        assert m.found(range(20)) == set(range(20))
        os.remove(filler)
        assert m.put(21) is None                           # the next call writes the queued records first
        err = m.kill9()
        assert "Traceback" not in err
        m = Proc(state)
        assert m.found([*range(22), 99, *range(1000, i + 1)]) == {*range(20), 21, *range(1000, i)}
    finally:
        m.kill9()


def test_a_master_restarted_on_a_full_disk_serves_and_keeps_its_journal(tmpfs):
    state = tmpfs / "state"
    m = Proc(state)
    try:
        m.client.register_node(0, "tcp://manager0", [DEVICE])
        assert [m.put(i) for i in range(50)] == [None] * 50
        m.kill9()
        filler = fill(tmpfs)
        m = Proc(state)                                    # its snapshot cannot be written: it goes on
        assert m.found(range(50)) == set(range(50))
        os.remove(filler)
        assert m.put(50) is None
        m.kill9()
        m = Proc(state)
        assert m.found(range(51)) == set(range(51))
    finally:
        m.kill9()


# ---------------------------------------------------------------- damage, as processes

def _stored(state, n: int, *args: str) -> set[int]:
    m = Proc(state, *args)
    try:
        m.client.register_node(0, "tcp://manager0", [DEVICE])
        assert [m.put(i) for i in range(n)] == [None] * n
    finally:
        m.kill9()
    return set(range(n))


def test_a_flipped_byte_refuses_the_start_and_deletes_nothing_then_recover_damaged_reports_the_loss(tmpfs):
    state = tmpfs / "state"
    acked = _stored(state, 200)
    journal = state / "journal-1"
    data = bytearray(journal.read_bytes())
    at = len(data) // 4
    data[at] ^= 0x40
    journal.write_bytes(bytes(data))
    before = tree(state)
    r = refused_start(state)
    assert r.returncode == 1 and str(journal) in r.stderr and "damaged at offset" in r.stderr, r.stderr
    assert "--recover-damaged" in r.stderr
    assert tree(state) == before                           # nothing deleted, nothing changed
    m = Proc(state, "--recover-damaged")
    try:
        found = m.found(range(200))
        assert 0 < len(found) < 200 and found <= acked
        (aside,) = [p for p in state.iterdir() if p.name.startswith("damaged-")]
        assert (aside / "journal-1").read_bytes() == bytes(data)          # the copy, as it was
        report = (aside / "report.txt").read_text()
        assert str(journal) in report and "damaged" in report
        lost = {int.from_bytes(bytes.fromhex(line.split()[-1]), "little")
                for line in report.splitlines() if line.startswith("lost block ")}
        # exactly what was lost: every acknowledged block is back or listed, but the one whose record is garbled
        assert not lost & found and len(acked - found - lost) <= 1
        assert len(lost) > 100
        assert m.put(500) is None                           # and it serves puts again
    finally:
        err = m.kill9()
    assert f"damaged files are kept in {aside}" in err


def test_a_lost_snapshot_with_a_later_journal_refuses_the_start_and_deletes_nothing(tmpfs):
    state = tmpfs / "state"
    _stored(state, 20)                                      # journal-1; the restart below snapshots generation 2
    m = Proc(state)
    try:
        assert [m.put(i) for i in range(20, 30)] == [None] * 10    # in journal-2
    finally:
        m.kill9()
    os.remove(state / "snapshot.msgpack")
    before = tree(state)
    r = refused_start(state)
    assert r.returncode == 1 and str(state / "journal-2") in r.stderr and "snapshot.msgpack is missing" in r.stderr
    assert tree(state) == before
    m = Proc(state, "--recover-damaged")
    try:
        assert m.found(range(30)) == set()                  # nothing to replay journal-2 on
        (aside,) = [p for p in state.iterdir() if p.name.startswith("damaged-")]
        report = (aside / "report.txt").read_text()
        assert report.count("lost block ") == 10 and "snapshot.msgpack is missing" in report
        assert (aside / "journal-2").read_bytes() == before["journal-2"]
    finally:
        m.kill9()


def test_a_torn_last_record_is_accepted_and_every_acknowledged_block_served(tmpfs):
    state = tmpfs / "state"
    acked = _stored(state, 30)
    torn = frame_record(_AllocRec(key(77), 0, 0, 1 << 20, BLOCK, 999))
    with open(state / "journal-1", "ab") as f:
        f.write(torn[:len(torn) // 2])                      # what a write cut by kill -9 leaves
    m = Proc(state)
    try:
        assert m.found(range(30)) == acked
        with pytest.raises(RemoteError) as exc:             # a bad client: a clear error, the service goes on
            m.client.put_start("r", [key(1)], [0])
        assert exc.value.errno == errno.EINVAL and "sizes[0]" in str(exc.value)
        assert m.found([77]) == set()
    finally:
        err = m.kill9()
    assert "dropped a torn last record" in err


def test_a_state_dir_that_is_a_file_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    r = refused_start(path)
    assert r.returncode == 1 and f"state dir {path} exists and is not a directory" in r.stderr, r.stderr


def test_the_cli_master_logs_internal_errors(tmp_path):
    code = ("import sys; from host_runtime.hymcache import master, cli; "
            "master.Master.nodes = lambda self: 1 / 0; sys.exit(cli.main(['master', '--port', '0']))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        from host_runtime.hymcache.cli import read_lines
        line = next(ln for ln in read_lines(proc, time.monotonic() + 60, "master") if ln.startswith("{"))
        import json
        with MasterClient(json.loads(line)["endpoint"], timeout_s=20) as c:
            with pytest.raises(RemoteError) as exc:
                c.nodes()
            assert exc.value.errno == errno.EIO and "see its log" in str(exc.value)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "internal error answering a call" in err.decode() and "ZeroDivisionError" in err.decode()


# ---------------------------------------------------------------- what is damage, record by record

def _journal(n: int) -> bytes:
    return b"".join(frame_record(_CommitRec(key(i), i)) for i in range(n))


def test_a_torn_or_zeroed_tail_is_not_damage():
    good = _journal(10)
    last = frame_record(_CommitRec(key(10), 10))
    for tail in (last[:3], last[:8], last[:-1], b"\0" * 100):
        scan = scan_journal(good + tail)
        assert (len(scan.records), scan.end, scan.damage) == (10, len(good), None) and scan.torn, tail


@pytest.mark.parametrize("how", ["body byte", "checksum", "length longer", "length shorter", "length past the end",
                                 "last length"])
def test_a_bad_record_before_good_ones_or_a_whole_bad_one_is_damage(how):
    data = bytearray(_journal(10))
    third = len(frame_record(_CommitRec(key(0), 0))) * 3     # records 0..2 are whole; record 3 is hit
    if how == "body byte":
        data[third + 12] ^= 1
    elif how == "checksum":
        data[third + 4] ^= 1
    elif how == "length longer":
        data[third] += 7
    elif how == "length shorter":
        data[third] -= 3
    elif how == "length past the end":                       # looks cut short, but good records follow
        data[third + 2] = 1
    else:                                                    # the last record's length points past the end
        third = len(data) - len(frame_record(_CommitRec(key(9), 9)))
        data[third + 1] = 1
    scan = scan_journal(bytes(data))
    assert scan.damage is not None and scan.damage[0] == third and scan.end == third and not scan.torn, scan


def test_an_unframed_snapshot_of_an_older_master_is_still_read(tmp_path):
    m = Master(ManualClock(), tmp_path)
    m.register_node(0, "tcp://x", [DEVICE])
    m.put_start("r", [key(1)], [BLOCK])
    m.put_end([key(1)], [5])
    m.close()
    snap = tmp_path / "snapshot.msgpack"
    snap.write_bytes(snap.read_bytes()[8:])                  # the body alone, as v1 Masters wrote it
    r = Master(ManualClock(), tmp_path)
    assert [b.key for b in r.lookup([key(1)])] == [key(1)]
    r.close()


def test_a_damaged_snapshot_refuses_the_start_naming_it(tmp_path):
    m = Master(ManualClock(), tmp_path)
    m.register_node(0, "tcp://x", [DEVICE])
    m.close()
    snap = tmp_path / "snapshot.msgpack"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x10
    snap.write_bytes(bytes(data))
    with pytest.raises(ChmError) as exc:
        Master(ManualClock(), tmp_path)
    assert exc.value.errno == errno.EIO and str(snap) in str(exc.value) and "checksum mismatch" in str(exc.value)
    assert snap.read_bytes() == bytes(data)
    logs = []
    r = Master(ManualClock(), tmp_path, recover_damaged=True, log=logs.append)
    assert r.nodes() == {} and any("every block it held is lost" in line for line in logs)
    r.close()


# ---------------------------------------------------------------- failed writes, in process

class FailingIO:
    """os.write / os.fsync that fail with ``err`` while ``on``, as a full or failing disk does."""

    def __init__(self, monkeypatch, err: int):
        self.on, self.err = False, err
        real_write, real_fsync = os.write, os.fsync

        def write(fd, data):
            if self.on and fd == self.fd:
                n = real_write(fd, bytes(data[:len(data) // 2]))  # a short write first, as ENOSPC leaves
                if n == len(data):
                    return n
                raise OSError(err, os.strerror(err))
            return real_write(fd, data)

        def fsync(fd):
            if self.on and fd == self.fd:
                raise OSError(err, os.strerror(err))
            return real_fsync(fd)

        monkeypatch.setattr(journal_module.os, "write", write)
        monkeypatch.setattr(journal_module.os, "fsync", fsync)
        self.fd = -1


@pytest.mark.parametrize("err, where", [(errno.ENOSPC, "write"), (errno.EIO, "write"), (errno.EIO, "fsync")])
def test_a_failed_write_leaves_no_torn_record_and_undoes_its_call(tmp_path, monkeypatch, err, where):
    clock = ManualClock()
    m = Master(clock, tmp_path, put_timeout_s=5.0, high_watermark=1.0, low_watermark=1.0)
    m.register_node(0, "tcp://x", [DeviceInfo(0, "/dev/shm/x", 10 * BLOCK, 1)])
    io = FailingIO(monkeypatch, err)
    io.fd = m._journal.fd
    for i in range(6):
        m.put_start("r", [key(i)], [BLOCK])
        assert m.put_end([key(i)], [i]) == 1
    m.remove([key(0)])
    m.put_start("late", [key(50)], [BLOCK])                 # its put_end will fail
    if where == "write":
        io.on = True
        with pytest.raises(ChmError) as exc:
            m.put_start("r", [key(10)], [BLOCK])
        assert exc.value.errno == err and str(tmp_path) in str(exc.value)
        assert m.stats()["pending_blocks"] == 1             # only "late": the failed put_start is undone
    io.on = True
    with pytest.raises(ChmError) as exc:
        m.put_end([key(50)], [50])
    assert exc.value.errno == err and m.lookup([key(50)]) == []
    if where == "write":                                      # refused: earlier records are not written yet
        assert "put_end refused" in str(exc.value) and m.stats()["pending_blocks"] == 1
    else:                                                     # its own records failed: undone
        assert "not registered" in str(exc.value) and m.stats()["pending_blocks"] == 0
    with pytest.raises(ChmError):
        m.register_node(1, "tcp://y", [DeviceInfo(0, "/dev/shm/y", BLOCK, 1)])
    assert 1 not in m.nodes()                                 # refused before it was applied
    clock.advance(10)
    m.tick()                                                  # never raises; revokes "late" (in memory)
    assert m.stats()["pending_blocks"] == 0
    assert all(m.lookup([key(i)]) for i in range(1, 6))       # lookups go on
    size = os.path.getsize(tmp_path / "journal-1")
    whole = scan_journal((tmp_path / "journal-1").read_bytes())
    assert whole.end == size and whole.damage is None         # cut back to the last whole record
    io.on = False
    m.put_start("r", [key(20)], [BLOCK])                      # writes the queued records, then its own
    assert m.put_end([key(20)], [20]) == 1
    clock.advance(10)
    m.expire()                                                # the revoked put's held extent is freed
    space = m.stats()["devices"]
    m._journal.close()                                        # kill -9
    m._journal = None
    r = Master(ManualClock(), tmp_path, high_watermark=1.0, low_watermark=1.0)
    assert r.stats()["devices"] == space                      # memory was what the journal replays to
    assert [b.key for b in r.lookup([key(i) for i in range(1, 6)])] == [key(i) for i in range(1, 6)]
    assert r.lookup([key(20)]) and not r.lookup([key(50)]) and not r.lookup([key(0)])
    r.close()


def test_a_timestamp_past_2_63_ms_rebases_instead_of_failing():
    clock = ManualClock()
    m = Master(clock)
    m.register_node(0, "tcp://x", [DEVICE])
    m.put_start("r", [key(1)], [BLOCK])
    m.put_end([key(1)], [1])
    m.lookup([key(1)])
    clock.advance(2.0 ** 63 / 1000 * 4)
    assert [b.key for b in m.lookup([key(1)])] == [key(1)]
    assert m.put_start("r", [key(2)], [BLOCK])[0] is not None
    clock.advance(float("inf"))
    with pytest.raises(ChmError) as exc:
        m.lookup([key(1)])
    assert exc.value.errno == errno.EINVAL and "clock time inf" in str(exc.value)
