"""The device process: node lifecycle, the wire's validation, client reclaim."""

import errno
import os
import random
import signal
import stat

import pytest

from driver.wire import NodeError, ffi, lib, node_path, read_node
from tests.driver.rawclient import RawClient, device_barrier, wait_device_asleep
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
    device_barrier(server.node)  # the device has seen the close
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
    # Asleep in poll(), not spinning: its CPU use over a wall-clock second is bench_fairness.py's check.
    c = RawClient(server.node)
    c.push(user_data=1, opcode=lib.CHM_OP_NOP)
    assert c.reap(1) == [(1, 0)]
    wait_device_asleep(server.node)
    c.close()
    wait_device_asleep(server.node)


# How long the device stays awake after a staged wait, in wall time, is bench_fairness.py's check; here the
# spin's length on the injected clock.
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


def test_pacing_serves_a_wait_at_its_modelled_time(tmp_path):
    # A prefetch staged from SSDs with 0.3 s of modelled read latency completes its wait at 0.3 s of device
    # time or later. That the answer also waits 0.3 s of wall time is bench_fairness.py's check (and, on the
    # injected clock, the test below).
    with Server(tmp_path / "media", None, "--pace", "--set", "ssd.read_latency_ns=3e8") as srv:
        assert read_node(srv.node)["pacing"] is True
        c = RawClient(srv.node)
        c.push(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=65536)
        (_, handle), = c.reap(1)
        c.push(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1)
        assert c.reap(1) == [(2, 0)]
        assert c.cq[(c.head - 1) % c.cq_entries].clock_ns >= 3e8
        c.close()


def test_pacing_holds_a_completion_until_the_clock_reaches_its_modelled_finish(tmp_path):
    import mmap
    import types

    from emulator import load_profile
    from emulator.serve.server import DeviceServer, ManualClock, ffi as srv_ffi, lib as srv_lib

    clock = ManualClock(start_ns=10**9)
    srv = DeviceServer(load_profile("small"), tmp_path / "media", node=unique_node("pace"), pacing=True,
                       log=lambda _: None, format_media=True, clock=clock)
    offsets = srv_ffi.new("uint64_t[4]")
    ring = mmap.mmap(-1, srv_lib.chm_srv_qp_layout(16, 16, 4096, offsets + 0, offsets + 1, offsets + 2, offsets + 3))
    base = srv_ffi.from_buffer(ring)
    qp = srv_ffi.new("struct chm_srv_qp *")
    srv_lib.chm_srv_qp_init(qp, base, 1, 16, 16, 4096)
    hdr = srv_ffi.cast("struct chm_qp_hdr *", base)
    client = types.SimpleNamespace(id=1, clock=0.0, srv=qp)  # what completing and posting look at
    srv.clients[client.id] = client
    try:
        srv._complete(client, 7, 0.0, 0, 3e8)  # it finishes 0.3 s of device time from the clock's origin
        srv._post_due()
        assert hdr.cq.tail == 0 and qp.held == 1
        clock.advance(0.3 - 1e-6)
        srv._post_due()
        assert hdr.cq.tail == 0
        clock.advance(1e-6)
        srv._post_due()
        assert hdr.cq.tail == 1 and qp.held == 0
        cqe = srv_ffi.cast("struct chm_cqe *", base + offsets[1])[0]
        assert (cqe.user_data, cqe.res, cqe.clock_ns) == (7, 0, 3e8)
    finally:
        del srv.clients[client.id]
        srv.shutdown()
        del base
        ring.close()


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
