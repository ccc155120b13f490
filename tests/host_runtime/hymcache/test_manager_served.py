"""The KV Manager over ZeroMQ, started as ``chm hymcache manager`` starts it (start_manager): the local
(libchm) and remote (ZeroMQ) read paths, the remote write path, a disconnected worker's requests cancelled,
and acquires held by the server while their block stages from a slow disk."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading

import pytest
import xxhash

import libchm
from bench.bench_manager import measure_block_paths
from driver.errors import ChmError
from host_runtime.hymcache.clock import ManualClock, WallClock
from host_runtime.hymcache.manager import ManagerClient, ManagerOptions, start_manager
from host_runtime.hymcache.master import Master, MasterClient
from tests.emulator.media_trouble import DEVICE_WRITE_BYTES, FAULT_OVERRIDES, HOLD_WRITES
from tests.emulator.serve.serving import ROOT, Server

from .manager_pieces import BLOCK, PAGE, LogWatch, RecordingMaster, pages_held, store, when_held


@pytest.fixture
def served(two_devices):
    """``setup``'s pieces, the Manager started as ``chm hymcache manager`` starts it, served from a thread."""
    clock = ManualClock()
    master = RecordingMaster(Master(clock))
    log = LogWatch()
    options = ManagerOptions(node=0, devices=[s.node for s in two_devices], window_bytes=3 * BLOCK)
    with start_manager(options, master=master, clock=clock, log=log) as running:
        running.serve_in_background()
        yield master, running.manager, {i: str(s.path) for i, s in enumerate(two_devices)}, running, log


MASTER = """
from host_runtime.hymcache.master import run_master
run_master("tcp://127.0.0.1:0", None)
"""

MANAGER = """
import sys
from host_runtime.hymcache.manager import run_manager
sys.exit(run_manager(0, sys.argv[3:], sys.argv[1], "tcp://127.0.0.1:0", window_bytes=int(sys.argv[2]),
                     on_ready=lambda endpoint: print("ready", endpoint, flush=True)))
"""


def spawn(args: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    """A process of this test; waits for its line starting with ``ready`` and returns its last word."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    line = proc.stdout.readline()
    if not line.startswith(ready):
        proc.kill()
        raise AssertionError(f"{args[:2]} did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split()[-1]


def test_local_and_remote_workers_read_identical_bytes(two_devices):
    """Processes: a Master, the node's Manager (run_manager) on two devices; this process is both a worker on
    the devices' machine (libchm) and a "remote" one (bytes through the Manager over ZeroMQ)."""
    master_proc, master_ep = spawn(["-c", MASTER], "master: serving on")
    manager_proc = None
    try:
        manager_proc, manager_ep = spawn(["-c", MANAGER, master_ep, str(2 * BLOCK), *[s.node for s in two_devices]],
                                         "ready")
        with MasterClient(master_ep) as master:
            node = master.nodes()[0]
            assert node["endpoint"] == manager_ep
            paths = {d.device: d.node_path for d in node["devices"]}
            assert sorted(paths.values()) == sorted(str(s.path) for s in two_devices)
            stored = [store(master, paths, 6, tag=str(i)) for i in range(2)]
        assert {next(iter(devs)) for _, _, devs in stored} == {0, 1}  # one request per device, round robin
        for keys, data, (device,) in stored:
            with ManagerClient(manager_ep) as remote, ManagerClient(manager_ep) as here, \
                    libchm.Device(paths[device]) as local:
                assert remote.devices() == node["devices"]  # what it registered, over ZeroMQ too
                before = local.stats()["prefetches"]
                assert remote.hint("remote", keys) == 6 and here.hint("local", keys) == 6
                with MasterClient(master_ep) as mc:  # bytes over ZeroMQ need the Master's lease (auth.py)
                    assert remote.lease("remote", mc.lookup(keys, request_id="remote")) == 6
                assert local.stats()["prefetches"] - before == 4  # two windows of 2 blocks
                for key, block in zip(keys, data):
                    token, frame = remote.read("remote", key)
                    local_token = here.acquire("local", key)
                    assert (local_token.offset, local_token.length, local_token.checksum) == \
                        (token.offset, token.length, token.checksum)
                    view = local.buffer()[:token.length]
                    local.read_into(token.offset, view)  # zero-copy into its staging buffer
                    assert bytes(frame) == bytes(view) == block
                    assert xxhash.xxh3_64_intdigest(frame) == xxhash.xxh3_64_intdigest(view) == token.checksum
                    assert local.stats()["prefetch_pages_held"] <= 2 * 2 * BLOCK // PAGE  # 2 windows of 2
                    assert remote.release("remote", key) and here.release("local", key)
                assert local.stats()["prefetches"] - before == 12
                stats = here.stats()
                assert stats["handles_held_max"] <= 4 and stats["remote_read_bytes"] >= 6 * BLOCK
                assert remote.finish("remote") == 0 and here.finish("local") == 0
        manager_proc.send_signal(signal.SIGTERM)
        assert manager_proc.wait(30) == 0
    finally:
        for proc in (manager_proc, master_proc):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            if proc is not None:
                proc.stdout.close()
                proc.stderr.close()


def test_remote_writes_and_refusals_pass_through(tmp_path):
    # A write buffer of two 64 KiB frames (0.0005 of 4096) that flushes only full batches of two: after a
    # one-page write, a two-page write finds one frame free and is refused whole (EAGAIN).
    with Server(tmp_path / "m", None, "--set", "policy.write_buffer_fraction=0.0005",
                "--set", f"policy.flush_batch_bytes={2 * PAGE}", "--set", "policy.flush_max_delay_ns=1e15") as srv:
        with start_manager(ManagerOptions(node=0, devices=[srv.node]), master=Master(ManualClock())) as running, \
                ManagerClient(running.serve_in_background().endpoint) as c:
            block = os.urandom(PAGE)
            assert c.write(0, 3 * PAGE, block) == PAGE
            with libchm.Device(srv.node) as d:
                assert d.read(3 * PAGE, PAGE) == block
            with pytest.raises(ChmError) as e:
                c.write(0, 0, os.urandom(2 * PAGE))
            assert e.value.errno == errno.EAGAIN
            with pytest.raises(ChmError) as e:
                c.rpc.call("write", 0, 0)  # no frame
            assert e.value.errno == errno.EINVAL and "exactly one frame" in e.value.message
            stats = c.stats()
            assert stats["remote_writes"] == 1 and stats["write_refused"] == 1
            assert stats["devices"][0]["written_bytes"] == PAGE


def test_a_full_media_enospc_passes_through_the_remote_write(tmp_path):
    """The device's fault hook fails the first flush's media writes with ENOSPC; from then on it refuses
    writes with ENOSPC (nothing written) until a flush lands: the remote writer sees that errno."""
    overrides = {**HOLD_WRITES, **FAULT_OVERRIDES}
    args = [a for k, v in overrides.items() for a in ("--set", f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}")]
    with Server(tmp_path / "m", None, *args) as srv, libchm.Device(srv.node) as d:
        d.write(0, os.urandom(DEVICE_WRITE_BYTES))
        with pytest.raises(ChmError) as e:
            d.flush()
        assert e.value.errno == errno.ENOSPC
        with start_manager(ManagerOptions(node=0, devices=[srv.node]), master=Master(WallClock())) as running:
            with ManagerClient(running.serve_in_background().endpoint) as c, pytest.raises(ChmError) as e:
                c.write(0, DEVICE_WRITE_BYTES, os.urandom(PAGE))
            assert e.value.errno == errno.ENOSPC and running.manager.stats()["write_refused"] == 1


WORKER = """
import sys
from host_runtime.hymcache.manager import ManagerClient
keys = [bytes.fromhex(k) for k in sys.argv[2:]]
c = ManagerClient(sys.argv[1])
print(c.hint("dying-worker", keys), flush=True)
c.hint("dying-worker-shared", keys[:3])
c.acquire("dying-worker", keys[0])
print("acquired", flush=True)
sys.stdin.read()  # until killed
"""


def test_a_disconnected_worker_has_its_prefetches_cancelled(served):
    master, mgr, paths, server, log = served  # the clock never moves: only the disconnect can cancel
    keys, _, (device,) = store(master, paths, 6)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, server.endpoint, *[k.hex() for k in keys]],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert worker.stdout.readline().strip() == "6"
        assert worker.stdout.readline().strip() == "acquired"
        assert mgr.stats()["handles_held"] == 3 + 3 and pages_held(paths[device]) > 0
        # A live connection of another worker is not touched, nor a request it used too.
        with ManagerClient(server.endpoint) as other:
            other.hint("other", keys[:2])
            other.acquire("dying-worker-shared", keys[0])
            worker.kill()
            worker.wait()
            log.wait_for("request dying-worker: its worker disconnected, cancelled")  # at the server's next poll
            stats = mgr.stats()
            assert stats["cancelled_disconnect"] == 1 and stats["requests"] == 2
            assert stats["handles_held"] == 2 + 3  # "other"'s and the shared one's
            assert other.acquire("other", keys[0]).key == keys[0]
            assert other.acquire("dying-worker-shared", keys[1]).key == keys[1]
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.stdout.close()
        worker.stdin.close()


def test_measure_block_paths_reports_both_paths(two_devices):
    master = Master(WallClock())
    out = measure_block_paths(master, two_devices[1].node, block_bytes=1 << 20, repeat=2)
    for name in ("stage_s", "local_s", "local_checked_s", "zmq_s", "zmq_checked_s", "local_total_s", "zmq_total_s"):
        assert out[name] > 0
    assert out["block_bytes"] == 1 << 20
    assert master.stats()["removed_blocks"] == 1  # the block removed again


SLOW_DISK_S = 1.0  # every media read of the device lands this long after it is submitted (test-only fault)
# What other callers wait meanwhile, against its bound, is bench/bench_manager.py's: these tests check by outcome.


@pytest.fixture
def slow_served(tmp_path):
    """A served Manager over one device whose staging reads take SLOW_DISK_S (faults.read_delay_ms)."""
    with Server(tmp_path / "m", None, "--set", f"faults.read_delay_ms={SLOW_DISK_S * 1e3:g}") as srv:
        master = Master(ManualClock())
        with start_manager(ManagerOptions(node=0, devices=[srv.node]), master=master) as running:
            held = when_held(running.server)
            running.serve_in_background()
            yield master, running.manager, {0: str(srv.path)}, running, held


def test_a_block_still_staging_holds_up_no_other_call(slow_served):
    """The defect: the served acquire waited on the device for the block's SSD reads, so every other worker's
    call to that Manager (a hint, a release, stats) waited for them too. Now the server holds the acquire,
    looks at the device again, and answers the others meanwhile."""
    master, mgr, paths, running, held = slow_served
    keys, data, _ = store(master, paths, 1)  # flushed: on the media only, so the hint stages it from the slow disk
    got = {}

    def worker():
        with ManagerClient(running.endpoint) as c:
            c.hint("slow", keys)
            got["token"] = c.acquire("slow", keys[0], 30.0)

    thread = threading.Thread(target=worker)
    thread.start()
    assert held.wait(30)  # its acquire is at the server, the block still staging
    with ManagerClient(running.endpoint) as other:
        stats = other.stats()
        # answered while the acquire was held: not after the staging
        assert stats["requests"] == 1 and stats["held_calls"] == 1
    thread.join(timeout=30)
    assert got["token"].key == keys[0]  # held until the reads landed
    with libchm.Device(paths[0]) as d:
        assert d.read(got["token"].offset, got["token"].length) == data[0]


def test_a_held_acquire_answers_etimedout_at_the_callers_timeout(slow_served):
    master, mgr, paths, running, _ = slow_served
    keys, _, _ = store(master, paths, 1, tag="t")
    with ManagerClient(running.endpoint) as c:
        c.hint("late", keys)
        with pytest.raises(ChmError) as exc:  # 0.3 s: its reads take SLOW_DISK_S
            c.acquire("late", keys[0], 0.3)
        assert exc.value.errno == errno.ETIMEDOUT and "SSD reads are in flight" in exc.value.message
        assert c.acquire("late", keys[0], 30.0).key == keys[0]  # asked again, it comes once staged


def test_a_flood_of_held_calls_is_bounded(slow_served):
    """A worker that sends many acquires of a block still staging gets at most MAX_HELD of them held; the rest
    are answered ETIMEDOUT at once (its client asks again), and other callers are still answered."""
    import msgspec

    from host_runtime.hymcache.manager import MAX_HELD

    master, mgr, paths, running, _ = slow_served
    keys, _, _ = store(master, paths, 1, tag="f")
    flood = MAX_HELD + 40
    with ManagerClient(running.endpoint) as c, ManagerClient(running.endpoint) as other:
        c.hint("flood", keys)
        for _ in range(flood):
            c.rpc.post("acquire", "flood", keys[0], 30.0)
        answered = []
        while len(answered) < flood - MAX_HELD and c.rpc.sock.poll(30_000):
            reply = c.rpc.sock.recv_multipart()
            answered.append(msgspec.msgpack.decode(reply[1])[0])
        assert answered == [errno.ETIMEDOUT] * (flood - MAX_HELD)  # before the block staged: none a token
        stats = other.stats()
        assert len(running.server.held) == MAX_HELD == stats["held_calls"] and stats["requests"] == 1


def test_held_calls_for_one_block_look_at_the_device_once_per_pass(tmp_path):
    import msgspec
    import zmq

    with Server(tmp_path / "m", None, "--set", f"faults.read_delay_ms={SLOW_DISK_S * 1e3:g}") as srv:
        master = Master(ManualClock())
        with start_manager(ManagerOptions(node=0, devices=[srv.node]), master=master) as running:
            mgr, server = running.manager, running.server  # not serving: the test drives it
            keys, _, _ = store(master, {0: str(srv.path)}, 2, tag="once")
            mgr.hint("once", keys)
            dev = mgr.handles[0]
            polls = []
            real_poll = dev.poll
            dev.poll = lambda handle: polls.append(handle) or real_poll(handle)
            for i in range(10):  # ten calls for the first block, two for the second
                key = keys[0] if i < 8 else keys[1]
                server._answer([zmq.Frame(b"worker"), zmq.Frame(i.to_bytes(8, "little")),
                                zmq.Frame(msgspec.msgpack.encode(("acquire", ["once", key, 30.0 - i])))])
            assert len(server.held) == 10 and len(polls) == 10  # each looked once when it came
            polls.clear()
            server._answer_held()
            assert len(server.held) == 10 and sorted(set(polls)) == sorted(polls) and len(polls) == 2


def test_an_in_process_acquire_leaves_the_manager_to_other_threads_while_it_waits(slow_served):
    """In process, an acquire of a block still staging waits without the Manager's lock: the served Manager's
    thread and other threads go on (before, it waited on the device holding the lock)."""
    master, mgr, paths, running, _ = slow_served
    keys, data, _ = store(master, paths, 1, tag="ip")
    mgr.hint("in-process", keys)
    dev = mgr.handles[0]
    looked = threading.Event()
    real_poll = dev.poll
    dev.poll = lambda handle: looked.set() or real_poll(handle)  # the acquire looks at the device, then waits
    got = {}
    thread = threading.Thread(target=lambda: got.update(token=mgr.acquire("in-process", keys[0], 30.0)))
    thread.start()
    assert looked.wait(30)
    assert mgr.stats()["requests"] == 1
    with ManagerClient(running.endpoint) as other:
        assert other.stats()["requests"] == 1
    assert "token" not in got  # answered while the acquire waits for the reads (SLOW_DISK_S)
    thread.join(timeout=30)
    assert got["token"].key == keys[0]
