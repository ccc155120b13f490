"""The KV Manager against real `chm serve` devices: hints resolved in order, prefetch in a bounded
window, EBUSY queued, tokens, cancellation (finish, timeout, disconnect), the local (libchm) and
remote (ZeroMQ) read paths and the remote write path."""

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
from host_runtime.hymcache.manager import KVManager, ManagerClient, ManagerOptions, start_manager
from host_runtime.hymcache.master import Master, MasterClient
from host_runtime.hymcache.messages import KEY_BYTES, DeviceInfo
from tests.emulator.serve.serving import ROOT, Server
from tests.emulator.media_trouble import DEVICE_WRITE_BYTES, FAULT_OVERRIDES, HOLD_WRITES

PAGE = 64 << 10
BLOCK = 2 * PAGE  # small blocks: many of them in the small profile's 64 MiB prefetch window


class RecordingMaster:
    """The real Master, with each lookup's batch recorded (a spy: every call goes to the Master)."""

    def __init__(self, master: Master):
        self.master, self.batches = master, []

    def lookup(self, keys):
        self.batches.append(list(keys))
        return self.master.lookup(keys)

    def __getattr__(self, name):
        return getattr(self.master, name)


def store(master, paths: dict[int, str], nblocks: int, size: int = BLOCK, tag: str = "r"):
    """Put ``nblocks`` blocks through the Master (put_start -> libchm writes -> put_end); keys and bytes."""
    keys = [os.urandom(KEY_BYTES) for _ in range(nblocks)]
    data = [os.urandom(size) for _ in range(nblocks)]
    locs = master.put_start(f"put-{tag}-{keys[0].hex()}", keys, [size] * nblocks)
    devs = {}
    for loc, block in zip(locs, data):
        if loc.device not in devs:
            devs[loc.device] = libchm.Device(paths[loc.device])
        devs[loc.device].write(loc.offset, block)
    for d in devs.values():
        d.flush()  # on the media: the hint really stages from flash
        d.close()
    assert master.put_end(keys, [xxhash.xxh3_64_intdigest(b) for b in data]) == nblocks
    return keys, data, {loc.device for loc in locs}


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("m0")) as a, Server(tmp_path_factory.mktemp("m1")) as b:
        yield [a, b]


@pytest.fixture
def setup(two_devices):
    clock = ManualClock()
    master = RecordingMaster(Master(clock))
    mgr = KVManager(0, [s.node for s in two_devices], master, clock, window_bytes=3 * BLOCK)
    yield master, clock, mgr, {i: str(s.path) for i, s in enumerate(two_devices)}
    mgr.close()


def pages_held(path: str) -> int:
    with libchm.Device(path) as d:
        return d.stats()["prefetch_pages_held"]


class LogWatch:
    """A Manager's ``log``: its lines, and a wait for one that says something (what the test synchronizes on)."""

    def __init__(self):
        self.lines, self._cond = [], threading.Condition()

    def __call__(self, line: str) -> None:
        with self._cond:
            self.lines.append(line)
            self._cond.notify_all()

    def wait_for(self, words: str, timeout_s: float = 30.0) -> str:
        with self._cond:
            assert self._cond.wait_for(lambda: any(words in line for line in self.lines), timeout_s), \
                f"no log line with {words!r}: {self.lines}"
            return next(line for line in self.lines if words in line)


def when_held(server) -> threading.Event:
    """Set once ``server`` (a ManagerServer) holds a call: a spy on its answering (the serving thread's)."""
    held = threading.Event()
    answer = server._answer

    def spy(frames):
        answer(frames)
        if server.held:
            held.set()
    server._answer = spy
    return held


def test_registers_the_node_and_its_devices(setup, two_devices):
    master, _, mgr, paths = setup
    infos = master.nodes()[0]["devices"]
    assert [i.node_path for i in infos] == [paths[0], paths[1]]
    for info, srv in zip(infos, two_devices):
        with libchm.Device(srv.node) as d:
            assert (info.capacity_bytes, info.epoch) == (d.info()["capacity_bytes"], d.info()["device_epoch"])


def test_hint_stages_in_consumption_order_within_the_window(setup):
    master, _, mgr, paths = setup
    keys, data, devices = store(master, paths, 40)
    device, = devices
    path = paths[device]
    after_gap, _, _ = store(master, paths, 29, tag="later")  # stored, but behind a missing block
    candidates = keys + [os.urandom(KEY_BYTES)] + after_gap
    with libchm.Device(path) as probe:
        before = probe.stats()["prefetches"]
        master.batches.clear()
        assert mgr.hint("req", candidates) == 40
        # Resolved in batches of at most 32, in order; the second comes back short (the miss at 40):
        # the stored prefix ends there, and nothing behind the gap is asked for or staged.
        assert master.batches == [candidates[:32], candidates[32:64]]
        assert probe.stats()["prefetches"] - before == 3  # the window: 3 blocks, not 40
        handles = []
        for i, (key, block) in enumerate(zip(keys, data)):
            token = mgr.acquire("req", key, timeout_s=0)
            handles.append(token.handle)
            # A worker on this machine reads the staged block through libchm itself.
            got = probe.read(token.offset, token.length)
            assert got == block and xxhash.xxh3_64_intdigest(got) == token.checksum
            held = probe.stats()["prefetch_pages_held"]
            assert held <= 3 * BLOCK // PAGE, (i, held)  # never more than the window at once
            assert mgr.stats()["handles_held"] <= 3
            assert mgr.release("req", key) is True
        assert handles == sorted(handles) and len(set(handles)) == 40  # issued in consumption order
        assert probe.stats()["prefetches"] - before == 40
        assert probe.stats()["prefetch_pages_held"] == 0
    stats = mgr.stats()
    assert stats["handles_held_max"] == 3 and stats["prefetch_window_bytes_max"] == 3 * BLOCK
    assert stats["devices"][device]["prefetch_bytes"] == 40 * BLOCK


def test_the_window_is_never_fewer_than_two_blocks(two_devices):
    master = Master(ManualClock())
    with KVManager(0, [two_devices[0].node], master, ManualClock(), window_bytes=1) as mgr:
        keys, _, _ = store(master, {0: str(two_devices[0].path)}, 5)
        mgr.hint("r", keys)
        assert mgr.stats()["handles_held"] == 2
        mgr.hint("short", keys[:1])  # one hit: a window of one
        assert mgr.stats()["handles_held"] == 3


def test_blocks_on_other_nodes_are_left_to_their_manager(setup):
    master, _, mgr, paths = setup
    master.register_node(7, "tcp://elsewhere:1", [DeviceInfo(0, "/dev/shm/elsewhere", 1 << 30, 1)])
    # Round-robin placement: the requests go to node 0, node 7, node 0; node 7's block is in the middle.
    first, _, _ = store(master, paths, 2, tag="a")
    elsewhere = os.urandom(KEY_BYTES)
    loc, = master.put_start("b", [elsewhere], [BLOCK])
    assert loc.node == 7
    master.put_end([elsewhere], [0])
    last, _, _ = store(master, paths, 1, tag="c")
    assert mgr.hint("r", first + [elsewhere] + last) == 3
    with pytest.raises(ChmError) as e:
        mgr.acquire("r", elsewhere, 0)
    assert e.value.errno == errno.ENOENT and "not a hit" in e.value.message
    assert mgr.acquire("r", last[0], 0).key == last[0]
    assert mgr.stats()["hint_other_node"] == 1


class StagingWatchingMaster(RecordingMaster):
    """The spy Master, also noting how many prefetches the Manager had issued when each lookup came."""

    def __init__(self, master: Master, mgr_box: list):
        super().__init__(master)
        self.mgr_box, self.prefetches_at_lookup = mgr_box, []

    def lookup(self, keys):
        if self.mgr_box:
            self.prefetches_at_lookup.append(self.mgr_box[0].counters["prefetches"])
        return super().lookup(keys)


def test_hint_with_the_lookups_descriptors_stages_before_its_own_lookup(two_devices):
    clock = ManualClock()
    box: list = []
    master = StagingWatchingMaster(Master(clock), box)
    path = str(two_devices[0].path)
    with KVManager(0, [two_devices[0].node], master, clock, window_bytes=3 * BLOCK) as mgr:
        keys, data, _ = store(master, {0: path}, 5)
        locs = master.master.lookup(keys)
        box.append(mgr)
        assert mgr.hint("r", keys, locs[:4]) == 5
        # the window's 3 blocks went to the device before the Manager asked the Master; the Master agreed
        assert master.prefetches_at_lookup == [3]
        assert mgr.stats()["hint_locs_used"] == 4 and mgr.stats()["hint_locs_unconfirmed"] == 0
        assert mgr.stats()["hint_hits"] == 5
        with libchm.Device(path) as probe:
            for key, block in zip(keys, data):
                token = mgr.acquire("r", key, timeout_s=0)
                assert probe.read(token.offset, token.length) == block
                mgr.release("r", key)
        assert pages_held(path) == 0


def test_descriptors_the_master_does_not_confirm_are_dropped(two_devices):
    clock = ManualClock()
    master = Master(clock)
    path = str(two_devices[0].path)
    with KVManager(0, [two_devices[0].node], master, clock, window_bytes=3 * BLOCK) as mgr:
        keys, data, _ = store(master, {0: path}, 4)
        locs = master.lookup(keys)
        lying = list(locs)
        # a worker's stale (or lying) descriptor of block 1: another place on the device, another checksum
        lying[1] = type(locs[1])(locs[1].key, 0, 0, locs[3].offset, BLOCK, 12345, locs[1].version)
        removed = keys[3]
        master.remove([removed])  # and the Master no longer has block 3 at all
        assert mgr.hint("r", keys, lying) == 3
        stats = mgr.stats()
        assert stats["hint_locs_unconfirmed"] == 2 and stats["hint_hits"] == 3  # blocks 1 and 3
        with libchm.Device(path) as probe:
            for key, block, loc in zip(keys[:3], data, locs):
                token = mgr.acquire("r", key, timeout_s=0)
                assert (token.offset, token.checksum) == (loc.offset, loc.checksum)  # the Master's, not the hint's
                assert probe.read(token.offset, token.length) == block
                mgr.release("r", key)
        with pytest.raises(ChmError) as e:
            mgr.acquire("r", removed, 0)
        assert e.value.errno == errno.ENOENT
        assert pages_held(path) == 0  # every staging of the unconfirmed descriptors was released


def test_a_hint_confirmed_later_answers_before_its_lookup_and_hands_out_only_the_masters_blocks(two_devices):
    # The served Manager's hint: staging starts from the Lookup's descriptors and the call returns before
    # this Manager's own Master lookup; the first block call (or progress) confirms, and a stale
    # descriptor is never handed out.
    clock = ManualClock()
    master = RecordingMaster(Master(clock))
    path = str(two_devices[0].path)
    with KVManager(0, [two_devices[0].node], master, clock, window_bytes=3 * BLOCK) as mgr:
        keys, data, _ = store(master, {0: path}, 4)
        locs = master.master.lookup(keys)
        lying = list(locs)
        lying[1] = type(locs[1])(locs[1].key, 0, 0, locs[3].offset, BLOCK, 12345, locs[1].version)
        assert mgr.hint("r", keys, lying, confirm_later=True) == 4
        assert master.batches == [] and mgr.stats()["prefetches"] == 3  # staging, no Master round trip yet
        with libchm.Device(path) as probe:
            for key, block, loc in zip(keys, data, locs):
                token = mgr.acquire("r", key, timeout_s=0)
                assert master.batches == [keys]  # confirmed once, at the first acquire
                assert (token.offset, token.checksum) == (loc.offset, loc.checksum)  # the Master's, not the lie
                assert probe.read(token.offset, token.length) == block
                mgr.release("r", key)
        assert mgr.stats()["hint_locs_unconfirmed"] == 1
        # progress confirms a pending hint too
        assert mgr.hint("p", keys, locs, confirm_later=True) == 4
        mgr.progress()
        assert master.batches == [keys, keys] and mgr.stats()["hint_locs_unconfirmed"] == 1
        mgr.finish("p")
        assert pages_held(path) == 0


class FailingMaster(RecordingMaster):
    def lookup(self, keys):
        raise ChmError(errno.ECONNREFUSED, "the Master is down")


def test_a_hint_whose_later_confirmation_fails_is_cancelled(two_devices):
    clock = ManualClock()
    master = Master(clock)
    path = str(two_devices[0].path)
    with KVManager(0, [two_devices[0].node], FailingMaster(master), clock, window_bytes=3 * BLOCK) as mgr:
        keys, _, _ = store(master, {0: path}, 3)
        assert mgr.hint("r", keys, master.lookup(keys), confirm_later=True) == 3
        assert pages_held(path) > 0
        mgr.progress()  # the Master is unreachable: nothing of the request stays held, the worker recomputes
        assert mgr.stats()["confirm_errors"] == 1 and "r" not in mgr.requests
        assert pages_held(path) == 0
        with pytest.raises(ChmError) as e:
            mgr.acquire("r", keys[0], 0)
        assert e.value.errno == errno.ENOENT


class ScriptedMasterEndpoint:
    """A Master endpoint that answers only what the test tells it to: a ROUTER that records each call."""

    def __init__(self):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def calls(self, n: int, timeout_s: float = 10.0) -> list:
        """The next ``n`` calls: (frames, method, args) each."""
        from host_runtime.hymcache.rpc import call_of

        got = []
        while len(got) < n:
            assert self.sock.poll(int(timeout_s * 1000)), f"{len(got)} of {n} calls came"
            frames = self.sock.recv_multipart(copy=False)
            got.append((frames, *call_of(frames)))
        return got

    def answer(self, frames, result) -> None:
        from host_runtime.hymcache.rpc import _encode

        self.sock.send_multipart([frames[0].bytes, frames[1].bytes, _encode((0, result, ""))])

    def close(self) -> None:
        self.sock.close(0)


def test_background_confirmations_are_in_flight_at_once_and_a_hung_master_holds_up_nothing(two_devices):
    # The served Manager confirms hints on a thread of its own: each request's Master lookup is in flight at
    # once, an answered one confirms its request while another hangs, and the hung one fails alone at its
    # timeout; no call waits for the Master meanwhile.
    master = Master(WallClock())
    path = str(two_devices[0].path)
    fake = ScriptedMasterEndpoint()
    log = LogWatch()
    try:
        with KVManager(0, [two_devices[0].node], master, WallClock(), window_bytes=3 * BLOCK, log=log) as mgr:
            mgr.confirm_in_background(fake.endpoint, timeout_s=1.0)
            keys_a, _, _ = store(master, {0: path}, 2, tag="a")
            keys_b, data_b, _ = store(master, {0: path}, 2, tag="b")
            assert mgr.hint("a", keys_a, master.lookup(keys_a), confirm_later=True) == 2
            assert mgr.hint("b", keys_b, master.lookup(keys_b)[:1], confirm_later=True) == 1
            (frames_a, method_a, args_a), (frames_b, method_b, args_b) = fake.calls(2)  # both asked, no answer yet
            assert (method_a, args_a, method_b, args_b) == ("lookup", [keys_a], "lookup", [keys_b])
            with pytest.raises(ChmError) as e:  # nothing handed out before the Master confirmed it
                mgr.acquire("a", keys_a[0], 0, look=True)
            assert e.value.errno == errno.ETIMEDOUT and "in flight" in e.value.message
            # the Manager answers meanwhile: before the 1 s timeout cancels "a" (the bound: bench_manager.py)
            assert mgr.stats()["requests"] == 2
            fake.answer(frames_b, master.lookup(keys_b))
            token = mgr.acquire("b", keys_b[0], 5.0)  # waits for the confirmation, then for the staging
            with libchm.Device(path) as probe:
                assert probe.read(token.offset, token.length) == data_b[0]
            mgr.release("b", keys_b[0])
            assert "a" in mgr.requests  # still waiting for its answer
            log.wait_for("request a: its hint's Master lookup failed")
            assert mgr.stats()["confirm_errors"] == 1 and "a" not in mgr.requests  # cancelled at 1 s, alone
            assert "b" in mgr.requests
            mgr.finish("b")
            assert pages_held(path) == 0
    finally:
        fake.close()


def test_bad_hint_descriptors_are_refused(setup):
    master, _, mgr, paths = setup
    keys, _, _ = store(master, paths, 2)
    locs = master.lookup(keys)
    for locs_arg, text in (([["junk"]], "locs must be a list of block descriptors"),
                           (locs + locs, "locs has 4 descriptors for 2 keys"),
                           (locs[::-1], "locs[0] describes key")):
        with pytest.raises(ChmError) as e:
            mgr.hint("bad", keys, locs_arg)
        assert e.value.errno == errno.EINVAL and text in e.value.message
    assert "bad" not in mgr.requests


def test_finish_releases_every_handle(setup):
    master, _, mgr, paths = setup
    keys, _, (device,) = store(master, paths, 6)
    mgr.hint("r", keys)
    mgr.acquire("r", keys[0], 0)
    assert pages_held(paths[device]) > 0
    assert mgr.finish("r") == 3
    assert pages_held(paths[device]) == 0
    with pytest.raises(ChmError) as e:
        mgr.acquire("r", keys[1], 0)
    assert e.value.errno == errno.ENOENT
    assert mgr.release("r", keys[0]) is False  # a late give-back is harmless


def test_an_untouched_request_is_cancelled_at_its_timeout(two_devices):
    master, clock = Master(ManualClock()), ManualClock()
    with KVManager(0, [two_devices[0].node], master, clock, window_bytes=2 * BLOCK, request_timeout_s=5) as mgr:
        keys, _, _ = store(master, {0: str(two_devices[0].path)}, 4)
        mgr.hint("idle", keys)
        mgr.hint("busy", keys)
        clock.advance(4)
        mgr.acquire("busy", keys[0], 0)  # touched at t=4
        clock.advance(2)                # t=6: "idle" untouched for 6 s > 5, "busy" for 2 s
        mgr.progress()
        assert mgr.stats()["requests"] == 1 and mgr.stats()["num_timeouts_recompute"] == 1
        with pytest.raises(ChmError) as e:
            mgr.acquire("idle", keys[0], 0)
        assert e.value.errno == errno.ENOENT
        assert mgr.touch(["busy", "idle"]) == 1
        clock.advance(5)
        mgr.progress()  # touched at 6, now 11: not past 5 s
        assert mgr.stats()["requests"] == 1
        clock.advance(0.5)
        mgr.progress()
        assert mgr.stats()["requests"] == 0 and pages_held(str(two_devices[0].path)) == 0


def test_acquire_times_out_on_the_clock_when_the_block_stays_queued(setup):
    master, clock, mgr, paths = setup
    keys, _, _ = store(master, paths, 5)
    mgr.hint("r", keys)  # window 3: keys[3] waits for a release
    for k in keys[:3]:
        mgr.acquire("r", k, 0)
    clock.now = lambda: clock.advance(1)  # each look at the clock, a second passes: the clock alone ends the wait
    try:
        with pytest.raises(ChmError) as e:
            mgr.acquire("r", keys[3], timeout_s=2)
    finally:
        del clock.now  # ManualClock's own again
    assert e.value.errno == errno.ETIMEDOUT and "window of 3 blocks is held" in e.value.message
    assert clock.now() >= 2
    mgr.release("r", keys[0])
    assert mgr.acquire("r", keys[3], 0).key == keys[3]


def test_ebusy_from_the_device_queues_the_block_and_never_fails(tmp_path):
    # A device whose prefetch window holds one block (3 pages), with a Manager window of 4 blocks.
    with Server(tmp_path / "m", None, "--set", f"policy.prefetch_window_bytes={3 * PAGE}") as srv:
        master = Master(ManualClock())
        with KVManager(0, [srv.node], master, ManualClock(), window_bytes=4 * BLOCK) as mgr:
            keys, data, _ = store(master, {0: str(srv.path)}, 4)
            assert mgr.hint("r", keys) == 4
            stats = mgr.stats()
            assert stats["handles_held"] == 1 and stats["ebusy"] == 1 and stats["queued_blocks"] == 3
            mgr.acquire("r", keys[0], timeout_s=0)
            with pytest.raises(ChmError) as e:  # queued behind the device, not failed: it comes after a release
                mgr.acquire("r", keys[1], timeout_s=0)
            assert e.value.errno == errno.ETIMEDOUT and "busy (EBUSY)" in e.value.message
            for key, block in zip(keys, data):
                token = mgr.acquire("r", key, timeout_s=0)
                with libchm.Device(srv.node) as d:
                    assert d.read(token.offset, token.length) == block
                mgr.release("r", key)
            stats = mgr.stats()
            assert stats["num_load_errors"] == 0 and stats["prefetches"] == 4 and stats["ebusy"] >= 3


def test_a_device_gone_fails_its_blocks_at_once_never_hangs(tmp_path):
    master = Master(ManualClock())
    with Server(tmp_path / "m") as srv, KVManager(0, [srv.node], master, ManualClock(), window_bytes=2 * BLOCK) as mgr:
        keys, _, _ = store(master, {0: str(srv.path)}, 4)
        assert mgr.hint("r", keys) == 4
        srv.kill()  # SIGKILL: staged (window) and queued blocks alike
        for key in keys:
            with pytest.raises(ChmError) as e:
                mgr.acquire("r", key, timeout_s=10)  # the clock never moves: only an error can end it
            assert e.value.errno == errno.ENODEV, e.value
        assert mgr.stats()["num_load_errors"] == 4 and mgr.finish("r") == 0


def read_back(mgr, rid: str, keys, data, path: str) -> None:
    """Hint ``keys``, then acquire, read (libchm, as a worker on this machine) and release each block."""
    assert mgr.hint(rid, keys) == len(keys)
    with libchm.Device(path) as d:
        for key, block in zip(keys, data):
            token = mgr.acquire(rid, key, timeout_s=0)
            assert d.read(token.offset, token.length) == block
            assert mgr.release(rid, key) is True
    assert mgr.finish(rid) == 0


def test_a_device_restarted_on_its_media_is_reopened_and_keeps_its_blocks(tmp_path):
    master, clock = Master(ManualClock()), ManualClock()
    media = tmp_path / "m"
    with Server(media) as srv, KVManager(0, [srv.node], master, clock, window_bytes=2 * BLOCK) as mgr:
        keys, data, _ = store(master, {0: str(srv.path)}, 3)
        epoch = mgr.devices()[0].epoch
        assert mgr.hint("before", keys) == 3  # two staged, one queued
        srv.kill()
        with Server(media, srv.node) as again:  # the same node on the same media: the same epoch
            # Nothing told the Manager: the next hint meets the dead handle, reopens the device at once and
            # stages on the new server.
            read_back(mgr, "after", keys, data, str(again.path))
            for key in keys[:2]:  # staged through the dead server: failed (the worker recomputes)
                with pytest.raises(ChmError) as e:
                    mgr.acquire("before", key, timeout_s=0)
                assert e.value.errno == errno.ENODEV and "went away" in e.value.message
            with libchm.Device(again.node) as d:  # the queued one stages on the new server
                token = mgr.acquire("before", keys[2], timeout_s=0)
                assert d.read(token.offset, token.length) == data[2]
            assert mgr.finish("before") == 1
            assert [loc.key for loc in master.lookup(keys)] == keys
            assert master.nodes()[0]["devices"][0].epoch == epoch
            stats = mgr.stats()
            assert (stats["devices_gone"], stats["devices_reopened"], stats["devices_new_epoch"]) == (1, 1, 0)
            # Killed and restarted again under an idle Manager: the tick sees another server on the node.
            again.kill()
            with Server(media, srv.node):
                clock.advance(1)
                mgr.progress()
                stats = mgr.stats()
                assert (stats["devices_gone"], stats["devices_reopened"], stats["devices_new_epoch"]) == (2, 2, 0)
                assert stats["devices"][0]["attached"] == 1
                read_back(mgr, "again", keys, data, str(srv.path))
            assert master.stats()["stale_blocks"] == 0


def test_a_device_restarted_formatted_is_registered_again_and_its_old_blocks_dropped(tmp_path):
    master, clock = Master(ManualClock()), ManualClock()
    media = tmp_path / "m"
    with Server(media) as srv, KVManager(0, [srv.node], master, clock, window_bytes=2 * BLOCK) as mgr:
        path = {0: str(srv.path)}
        keys, _, _ = store(master, path, 3)
        old_epoch = mgr.devices()[0].epoch
        assert mgr.hint("before", keys) == 3
        srv.kill()
        with Server(media, srv.node, "--format") as again:
            with libchm.Device(again.node) as d:
                new_epoch = d.info()["device_epoch"]
            assert new_epoch != old_epoch
            # The Master still has the old blocks; the hint meets the dead handle, reopens the device, sees
            # the new epoch and registers the node again: the blocks it was given are stale.
            assert mgr.hint("after", keys) == 3
            for key in keys:
                with pytest.raises(ChmError) as e:
                    mgr.acquire("after", key, timeout_s=0)
                assert e.value.errno == errno.ESTALE and f"epoch {new_epoch}" in e.value.message
            assert master.nodes()[0]["devices"][0].epoch == mgr.devices()[0].epoch == new_epoch
            assert master.lookup(keys) == [] and master.stats()["stale_blocks"] == 3
            assert mgr.hint("later", keys) == 0
            with pytest.raises(ChmError) as e:  # hinted before: staged ones gone, the queued one stale
                mgr.acquire("before", keys[0], timeout_s=0)
            assert e.value.errno == errno.ENODEV
            with pytest.raises(ChmError) as e:
                mgr.acquire("before", keys[2], timeout_s=0)
            assert e.value.errno == errno.ESTALE
            assert mgr.stats()["devices_new_epoch"] == 1
            fresh, data, _ = store(master, path, 2, tag="fresh")  # the device serves new blocks
            read_back(mgr, "fresh", fresh, data, path[0])
            # Formatted again under an idle Manager: the tick notices and registers the next epoch.
            again.kill()
            with Server(media, srv.node, "--format"):
                clock.advance(1)
                mgr.progress()
                with libchm.Device(srv.node) as d:
                    assert master.nodes()[0]["devices"][0].epoch == d.info()["device_epoch"] != new_epoch
                assert master.lookup(fresh) == [] and mgr.stats()["devices_new_epoch"] == 2


def test_inputs_are_checked_and_named(setup, two_devices):
    master, _, mgr, _ = setup
    key = os.urandom(KEY_BYTES)
    cases = [
        (lambda: mgr.hint("", [key]), "request_id"),
        (lambda: mgr.hint("r", []), "keys must be a list of 1 to"),
        (lambda: mgr.hint("r", [b"short"]), "keys[0] must be 16 bytes, got 5 bytes"),
        (lambda: mgr.acquire("r", key, -1), "timeout_s -1"),
        (lambda: mgr.acquire("r", key, float("nan")), "timeout_s nan"),
        (lambda: mgr.write(2, 0, [b"x"]), "device 2 is outside the allowed range: an integer in [0, 1]"),
        (lambda: mgr.write(0, 0, [b"x", b"y"]), "payload must be exactly one frame"),
        (lambda: KVManager(0, [], master, ManualClock()), "device_nodes"),
        (lambda: KVManager(-1, ["x"], master, ManualClock()), "node -1 is outside"),
        (lambda: KVManager(0, [two_devices[0].node], master, ManualClock(), window_bytes=0), "window_bytes 0"),
        (lambda: KVManager(0, [two_devices[0].node], object(), ManualClock()), "has no lookup()"),
    ]
    for call, words in cases:
        with pytest.raises(ChmError) as e:
            call()
        assert e.value.errno == errno.EINVAL and words in e.value.message, (words, e.value.message)
    with pytest.raises(ChmError) as e:
        mgr.write(0, 1 << 40, [b"x"])
    assert e.value.errno == errno.ERANGE
    with pytest.raises(ChmError) as e:
        KVManager(0, [two_devices[0].node, "chmtest-no-such-device"], master, ManualClock())
    assert e.value.errno == errno.ENODEV and "chmtest-no-such-device" in e.value.message


# ---- over ZeroMQ --------------------------------------------------------------------------
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
