"""Rows of issue #9's adversarial table that had no test of their own (issue #21, item 5), and the issue #21
client-side defects they showed: a client at its own fd limit, and a block that can never be staged."""

import errno
import json
import os
import subprocess
import sys
import tracemalloc
import types
from array import array

import pytest
import xxhash

import libchm
from emulator.config import load_profile
from emulator.controller import Controller, sequential_ops
from emulator.media import media_file
from host_runtime.hymcache.clock import ManualClock
from host_runtime.hymcache.manager import KVManager
from host_runtime.hymcache.master import Master
from host_runtime.hymcache.messages import KEY_BYTES
from host_runtime.hymcache.sim.tiers import ControllerDevice, sim_manager
from libchm import ChmError, Device
from tests.emulator.serve.serving import ROOT, Server

PAGE = 64 << 10
WINDOW = 4 * PAGE                 # a prefetch window of 4 pages: a 6-page block can never be staged
BIG = 6 * PAGE


# ---- EMFILE, the client side ----------------------------------------------------------------------

def test_a_client_at_its_own_fd_limit_gets_emfile_naming_the_limit_and_leaks_no_fd(served):
    # Attaching needs 3 free fds (control socket, queue pair, doorbell). With 1 or 2 the kernel cannot
    # install the fds the server sends (MSG_CTRUNC): that was EPROTO "driver protocol mismatch".
    proc = subprocess.run([sys.executable, "-c", f"""
import errno, os, resource
from libchm import ChmError, Device, ffi, lib

def fds():
    return len(os.listdir("/proc/self/fd")) - 1

Device({served.node!r}).close()  # everything a first open loads, loaded
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
limit = fds() + 32
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:
    assert exc.errno == errno.EMFILE
out = ffi.new("chm_dev **")
for free in (0, 1, 2):
    for _ in range(free):
        os.close(filler.pop())
    before = fds() if free else None
    assert lib.chm_open({served.node!r}.encode(), out) == -errno.EMFILE, free
    try:
        Device({served.node!r})
        raise AssertionError("opened with %d free fds" % free)
    except ChmError as exc:
        assert exc.errno == errno.EMFILE, (free, exc)
        assert "open-file limit" in exc.message and f"RLIMIT_NOFILE soft limit {{limit}}" in exc.message, exc.message
    if free:
        assert fds() == before, (free, before, fds())  # no fd of the failed attach left behind
    filler += [os.open("/dev/null", os.O_RDONLY) for _ in range(free)]
os.close(filler.pop()); os.close(filler.pop()); os.close(filler.pop())
with Device({served.node!r}) as d:  # 3 free: attached
    d.write(0, b"fits")
    assert d.read(0, 4) == b"fits"
print("ok")
"""], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stdout}{proc.stderr[-3000:]}"
    assert proc.stdout.strip() == "ok"


def test_strerror_of_emfile_names_the_limit():
    text = libchm.ffi.string(libchm.lib.chm_strerror(-errno.EMFILE)).decode()
    assert "RLIMIT_NOFILE" in text and "3 free fds" in text


# ---- a block that can never be staged ----------------------------------------------------------------

def stored_block(master: Master, write, size: int) -> tuple[bytes, bytes]:
    """One block of ``size`` bytes put through the Master; ``write(offset, data)`` puts the bytes on the device."""
    key, data = os.urandom(KEY_BYTES), os.urandom(size)
    loc, = master.put_start(f"put-{key.hex()}", [key], [size])
    write(loc.offset, data)
    assert master.put_end([key], [xxhash.xxh3_64_intdigest(data)]) == 1
    return key, data


def assert_served_unstaged(mgr: KVManager, key: bytes) -> None:
    assert mgr.hint("req", [key]) == 1
    stats = mgr.stats()
    assert (stats["unfit"], stats["num_load_errors"], stats["prefetches"]) == (1, 0, 0), stats
    token = mgr.acquire("req", key, timeout_s=0)
    assert (token.length, token.handle) == (BIG, 0)  # handed out without a prefetch handle


def test_a_block_larger_than_the_prefetch_window_is_served_unstaged_by_a_served_device(tmp_path):
    # Issue #21: a 96 MiB block beside a 64 MiB window was a load error on every load (the Manager looked
    # for the in-process message's words). Scaled down: 6 pages beside 4.
    with Server(tmp_path / "m", None, "--set", f"policy.prefetch_window_bytes={WINDOW}") as srv:
        clock = ManualClock()
        master = Master(clock)
        with KVManager(0, [srv.node], master, clock) as mgr, Device(srv.node) as probe:
            key, data = stored_block(master, probe.write, BIG)
            with pytest.raises(ChmError) as exc:  # the binding names the limit
                probe.prefetch(0, BIG)
            assert exc.value.errno == errno.EINVAL
            assert f"spans 6 pages of {PAGE} bytes: it can never fit this handle's prefetch limit of 4 pages " \
                   f"({WINDOW} bytes" in exc.value.message and f"prefetch window of {WINDOW} bytes" in exc.value.message
            assert_served_unstaged(mgr, key)
            assert mgr.read("req", key).frames[0] == data  # the plain read path serves its bytes
            assert mgr.release("req", key) is False  # no prefetch handle to give back


def test_a_block_larger_than_the_prefetch_window_is_served_unstaged_in_process_too():
    cfg = load_profile("small").with_overrides({"policy.prefetch_window_bytes": WINDOW, "emulation.data": False})
    ctl = Controller(cfg, None)
    clock = ManualClock()
    master = Master(clock)
    mgr = sim_manager(0, [ControllerDevice(ctl, types.SimpleNamespace(now=0.0))], master, clock)
    with mgr:
        key, _ = stored_block(master, lambda offset, data: None, BIG)  # data off: the layout is all it keeps
        assert_served_unstaged(mgr, key)


class Terse:
    """A libchm handle whose errors say only their errno's name: whatever the words, the decision stands."""

    def __init__(self, dev: Device):
        self.dev = dev

    def prefetch(self, addr: int, size: int) -> int:
        try:
            return self.dev.prefetch(addr, size)
        except ChmError as exc:
            raise ChmError(exc.errno, errno.errorcode[exc.errno]) from None

    def __getattr__(self, name):
        return getattr(self.dev, name)


def test_a_block_beyond_this_handles_share_is_decided_from_numbers_not_words(tmp_path):
    # The window holds the block, this handle's share of it does not; and the error's words are not looked at.
    with Server(tmp_path / "m", None, "--set", f"policy.prefetch_window_bytes={4 * WINDOW}",
                "--set", "policy.prefetch_client_share=0.25") as srv:
        clock = ManualClock()
        master = Master(clock)
        with KVManager(0, [srv.node], master, clock, open_device=lambda path: Terse(Device(path))) as mgr, \
                Device(srv.node) as probe:
            assert probe.info()["prefetch_limit_pages"] == 4
            key, _ = stored_block(master, probe.write, BIG)
            assert_served_unstaged(mgr, key)


# ---- media truncated or deleted under a served device ------------------------------------------------

def test_media_truncated_or_deleted_under_chm_serve_is_eio_naming_the_file_and_the_device_serves_on(tmp_path):
    # The in-process rows are tests/emulator/test_media_integrity.py's; this is the client's view through libchm.
    media = tmp_path / "media"
    data = os.urandom(4 * PAGE)
    with Server(media) as srv, Device(srv.node) as d:
        d.write(0, data)
        d.write(8 * PAGE, data)
        d.flush()  # on the media, and out of the write buffer: the next reads go to the SSD files
        os.unlink(media_file(media, 1))  # deleted: the device still holds it open, its bytes stay readable
        os.truncate(media_file(media, 0), 0)
        results = {}
        for addr in (0, 8 * PAGE):  # one of them lies on ssd0 (the striping decides which)
            try:
                results[addr] = d.read(addr, len(data))
            except ChmError as exc:
                results[addr] = exc
        errors = [r for r in results.values() if isinstance(r, ChmError)]
        assert errors, results
        for exc in errors:
            assert exc.errno == errno.EIO and "ssd0.img" in exc.message, exc  # the device's words, via the binding
        assert all(r == data for r in results.values() if not isinstance(r, ChmError))
        d.write(16 * PAGE, b"still serving")
        assert d.read(16 * PAGE, 13) == b"still serving"
        assert d.stats()["read_failures"] >= 1
        with Device(srv.node) as other:  # and still attaching
            assert other.info()["clients"] == 2


# ---- stats() after 2 M operations ----------------------------------------------------------------------

def snapshot_cost(ctl: Controller) -> tuple[dict, int, int]:
    """``ctl.snapshot()`` (the served stats() is it plus the client's fields), its JSON size and its peak allocation."""
    tracemalloc.start()
    try:
        snap = ctl.snapshot()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return snap, len(json.dumps(snap)), peak


def test_stats_after_two_million_operations_cost_what_they_cost_after_a_tenth_of_them():
    cfg = load_profile("small").with_overrides({"emulation.data": False, "policy.name": "lru"})
    few, many = Controller(cfg, None), Controller(cfg, None)
    assert many.native_sequential_problem() is None  # 2 M operations in C: a second, not minutes
    kinds, _, _ = sequential_ops([("read", 0, 0)])
    n = 2_000_000
    addrs = array("Q", [(i % 4096) * PAGE for i in range(n)])
    few.run_sequential(kinds * (n // 10), addrs[:n // 10], array("Q", [4096]) * (n // 10))  # the same pages
    assert many.run_sequential(kinds * n, addrs, array("Q", [4096]) * n).native_ops == n
    (_, small_bytes, small_peak), (big, big_bytes, big_peak) = snapshot_cost(few), snapshot_cost(many)
    assert big["reads"] == n and big["latency"]["read"]["count"] == n
    assert big_bytes <= small_bytes + 64, (small_bytes, big_bytes)  # wider numbers, nothing more
    assert big_peak <= small_peak + 1024, (small_peak, big_peak)  # no per-operation state to walk
