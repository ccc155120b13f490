"""Rows of issue #9's adversarial table that had no test of their own (issue #21, item 5), and the issue #21
client-side defects they showed: a client at its own fd limit, and a block that can never be staged."""

import errno
import os
import subprocess
import sys
import types

import pytest
import xxhash

import libchm
from emulator.config import load_profile
from emulator.controller import Controller
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
