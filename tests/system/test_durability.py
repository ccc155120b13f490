"""The durability contract, rule by rule, against real `chm serve` processes
and the Python binding of libchm (docs/durability.md, "Durability contract").

Writes are held in the write buffer (huge flush batch and delay) wherever a
rule is about what is and is not yet on the media."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time

import pytest

from emulator.config import load_profile
from libchm import ChmError, Device
from tests.emulator.serve.serving import Server
from tests.emulator.media_trouble import DEVICE_WRITE_BYTES, FAULT_OVERRIDES, HOLD_WRITES, MODES, MediaTrouble, read_media

CFG = load_profile("small")


def sets(overrides: dict) -> list[str]:
    args = []
    for key, value in overrides.items():
        args += ["--set", f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"]
    return [a.replace("'", '"') for a in args]


HOLD = sets(HOLD_WRITES)


def wait_for(predicate, what: str, timeout: float = 30.0):
    """Poll a device served by another process for a state its background flusher reaches on its own wall clock
    (a retry backs off 1 s, doubling): that clock is the behaviour under test, so the wait is a poll."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)  # the poll's interval (see above): the device's own clock is what is under test
    raise AssertionError(f"timed out waiting for {what}")


def test_write_returning_means_in_device_dram_visible_to_all_not_yet_durable(tmp_path):
    media = tmp_path / "media"
    data = os.urandom(1 << 20)
    with Server(media, None, *HOLD) as srv, Device(srv.node) as writer, Device(srv.node) as reader:
        writer.write(7 << 20, data)
        assert reader.read(7 << 20, len(data)) == data  # another client sees it at once
        assert reader.stats()["dirty_pages"] == len(data) // CFG.device.page_size_bytes
        assert read_media(CFG, media, 7 << 20, len(data)) == bytes(len(data))  # not on the media yet


def test_flush_returning_means_on_the_media_and_survives_kill9(tmp_path):
    media = tmp_path / "media"
    data = os.urandom(3 << 20)
    with Server(media, None, *HOLD) as srv:
        with Device(srv.node) as d:
            d.write(5 << 20, data)
            d.flush()
            assert read_media(CFG, media, 5 << 20, len(data)) == data  # in the files when flush returns
        node = srv.node
        srv.kill()
    with Server(media, node) as srv, Device(node) as d:
        assert d.read(5 << 20, len(data)) == data


def test_kill9_may_lose_acknowledged_unflushed_writes_and_restart_reports_it(tmp_path):
    media = tmp_path / "media"
    flushed, unflushed = os.urandom(1 << 20), os.urandom(1 << 20)
    with Server(media, None, *HOLD) as srv:
        with Device(srv.node) as d:
            d.write(0, flushed)
            d.flush()
            d.write(32 << 20, unflushed)  # acknowledged, then the device dies
        epoch = Device(srv.node).info()["device_epoch"]
        node = srv.node
        srv.kill()
    with Server(media, node) as srv:
        with Device(node) as d:
            assert d.stats()["unclean_shutdown"] is True
            assert d.info()["device_epoch"] == epoch  # same media, same epoch
            assert d.read(0, len(flushed)) == flushed
            assert d.read(32 << 20, len(unflushed)) == bytes(len(unflushed))  # lost
        rc, _, err = srv.stop()
    assert rc == 0 and "unclean shutdown: writes acknowledged but not flushed before it may be lost" in err


def test_sigterm_drains_everything_acknowledged(tmp_path):
    media = tmp_path / "media"
    data = os.urandom(2 << 20)
    with Server(media, None, *HOLD) as srv:
        with Device(srv.node) as d:
            d.write(100 << 20, data)
            assert d.stats()["dirty_pages"] > 0
        rc, out, err = srv.stop(signal.SIGTERM)
    assert rc == 0, err
    assert "write buffer drained" in out
    assert read_media(CFG, media, 100 << 20, len(data)) == data
    with Server(media) as srv, Device(srv.node) as d:
        assert d.stats()["unclean_shutdown"] is False


def test_sigterm_drain_cut_short_by_drain_timeout_says_what_was_left(tmp_path):
    media = tmp_path / "media"
    failing = sets({**FAULT_OVERRIDES, "faults.failing_ops": 1 << 40})
    with Server(media, None, *HOLD, *failing, "--drain-timeout", "0.5") as srv:
        with Device(srv.node) as d:
            d.write(0, os.urandom(1 << 20))  # 16 pages of 64 KiB
        rc, out, err = srv.stop(signal.SIGTERM, timeout=60)
    assert rc == 1, (out, err)
    assert "chm serve: error: [ENOSPC] node removed; write buffer NOT fully drained" in err
    assert "16 pages (1048576 bytes)" in err and "ssd0.img" in err
    assert not (tmp_path / "media").joinpath("chm.meta").read_bytes()[12]  # not marked clean
    with Server(media) as srv:
        rc, _, err = srv.stop()
    assert "unclean shutdown" in err


@pytest.mark.parametrize("mode", MODES)
def test_full_media_refuse_writes_serve_reads_keep_data_and_recover(tmp_path, mode):
    """ENOSPC on a client's flush: the client gets ENOSPC naming the file, the server logs it and keeps
    serving reads, refuses new writes with ENOSPC, drops nothing; once space returns a flush lands it all."""
    with contextlib.ExitStack() as stack:
        trouble = MediaTrouble(mode, tmp_path, stack)
        srv = stack.enter_context(Server(trouble.media, None, *sets(trouble.overrides)))
        trouble.fill()
        data = os.urandom(DEVICE_WRITE_BYTES)
        with Device(srv.node) as d:
            d.write(0, data)
            with pytest.raises(ChmError) as exc:
                d.flush()
            assert exc.value.errno == errno.ENOSPC
            stats = d.stats()
            assert stats["dirty_pages"] > 0 and stats["media_error"]["errno"] == errno.ENOSPC
            assert ".img" in stats["media_error"]["message"]
            with Device(srv.node) as other:
                assert other.read(0, len(data)) == data  # nothing acknowledged is dropped
                with pytest.raises(ChmError) as refused:
                    other.write(len(data), b"more")
                assert refused.value.errno == errno.ENOSPC
            trouble.free_space()
            d.flush()
            assert d.stats()["dirty_pages"] == 0 and d.stats()["media_error"] is None
            d.write(len(data), b"more")
        assert read_media(CFG, trouble.media, 0, len(data)) == data
        rc, _, err = srv.stop()
    assert rc == 0, err
    assert err.count("media error: media write") == 1 and "No space left on device" in err
    assert "media recovered" in err


@pytest.mark.parametrize("mode", MODES)
def test_background_flush_error_never_ends_serve_and_retries_until_space_returns(tmp_path, mode):
    with contextlib.ExitStack() as stack:
        trouble = MediaTrouble(mode, tmp_path, stack)
        overrides = {} if mode == "tmpfs" else {**FAULT_OVERRIDES, "faults.failing_ops": 3}
        srv = stack.enter_context(Server(trouble.media, None, *sets(overrides)))
        trouble.fill()
        data = os.urandom(32 << 20)  # more than the 24 MiB the filler leaves
        with Device(srv.node) as d:
            written = 0
            while written < len(data):
                try:
                    d.write(written, data[written: written + (4 << 20)])
                    written += 4 << 20
                except ChmError as exc:  # EAGAIN (buffer full) or ENOSPC (media full): retry later
                    assert exc.errno in (errno.EAGAIN, errno.ENOSPC)
                    if exc.errno == errno.ENOSPC or mode == "faults":
                        break
                    os.sched_yield()  # the flusher drains the buffer meanwhile; no timing here
            wait_for(lambda: d.stats()["media_error"], "the background flush to fail")
            assert srv.proc.poll() is None  # serve goes on
            assert d.read(0, written) == data[:written]
            trouble.free_space()
            wait_for(lambda: d.stats()["media_error"] is None and d.stats()["dirty_pages"] == 0,
                     "the retry to land the write buffer", timeout=60)
            d.flush()
        assert read_media(CFG, trouble.media, 0, written) == data[:written]
        rc, _, err = srv.stop()
    assert rc == 0 and "media error" in err and "media recovered" in err


def test_read_error_reaches_the_client_with_eio(tmp_path):
    media = tmp_path / "media"
    data = os.urandom(1 << 20)
    with Server(media) as srv, Device(srv.node) as d:
        d.write(0, data)
        d.flush()
    read_faults = sets({"faults.errno": "EIO", "faults.ops": "read", "faults.first_failing_op": 1,
                        "faults.failing_ops": 1})
    with Server(media, None, *read_faults) as srv:
        with Device(srv.node) as d:
            with pytest.raises(ChmError) as exc:
                d.read(0, len(data))
            assert exc.value.errno == errno.EIO
            assert d.read(0, len(data)) == data  # retried on the media
        rc, _, err = srv.stop()
    assert rc == 0 and "media error on a staging read" in err and "ssd0.img" in err
