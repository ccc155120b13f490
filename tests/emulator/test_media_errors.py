"""Media errors in the emulator: every failed media completion is recorded and
raised with its errno and file; failed flushes keep their pages dirty in DRAM,
the device refuses writes with ENOSPC while the media fail, retries with a
wall-time backoff, and recovers; close is a bounded drain."""

import contextlib
import errno
import os

import pytest

from emulator import ChmError, Device, load_profile
from emulator import flusher as flusher_mod
from emulator.controller import UnflushedData
from emulator.flusher import MEDIA_RETRY_FIRST_S, MEDIA_RETRY_MAX_S
from emulator.ssd import MediaIOError, SsdBackend

from .conftest import KiB, TINY
from .media_trouble import DEVICE_WRITE_BYTES, MODES, MediaTrouble, MiB, read_media

FAIL_WRITES = {"faults.errno": "ENOSPC", "faults.ops": "write", "faults.first_failing_op": 1}


def test_failed_completions_mid_batch_are_recorded_and_nothing_hangs(media_dir):
    """Ops 3 and 4 of a batch of 8 fail: every completion is recorded, each failed token raises its own
    errno, file, offset and length, the others return their byte counts, and the ring ends empty."""
    cfg = load_profile("small").with_overrides({**TINY, "faults.errno": "EIO", "faults.ops": "any",
                                                "faults.first_failing_op": 3, "faults.failing_ops": 2})
    backend = SsdBackend(cfg, media_dir)
    buf = backend.ffi.new("char[]", 8 * 4 * KiB + 4 * KiB)
    base = (int(backend.ffi.cast("uintptr_t", buf)) + 4 * KiB - 1) // (4 * KiB) * (4 * KiB)
    tokens = [backend.submit(SsdBackend.WRITE, i % 2, (i // 2) * 4 * KiB, base + i * 4 * KiB, 4 * KiB) for i in range(8)]
    results = {}
    for token in reversed(tokens):  # the last first: the failures complete while waiting on others
        try:
            results[token] = backend.wait(token)
        except MediaIOError as exc:
            results[token] = exc
    for i, token in enumerate(tokens):
        if i in (2, 3):
            exc = results[token]
            assert isinstance(exc, ChmError) and exc.errno == errno.EIO
            assert f"ssd{i % 2}.img" in str(exc) and f"offset {(i // 2) * 4 * KiB}" in str(exc)
            assert "4096 bytes" in str(exc) and os.strerror(errno.EIO) in str(exc)
        else:
            assert results[token] == 4 * KiB
    assert backend._inflight == 0 and not backend._ops_of and not backend._results
    backend.wait_all()  # returns at once: nothing is left in flight
    for _ in range(3):  # the ring keeps working after errors (the old reap loop hung the 3rd flush)
        backend.wait(backend.submit(SsdBackend.WRITE, 0, 0, base, 4 * KiB))
    backend.close()


@pytest.mark.parametrize("mode", MODES)
def test_client_flush_on_full_media_keeps_data_refuses_writes_and_recovers(tmp_path, mode):
    """ENOSPC during a client's flush (fault hook, and a real full tmpfs): the client gets ENOSPC naming
    the file; nothing acknowledged is dropped (pages stay dirty, reads serve them from DRAM); new writes
    are refused with ENOSPC; the error is logged once; after space returns a flush lands everything."""
    logs = []
    with contextlib.ExitStack() as stack:
        trouble = MediaTrouble(mode, tmp_path, stack)
        dev = stack.enter_context(Device.open("small", trouble.media, overrides=trouble.overrides, log=logs.append))
        trouble.fill()
        data = os.urandom(DEVICE_WRITE_BYTES)
        for off in range(0, len(data), 4 * MiB):
            dev.write(off, data[off: off + 4 * MiB])
        with pytest.raises(ChmError) as exc:
            dev.flush()
        assert exc.value.errno == errno.ENOSPC
        assert "ssd" in str(exc.value) and ".img" in str(exc.value) and "not on the media" in str(exc.value)
        stats = dev.stats()
        assert stats["dirty_pages"] > 0 and stats["media_error"]["errno"] == errno.ENOSPC
        assert dev.read(0, len(data)) == data  # served from device DRAM
        with pytest.raises(ChmError) as refused:
            dev.write(len(data), b"more")
        assert refused.value.errno == errno.ENOSPC and "media are full" in str(refused.value)
        assert "writes resume when space returns" in str(refused.value)
        errors = [line for line in logs if line.startswith("media error")]
        assert len(errors) == 1 and os.strerror(errno.ENOSPC) in errors[0] and ".img" in errors[0]
        trouble.free_space()
        dev.flush()
        assert dev.stats()["dirty_pages"] == 0 and dev.stats()["media_error"] is None
        assert any(line.startswith("media recovered") for line in logs)
        dev.write(len(data), b"more")  # accepted again
        assert read_media(dev.config, trouble.media, 0, len(data)) == data
        dev.close()


def test_background_flush_errors_never_raise_and_retry_with_doubling_backoff(media_dir, monkeypatch):
    """The background flusher (tick) never raises for a media error; it retries after 1 s of wall time,
    doubling up to 30 s; a client's flush tries at once, ignoring the backoff."""
    clock = [1000.0]
    monkeypatch.setattr(flusher_mod.time, "monotonic", lambda: clock[0])
    logs = []
    dev = Device.open("small", media_dir, overrides={**TINY, **FAIL_WRITES, "faults.failing_ops": 10},
                      log=logs.append)
    ctl = dev.controller
    dev.write(0, b"x" * 8 * KiB)  # one 2-page run on ssd0: each flush attempt is one media write
    delays = []
    dev.idle(1e9)  # virtual time passes: the batch starts flushing
    for attempt in range(1, 8):
        dev.idle(1e9)  # the flush lands, failed: the backoff starts
        assert ctl.stats["flush_failures"] == attempt
        delays.append(ctl.flusher._retry_at - clock[0])
        dev.idle(1e9)
        dev.idle(1e9)
        assert ctl.stats["flush_failures"] == attempt and not ctl.flights, "no retry before the backoff has passed"
        clock[0] += delays[-1]
        dev.idle(1e9)  # the backoff has passed: the retry starts
        assert ctl.flights
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert (MEDIA_RETRY_FIRST_S, MEDIA_RETRY_MAX_S) == (1.0, 30.0)
    assert dev.stats()["dirty_pages"] == 0 and dev.read(0, 8 * KiB) == b"x" * 8 * KiB  # in flight, served from DRAM
    assert sum(line.startswith("media error") for line in logs) == 1  # once per episode
    for attempt in (8, 9, 10):  # a client's flush does not wait for the backoff
        with pytest.raises(ChmError) as exc:
            dev.flush()
        assert exc.value.errno == errno.ENOSPC and ctl.stats["flush_failures"] == attempt
        assert dev.stats()["dirty_pages"] == 2
    dev.flush()  # the hook's 10 failures are spent: the write lands
    assert dev.stats()["dirty_pages"] == 0 and dev.stats()["media_error"] is None
    assert sum(line.startswith("media recovered") for line in logs) == 1
    dev.close()


def test_client_flush_retries_at_once_and_lands(media_dir):
    dev = Device.open("small", media_dir, overrides={**TINY, **FAIL_WRITES, "faults.failing_ops": 2})
    dev.write(0, b"y" * 8 * KiB)
    for attempt in (1, 2):
        with pytest.raises(ChmError) as exc:
            dev.flush()
        assert exc.value.errno == errno.ENOSPC and dev.stats()["dirty_pages"] == 2
    dev.flush()
    assert dev.stats()["dirty_pages"] == 0 and dev.stats()["media_error"] is None
    assert read_media(dev.config, media_dir, 0, 8 * KiB) == b"y" * 8 * KiB
    dev.close()


def test_read_error_reaches_the_reader_names_the_file_and_a_later_read_retries(media_dir):
    data = os.urandom(16 * KiB)
    with Device.open("small", media_dir, overrides=TINY) as dev:
        dev.write(0, data)
    logs = []
    faults = {"faults.errno": "EIO", "faults.ops": "read", "faults.first_failing_op": 1, "faults.failing_ops": 1}
    with Device.open("small", media_dir, overrides={**TINY, **faults}, log=logs.append) as dev:
        with pytest.raises(ChmError) as exc:
            dev.read(0, len(data))
        assert exc.value.errno == errno.EIO and "ssd0.img" in str(exc.value) and "read" in str(exc.value)
        assert any("ssd0.img" in line for line in logs)
        assert dev.read(0, len(data)) == data  # the failed frame was dropped; the media are read again
        handle = dev.prefetch(0, 4 * KiB)
        dev.wait(handle)
        dev.release(handle)


def test_prefetch_wait_reports_a_failed_staging_read(media_dir):
    with Device.open("small", media_dir, overrides=TINY) as dev:
        dev.write(0, b"z" * 4 * KiB)
    faults = {"faults.errno": "EIO", "faults.ops": "read", "faults.first_failing_op": 1, "faults.failing_ops": 1}
    with Device.open("small", media_dir, overrides={**TINY, **faults}, log=lambda _: None) as dev:
        handle = dev.prefetch(0, 4 * KiB)
        with pytest.raises(ChmError) as exc:
            dev.wait(handle)
        assert exc.value.errno == errno.EIO
        dev.release(handle)
        assert dev.read(0, 4 * KiB) == b"z" * 4 * KiB


def test_close_is_a_bounded_drain_that_says_what_was_left(media_dir):
    dev = Device.open("small", media_dir, overrides={**TINY, **FAIL_WRITES, "faults.failing_ops": 1 << 40},
                      log=lambda _: None)
    dev.write(0, b"w" * 12 * KiB)
    with pytest.raises(UnflushedData) as exc:
        dev.close(drain_timeout_s=0)
    assert exc.value.errno == errno.ENOSPC and exc.value.pages == 3 and exc.value.nbytes == 12 * KiB
    assert "3 pages (12288 bytes)" in str(exc.value) and "ssd" in str(exc.value)
    with pytest.raises(ChmError) as closed:
        dev.read(0, 1)
    assert closed.value.errno == errno.ENODEV  # closed all the same
    logs = []
    with Device.open("small", media_dir, overrides=TINY, log=logs.append) as dev:  # not a clean shutdown
        assert dev.stats()["unclean_shutdown"] is True
        assert dev.read(0, 4) == bytes(4)
    assert any("unclean shutdown" in line for line in logs)


def test_close_retries_within_its_bound_and_succeeds(media_dir):
    dev = Device.open("small", media_dir, overrides={**TINY, **FAIL_WRITES, "faults.failing_ops": 1},
                      log=lambda _: None)
    dev.write(0, b"v" * 4 * KiB)
    dev.close(drain_timeout_s=MEDIA_RETRY_FIRST_S * 5)  # the first try fails, the retry after 1 s lands
    assert read_media(load_profile("small").with_overrides(TINY), media_dir, 0, 4 * KiB) == b"v" * 4 * KiB
    with Device.open("small", media_dir, overrides=TINY) as dev:
        assert dev.stats()["unclean_shutdown"] is False


@pytest.mark.parametrize("key,value,words", [
    ("faults.errno", "EPERM", ["faults.errno", "EPERM", "ENOSPC", "EIO"]),
    ("faults.ops", "erase", ["faults.ops", "erase", "write", "read", "any"]),
    ("faults.first_failing_op", -1, ["faults.first_failing_op", "-1", "out of range"]),
    ("faults.failing_ops", 0, ["faults.failing_ops", "0", "out of range"]),
])
def test_fault_fields_are_checked(key, value, words):
    from emulator import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_profile("small").with_overrides({key: value})
    for word in words:
        assert word in str(exc.value)


def test_faults_need_an_errno_and_are_off_by_default():
    from emulator import ConfigError

    cfg = load_profile("small")
    assert (cfg.faults.errno, cfg.faults.first_failing_op) == ("none", 0)
    with pytest.raises(ConfigError, match="faults.first_failing_op = 3 needs faults.errno"):
        cfg.with_overrides({"faults.first_failing_op": 3})


def test_lru_keeps_dirty_pages_in_dram_while_the_media_fail(media_dir):
    """lru: once a flush fails, every dirty page is held in DRAM -- also those not yet flushed, which an
    eviction would otherwise write back to the failing media and lose; when the media recover all lands."""
    dev = Device.open("small", media_dir, policy="lru",
                      overrides={**TINY, **FAIL_WRITES, "faults.failing_ops": 4, "policy.lru_writeback_delay_ns": 1e9},
                      log=lambda _: None)
    first, second = os.urandom(8 * KiB), os.urandom(8 * KiB)
    dev.write(0, first)
    dev.idle(1e9)  # the first write is due: its flush starts (and will fail)
    dev.write(64 * KiB, second)  # accepted: the failure is not known yet
    dev.idle(1e6)  # the flush lands, failed; the second write is not due yet
    assert dev.stats()["media_error"] is not None and dev.stats()["dirty_pages"] == 4
    for addr in range(128 * KiB, 512 * KiB, 4 * KiB):  # more pages than DRAM frames: evictions
        assert dev.read(addr, 4 * KiB) == bytes(4 * KiB)
    assert dev.stats()["lost_pages"] == 0
    assert dev.read(0, len(first)) == first and dev.read(64 * KiB, len(second)) == second
    for _ in range(4):  # the hook fails 4 media writes in all: some flushes fail, then one lands
        try:
            dev.flush()
            break
        except ChmError as exc:
            assert exc.errno == errno.ENOSPC
    assert dev.stats()["dirty_pages"] == 0
    assert read_media(dev.config, media_dir, 0, len(first)) == first
    assert read_media(dev.config, media_dir, 64 * KiB, len(second)) == second
    dev.close()


def test_writes_of_one_attempt_failing_one_by_one_back_off_once(media_dir, monkeypatch):
    """The backoff doubles per failed retry, not per failed media write: a batch whose writes fail one by
    one is one failure."""
    clock = [1000.0]
    monkeypatch.setattr(flusher_mod.time, "monotonic", lambda: clock[0])
    dev = Device.open("small", media_dir, policy="lru",
                      overrides={**TINY, **FAIL_WRITES, "faults.failing_ops": 1 << 40,
                                 "policy.lru_writeback_delay_ns": 1e6},
                      log=lambda _: None)
    ctl = dev.controller
    dev.write(0, os.urandom(64 * KiB))  # 8 stripes: 4 runs on each SSD
    dev.idle(2e6)  # due: the flushes start, queued on the two SSDs, landing one after another
    finishes = sorted(entry[0] for entry in ctl.flights)
    assert len(finishes) == 8 and finishes[0] < finishes[-1]
    for finish in finishes:  # each lands, failed, on a tick of its own
        dev.idle(max(0.0, finish - dev.clock_ns))
    assert ctl.stats["flush_failures"] == 8 and ctl.flusher._retry_delay_s == MEDIA_RETRY_FIRST_S
    with pytest.raises(UnflushedData):
        dev.close(drain_timeout_s=0)
