"""chm_mmap with several client processes and with processes that die or stop (issue 26): two clients see
each other's writes, a client killed while holding mappings leaves the device serving others, a client that
stops answering is cut off, and a killed device withdraws every mapping (SIGBUS, never a stale byte). Where
``inline`` is a parameter the child's mapping is also tried with CHM_MAP_INLINE (faults served by libchm's SIGBUS
handler in the faulting thread, which chains every SIGBUS it does not serve to the program's)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest

import libchm
from tests.emulator.serve.serving import ROOT, Server
from tests.libchm.test_mmap import PAGE, SMALL_DRAM, _unsupported

pytestmark = pytest.mark.skipif(_unsupported() is not None, reason=f"chm_mmap unsupported here: {_unsupported()}")
LENGTH = 1024 * PAGE


class Child:
    """tests/libchm/mmap_child.py in a process of its own, mapping [0, LENGTH) of the device."""

    def __init__(self, node: str, inline: bool = False, **env: str):
        env = {**env, "CHM_TEST_MAP_INLINE": "1"} if inline else env
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.libchm.mmap_child", node, str(LENGTH)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        assert self.proc.stdout.readline() == "ready\n", self.proc.stderr.read()

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def send(self, line: str) -> None:
        """A command whose answer is not awaited (the child stops or dies in it)."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


@pytest.fixture
def device(tmp_path):
    with Server(tmp_path, None, "--format", *SMALL_DRAM, "--map-lease-ms", "50", "--map-max-expired", "1") as srv:
        yield srv


def test_two_clients_see_each_others_writes(device):
    a, b = Child(device.node), Child(device.node, inline=True)  # the two modes side by side
    try:
        assert a.ask(f"write {5 * PAGE + 3} 0102030405") == "ok"
        assert a.ask("flush") == "ok"
        assert b.ask(f"read {5 * PAGE + 3} 5") == "0102030405"
        assert b.ask(f"write {9 * PAGE} aabb") == "ok"
        assert a.ask(f"read {9 * PAGE} 2") == "aabb"
    finally:
        a.close()
        b.close()


def test_client_killed_holding_mappings_leaves_the_device_serving(device):
    victim = Child(device.node)
    try:
        for i in range(0, 64):  # leases taken and acked, pages mapped (some writable: dirty frames it holds)
            assert victim.ask(f"write {i * PAGE} {i:02x}") == "ok"
        victim.proc.kill()
        victim.proc.wait()
    finally:
        victim.close()
    with libchm.Device(device.path) as dev:  # every page, more than DRAM holds: no frame stayed pinned
        view = dev.mmap(0, LENGTH)
        assert [view[i * PAGE] for i in range(64)] == list(range(64))
        assert all(view[i * PAGE] == 0 for i in range(64, 1024))
        assert dev.read(7 * PAGE, 1) == b"\x07"


def test_a_stalled_client_is_cut_off_and_others_are_served(device):
    stalled = Child(device.node, CHM_MAP_TEST_STALL_AT="3")
    try:
        assert stalled.ask(f"touch {0}") == "0" and stalled.ask(f"touch {PAGE}") == "0"
        stalled.send(f"touch {2 * PAGE}")  # its third lease: the process stops before it acks
        with libchm.Device(device.path) as dev:
            view = dev.mmap(0, LENGTH)
            deadline_passes = 0
            while dev.stats()["map_clients_cut_off"] == 0:  # the device's lease timer, not ours, decides
                deadline_passes += 1
                assert deadline_passes < 100_000, "the stalled client was never cut off"
            stats = dev.stats()
            assert stats["map_leases_expired"] >= 1
            assert [view[i * PAGE] for i in range(0, 1024, 3)] == [0] * 342  # others are served meanwhile
            os.kill(stalled.proc.pid, signal.SIGCONT)
            assert stalled.proc.stdout.readline().strip() == "0"  # its late install: still the page it asked for
            assert stalled.ask(f"syscall-read {3 * PAGE}") == f"errno {errno.EFAULT}"  # its next fault: refused
            assert stalled.ask(f"error {3 * PAGE}") == str(-errno.EPERM)
            stalled.send(f"touch {4 * PAGE}")
            assert stalled.proc.wait() == -signal.SIGBUS
    finally:
        stalled.close()


@pytest.mark.parametrize("inline", [False, True], ids=["handler-thread", "inline"])
def test_device_killed_withdraws_mappings(tmp_path, inline):
    with Server(tmp_path, None, "--format", *SMALL_DRAM) as srv:
        _kill_device_under(srv, inline)


def _kill_device_under(srv: Server, inline: bool = False) -> None:
    # faulthandler: the program's own SIGBUS handler, which an inline mapping's handler chains to
    child = Child(srv.node, inline, CHM_TEST_FAULTHANDLER="1")
    try:
        assert child.ask(f"write {PAGE} 2a") == "ok" and child.ask(f"read {PAGE} 1") == "2a"
        child.send("wait-device-death")
        srv.kill()
        err, ms = child.proc.stdout.readline().split()
        assert int(err) == -errno.ENODEV  # withdrawn: the measured delay `ms` is bench_libchm's figure
        assert child.ask(f"syscall-read {PAGE}") == f"errno {errno.EFAULT}"
        assert child.ask(f"populate {PAGE}") == str(-errno.ENODEV)  # an error returned, where a touch dies
        child.send(f"touch {PAGE}")  # the page it had mapped: SIGBUS, never the frozen byte
        assert child.proc.wait() == -signal.SIGBUS
        assert "Fatal Python error: Bus error" in child.proc.stderr.read()  # the program's handler had it
    finally:
        child.close()


@pytest.mark.parametrize("inline", [False, True], ids=["handler-thread", "inline"])
def test_a_media_error_is_populates_error_and_a_touchs_sigbus(tmp_path, inline):
    """A page whose media read fails: chm_map_populate returns -EIO (never SIGBUS in the caller), chm_map_error
    says so, the other pages are served, and a load of the page is SIGBUS."""
    media_error = ("--set", "faults.errno=EIO", "--set", "faults.ops=read", "--set", "faults.first_failing_op=1",
                   "--set", "faults.failing_ops=1000000")
    with Server(tmp_path, None, "--format", *SMALL_DRAM, *media_error) as srv:
        child = Child(srv.node, inline)
        try:
            assert child.ask(f"populate {6 * PAGE}") == str(-errno.EIO)
            assert child.ask(f"error {6 * PAGE}") == str(-errno.EIO) and child.ask(f"error {7 * PAGE}") == "0"
            with libchm.Device(srv.path) as dev:
                dev.write(7 * PAGE, b"\x33" * PAGE)  # a whole page written: in DRAM with no media read
            assert child.ask(f"read {7 * PAGE} 1") == "33"
            child.send(f"touch {6 * PAGE}")
            assert child.proc.wait() == -signal.SIGBUS
        finally:
            child.close()


def test_inline_faults_leave_syscalls_efault_until_touched(device):
    """CHM_MAP_INLINE: a syscall given a page not mapped yet fails (the kernel's access cannot raise SIGBUS in
    a handler), as chm_mmap(3) says; once a load has mapped the page, the same syscall reads it."""
    child = Child(device.node, inline=True)
    try:
        assert child.ask(f"syscall-read {7 * PAGE}") == f"errno {errno.EFAULT}"
        assert child.ask(f"touch {7 * PAGE}") == "0"
        assert child.ask(f"syscall-read {7 * PAGE}") == "wrote 1"
        assert child.ask(f"populate {8 * PAGE}") == "0"  # served in the calling thread: the kernel may read it
        assert child.ask(f"syscall-read {8 * PAGE}") == "wrote 1"
        assert child.ask(f"write {9 * PAGE + 1} 7f") == "ok"  # a first store: a write fault, admitted
        with libchm.Device(device.path) as dev:
            assert dev.read(9 * PAGE + 1, 1) == b"\x7f" and dev.stats()["map_write_faults"] == 1
    finally:
        child.close()


@pytest.mark.parametrize("inline", [False, True], ids=["handler-thread", "inline"])
def test_a_store_the_device_refuses_past_the_timeout_is_sigbus(tmp_path, inline):
    media_full = ("--set", "faults.errno=ENOSPC", "--set", "faults.ops=write", "--set", "faults.first_failing_op=1",
                  "--set", "faults.failing_ops=1000000")
    with Server(tmp_path, None, "--format", "--drain-timeout", "0", *SMALL_DRAM, *media_full) as srv:
        child = Child(srv.node, inline, CHM_MAP_WRITE_TIMEOUT_MS="200")
        try:
            assert child.ask(f"write {PAGE} 11") == "ok"  # admitted: nothing has failed yet
            with libchm.Device(srv.path) as dev:
                with pytest.raises(libchm.ChmError) as exc:
                    dev.flush()  # the media are full: from now on the device refuses writes (ENOSPC)
                assert exc.value.errno == errno.ENOSPC
            assert child.ask(f"read {PAGE} 1") == "11"  # loads are still served
            if not inline:  # (inline: a syscall on a page not mapped yet is EFAULT at once, device or not)
                assert child.ask(f"syscall-write {3 * PAGE}") == f"errno {errno.EFAULT}"  # held 200 ms, refused
                assert child.ask(f"error {3 * PAGE}") == str(-errno.ENOSPC) and child.ask(f"error {PAGE}") == "0"
                assert child.ask(f"populate {3 * PAGE}") == str(-errno.ENOSPC)
            child.send(f"write {5 * PAGE} 22")
            assert child.proc.wait() == -signal.SIGBUS  # a plain store gets SIGBUS, held 200 ms first
        finally:
            child.close()
