"""The device process: node lifecycle, the wire's validation, client reclaim."""

import errno
import os
import random
import signal
import stat
import time

import pytest

from driver.wire import NodeError, ffi, lib, node_path, read_node
from tests.driver.rawclient import RawClient
from tests.emulator.serve.serving import Server, unique_node


@pytest.fixture
def server(tmp_path):
    with Server(tmp_path / "media") as srv:
        yield srv


def test_wire_layout_is_the_headers():
    # One cache line per command; fields at the offsets the C compiler gave them.
    assert ffi.sizeof("struct chm_sqe") == 64
    assert ffi.sizeof("struct chm_cqe") == 32
    assert ffi.offsetof("struct chm_ring_ctl", "tail") == 64
    assert ffi.offsetof("struct chm_node", "server_sleeping") % 64 == 0
    opcodes = [getattr(lib, n) for n in dir(lib) if n.startswith("CHM_OP_") and n != "CHM_OP_MAX"]
    assert len(set(opcodes)) == len(opcodes) and 0 not in opcodes and max(opcodes) == lib.CHM_OP_MAX


def test_node_names_are_checked():
    assert str(node_path("chm0")) == "/dev/shm/chm0"
    with pytest.raises(NodeError) as exc:
        node_path("bad name")
    assert exc.value.errno == errno.EINVAL and "bad name" in str(exc.value)
    with pytest.raises(NodeError) as exc:
        node_path("/tmp/" + "x" * 120)
    assert exc.value.errno == errno.ENAMETOOLONG


def test_serve_publishes_a_private_node_and_removes_it(server):
    mode = os.stat(server.path).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(f"{server.path}.sock").st_mode) & 0o077 == 0
    info = read_node(server.node)
    assert info["server_pid"] == server.proc.pid
    assert info["policy"] == "hymcache" and info["capacity_bytes"] == 2 * 4 * 2**30 and info["clients"] == 0
    client = RawClient(server.node)
    assert read_node(server.node)["clients"] == 1
    client.close()
    rc, out, err = server.stop()
    assert rc == 0, err
    assert "node removed" in out
    assert not server.path.exists() and not os.path.exists(f"{server.path}.sock")
    with pytest.raises(NodeError) as exc:
        read_node(server.node)
    assert exc.value.errno == errno.ENODEV


def test_second_server_on_the_same_node_fails_clearly(server, tmp_path):
    second = Server(tmp_path / "media2", server.node, wait=False)
    out, err = second.proc.communicate(timeout=60)  # it exits by itself
    assert second.proc.returncode == 1
    assert f"already served by pid {server.proc.pid}" in err
    assert read_node(server.node)["server_pid"] == server.proc.pid  # no takeover


def test_stale_node_of_a_killed_server_is_replaced(tmp_path):
    node = unique_node("stale")
    first = Server(tmp_path / "media", node)
    first.kill()
    assert node_path(node).exists()  # left behind
    with pytest.raises(NodeError):
        read_node(node)  # but recognised as dead
    with Server(tmp_path / "media", node) as second:
        assert read_node(node)["server_pid"] == second.proc.pid
        rc, out, err = second.stop()
    assert "replacing stale device node" in err and str(first.proc.pid) in err


def test_garbage_in_the_submission_ring_gets_error_completions(server):
    victim = RawClient(server.node)
    pattern = bytes(random.Random(7).randrange(256) for _ in range(4096))
    victim.staging[:4096] = pattern
    bad = RawClient(server.node, entries=16)
    staging = bad.hdr.staging_bytes
    cap = read_node(server.node)["capacity_bytes"]
    rng = random.Random(1)
    E = errno
    cases = [
        (E.EINVAL, dict(opcode=0)),                                                # never valid
        (E.EINVAL, dict(opcode=lib.CHM_OP_MAX + 1)),                               # unknown
        (E.EINVAL, dict(opcode=255)),
        (E.ERANGE, dict(opcode=lib.CHM_OP_READ, addr=cap, len=4096)),              # past the end
        (E.ERANGE, dict(opcode=lib.CHM_OP_READ, addr=2**64 - 4096, len=4096)),     # wraps
        (E.EINVAL, dict(opcode=lib.CHM_OP_READ, addr=0, len=0)),                   # empty
        (E.EFAULT, dict(opcode=lib.CHM_OP_READ, addr=0, len=4096, buf_offset=staging)),        # beyond own buffer
        (E.EFAULT, dict(opcode=lib.CHM_OP_READ, addr=0, len=4096, buf_offset=staging - 100)),  # straddles its end
        (E.EFAULT, dict(opcode=lib.CHM_OP_READ, addr=0, len=4096, buf_offset=2**64 - 1)),       # wraps
        (E.EFAULT, dict(opcode=lib.CHM_OP_WRITE, addr=0, len=staging + 4096, buf_offset=0)),   # longer than buffer
        (E.EINVAL, dict(opcode=lib.CHM_OP_WRITE, addr=0, len=16, buf_offset=0, flags=1)),      # reserved bits
        (E.EINVAL, dict(opcode=lib.CHM_OP_WRITE, addr=0, len=16, buf_offset=0, rsvd2=5)),
        (E.EINVAL, dict(opcode=lib.CHM_OP_WAIT, handle=12345)),                    # nobody's handle
        (E.EINVAL, dict(opcode=lib.CHM_OP_RELEASE, handle=-3)),
        (E.ERANGE, dict(opcode=lib.CHM_OP_PREFETCH, addr=0, len=2**63)),           # larger than the device
        (E.ENOSPC, dict(opcode=lib.CHM_OP_STATS_JSON, len=8, buf_offset=0)),       # does not fit
    ]
    for i, (err, fields) in enumerate(cases):
        bad.push(user_data=i + 1, **fields)
        assert bad.reap(1) == [(i + 1, -err)], fields
    # Random bytes in whole entries, several at once.
    for round_ in range(6):
        for k in range(8):
            bad.raw_slot(bad.tail + k)[:] = bytes(rng.randrange(256) for _ in range(64))
        bad.publish(bad.tail + 8)
        results = bad.reap(8)
        # A random entry that happens to be valid may succeed; most must fail, and none may crash the device.
        assert sum(res < 0 for _, res in results) >= 6
    # A tail further ahead than the ring holds: one -EPROTO, then the ring works again.
    bad.publish(bad.tail + 1000)
    (_, res), = bad.reap(1)
    assert res == -errno.EPROTO
    bad.push(user_data=99, opcode=lib.CHM_OP_NOP)
    assert bad.reap(1) == [(99, 0)]
    # The other client's buffer is untouched and it is still served.
    assert bytes(victim.staging[:4096]) == pattern
    victim.push(user_data=5, opcode=lib.CHM_OP_WRITE, addr=1 << 20, len=4096, buf_offset=0)
    victim.push(user_data=6, opcode=lib.CHM_OP_READ, addr=1 << 20, len=4096, buf_offset=8192)
    assert victim.reap(2) == [(5, 4096), (6, 4096)]
    assert bytes(victim.staging[8192:12288]) == pattern
    assert server.proc.poll() is None
    bad.close()
    victim.close()


def test_handles_belong_to_their_client_and_are_reclaimed(server):
    a, b = RawClient(server.node), RawClient(server.node)
    a.push(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=1 << 20)
    (_, handle), = a.reap(1)
    assert handle > 0
    b.push(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1)
    b.push(user_data=3, opcode=lib.CHM_OP_RELEASE, handle=handle)
    assert b.reap(2) == [(2, -errno.EINVAL), (3, -errno.EINVAL)]

    def held() -> int:
        b.push(user_data=4, opcode=lib.CHM_OP_STATS_JSON, len=65536, buf_offset=0)
        (_, n), = b.reap(1)
        import json
        return json.loads(bytes(b.staging[:n]))["prefetch_pages_held"]

    assert held() == 16
    a.sock.close()  # as a SIGKILL would: the connection drops, the queue pair is reclaimed
    deadline = time.monotonic() + 10
    while held() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held() == 0
    assert read_node(server.node)["clients"] == 1
    b.close()


def test_attach_requests_are_checked(server):
    for entries, staging in ((3, 4096), (1, 4096), (8192, 4096), (16, 0), (16, 2**40)):
        c = RawClient(server.node, entries=entries, staging=staging)
        assert c.status == -errno.EINVAL, (entries, staging)
        c.sock.close()
    assert RawClient(server.node).status == 0


def test_idle_server_sleeps(server):
    def cpu_seconds() -> float:
        fields = open(f"/proc/{server.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(0.3)
    before, t0 = cpu_seconds(), time.monotonic()
    time.sleep(1.5)
    used = cpu_seconds() - before
    assert used < 0.02 * (time.monotonic() - t0), f"idle chm serve used {used:.3f} s of CPU"


def _first_sleep_after_s(node_path_, limit_s: float = 0.05) -> float:
    """Seconds until the device's server_sleeping flag first reads 1 (sampled in a tight loop)."""
    import mmap
    import struct

    offset = ffi.offsetof("struct chm_node", "server_sleeping")
    fd = os.open(node_path_, os.O_RDONLY)
    try:
        with mmap.mmap(fd, ffi.sizeof("struct chm_node"), prot=mmap.PROT_READ) as m:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < limit_s:
                if struct.unpack_from("<I", m, offset)[0]:
                    return time.perf_counter() - t0
    finally:
        os.close(fd)
    return limit_s


def test_the_device_stays_awake_a_while_after_a_staged_wait(server):
    # The staged object's reads usually follow (a KV Manager stages, its worker reads): the device spins
    # STAGED_SPIN_NS (0.5 ms) after answering the wait instead of spin_us (50 us), so they need no wake-up.
    import libchm

    with libchm.Device(server.path, staging_bytes=1 << 20) as dev:
        dev.write(0, b"x" * 4096)
        after_wait, after_read = [], []
        for _ in range(7):
            h = dev.prefetch(0, 4096)
            dev.wait(h, timeout_ms=10_000)
            after_wait.append(_first_sleep_after_s(server.path))
            dev.read(0, 4096)
            after_read.append(_first_sleep_after_s(server.path))
            dev.release(h)
    # The sampling starts when wait() has returned here: a test process that loses its core meanwhile starts
    # late and sees the device asleep early, and a device that shares its core yields its spin early (by
    # design), so one wait of the seven must show the longer spin (without it none does: 10-44 us each).
    assert min(after_read) < 0.05, after_read  # the device then sleeps as usual
    assert max(after_wait) >= 0.3e-3, f"the device slept {[f'{t * 1e6:.0f}' for t in sorted(after_wait)]} us " \
                                      "after staged waits"


def test_the_spin_after_a_staged_wait_ends_and_never_starts_with_spin_us_0():
    import types

    from emulator.serve.server import STAGED_SPIN_NS, DeviceServer, ManualClock

    clock = ManualClock()
    srv = types.SimpleNamespace(spin_ns=50_000, _staged_spin_until=0, clock=clock)
    assert DeviceServer._spin_ns(srv) == 50_000
    DeviceServer._staged(srv)
    assert DeviceServer._spin_ns(srv) == STAGED_SPIN_NS
    clock.advance(0.5 * STAGED_SPIN_NS / 1e9)
    assert DeviceServer._spin_ns(srv) == 0.5 * STAGED_SPIN_NS  # what is left of it
    clock.advance(STAGED_SPIN_NS / 1e9)  # past: back to spin_us, and forgotten
    assert DeviceServer._spin_ns(srv) == 50_000 and srv._staged_spin_until == 0
    srv.spin_ns = 0  # --spin-us 0: never spins, not even after a staged wait
    DeviceServer._staged(srv)
    assert DeviceServer._spin_ns(srv) == 0


def test_sigterm_with_a_client_attached_still_exits(server):
    c = RawClient(server.node)
    c.push(user_data=1, opcode=lib.CHM_OP_NOP)
    assert c.reap(1) == [(1, 0)]
    rc, out, err = server.stop(signal.SIGTERM)
    assert rc == 0, err
    c.close()


def test_pacing_holds_completions_until_modelled_time(tmp_path):
    # Pacing: a prefetch staged from SSDs with 0.3 s of modelled read latency completes its wait
    # no earlier than 0.3 s of wall time later (a lower bound: load can only make it later).
    with Server(tmp_path / "media", None, "--pace", "--set", "ssd.read_latency_ns=3e8") as srv:
        assert read_node(srv.node)["pacing"] is True
        c = RawClient(srv.node)
        t0 = time.monotonic()
        c.push(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=65536)
        (_, handle), = c.reap(1)
        c.push(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1)
        assert c.reap(1) == [(2, 0)]
        assert time.monotonic() - t0 >= 0.3
        c.close()


def test_a_silent_connection_does_not_hold_up_others(server):
    import socket

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(f"{server.path}.sock")
    silent.sendall(b"\x01\x02\x03")  # a third of nothing useful
    c = RawClient(server.node)  # attaches while the other handshake hangs
    c.push(user_data=1, opcode=lib.CHM_OP_NOP)
    assert c.reap(1) == [(1, 0)]
    silent.settimeout(10)
    assert silent.recv(16) == b""  # dropped after the attach timeout
    c.close()
    silent.close()
