"""The device process under resource exhaustion: file descriptors, connection
floods, a full /dev/shm, and startup failures. It must never die of them, and
never leave its node and socket behind."""

import errno
import os
import resource
import shutil
import signal
import select
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from driver.wire import ffi, lib
from tests.driver.rawclient import RawClient
from tests.emulator.serve.serving import ROOT, Server, unique_node

FLOOD = 150
MAX_PENDING_ATTACHES = 64  # emulator/serve/connections.py; restated here as the number this test holds the device to


def flood(sock_path: str, n: int) -> list[socket.socket]:
    """Open n connections that never send anything, and return once the device has taken every one (those it
    refuses are dropped). A connect blocks while the listen backlog is full: until the device takes some."""
    conns = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 30, 0))  # a stuck device fails
        try:
            s.connect(sock_path)
        except ConnectionRefusedError:
            s.close()
            continue
        except FileNotFoundError:  # the socket is gone: the device died
            s.close()
            break
        s.setblocking(False)
        conns.append(s)
    if conns:  # accepted in order: once the device has closed the last (refused, or dropped as stalled), it has
        # taken them all. POLLRDHUP: the close itself, not the answer it may send first.
        last = select.poll()
        last.register(conns[-1], select.POLLRDHUP)
        assert last.poll(30_000), "the device never took the last connection"
    return conns


def closed_by_device(conns: list[socket.socket]) -> None:
    """Close ``conns`` and return once the device has closed its ends: each is half-closed, so the device
    reads EOF and closes, and this side then reads EOF too."""
    for s in conns:
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the device closed it already
            pass
    for s in conns:
        s.setblocking(True)
        s.settimeout(30)
        try:
            while s.recv(4096):  # an answer still unread, then the device's close
                pass
        except ConnectionResetError:
            pass
        s.close()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def attaches(node: str) -> None:
    c = RawClient(node)
    assert c.status == 0
    c.push(user_data=1, opcode=lib.CHM_OP_NOP)
    assert c.reap(1) == [(1, 0)]
    c.close()


def test_running_out_of_fds_does_not_kill_the_device(tmp_path):
    """The defect: under `prlimit --nofile`, silent connections made accept() fail with EMFILE, uncaught."""
    with Server(tmp_path / "media") as srv:
        base = open_fds(srv.proc.pid)
        spare = 6  # enough for one attach (its connection and queue pair memfd), far fewer than the flood
        resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (base + spare, base + spare))  # prlimit --nofile
        conns = flood(f"{srv.path}.sock", FLOOD)
        assert srv.proc.poll() is None, srv.proc.stderr.read()
        # Connections shed for want of an fd were told why before being closed.
        shed = 0
        for s in conns:
            try:
                msg = s.recv(ffi.sizeof("struct chm_attach_resp"))
            except BlockingIOError:
                continue
            if msg:
                assert ffi.cast("struct chm_attach_resp *", ffi.from_buffer(msg)).status == -errno.EMFILE
                shed += 1
        assert shed > 0
        closed_by_device(conns)  # the fds they held are free again
        attaches(srv.node)
        rc, _, err = srv.stop()
    assert rc == 0, err
    assert "out of file descriptors" in err
    assert err.count("out of file descriptors") <= 2  # rate-limited, not once per connection


def test_half_open_attaches_are_capped(tmp_path):
    with Server(tmp_path / "media") as srv:
        before = open_fds(srv.proc.pid)
        conns = flood(f"{srv.path}.sock", FLOOD)
        assert srv.proc.poll() is None
        held = open_fds(srv.proc.pid) - before
        assert held <= MAX_PENDING_ATTACHES, f"{held} connections held open for {len(conns)} silent ones"
        closed_by_device(conns)  # no attach is pending any more
        attaches(srv.node)
        rc, _, err = srv.stop()
    assert rc == 0, err
    assert f"{MAX_PENDING_ATTACHES} attach requests are already pending" in err


def test_startup_failure_leaves_no_node(tmp_path):
    media = tmp_path / "not-a-directory"
    media.write_text("")
    node = unique_node("fail")
    srv = Server(media, node, wait=False)
    out, err = srv.proc.communicate(timeout=60)
    assert srv.proc.returncode == 1, err
    assert "chm serve: error:" in err and "Traceback" not in err
    assert not srv.path.exists() and not Path(f"{srv.path}.sock").exists()


def test_sigint_removes_node_and_socket(tmp_path):
    with Server(tmp_path / "media") as srv:
        attaches(srv.node)
        rc, out, err = srv.stop(signal.SIGINT)
    assert rc == 0, err
    assert not srv.path.exists() and not Path(f"{srv.path}.sock").exists()


def _can_mount_private_shm() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_private_shm(), reason="needs root and mount namespaces (unshare -m)")
def test_a_full_dev_shm_is_a_clean_error(tmp_path):
    """The defect: with /dev/shm full the device died of SIGBUS, silently, leaving node and socket."""
    node = unique_node("full")
    script = (
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
        "(dd if=/dev/zero of=/dev/shm/fill bs=64k >/dev/null 2>&1; true) && "
        f'"$0" -m emulator.serve --node {node} --media {tmp_path / "media"}; '
        "echo status=$?; ls /dev/shm"
    )
    run = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert "status=1\n" in run.stdout, (run.stdout, run.stderr)
    assert run.stderr.startswith("chm serve: error:"), run.stderr
    assert f"cannot set up device node /dev/shm/{node}: No space left on device" in run.stderr
    assert run.stdout.split("status=1", 1)[1].split() == ["fill"]  # no node, no socket left
