"""The KV Manager in process against real `chm serve` devices: hints resolved in order, prefetch in a bounded
window, EBUSY queued, tokens, cancellation (finish, timeout), devices that go away and come back, inputs checked.
Over ZeroMQ (read and write paths, disconnects, held calls): test_manager_served.py."""

from __future__ import annotations

import errno
import os

import pytest
import xxhash

import libchm
from driver.errors import ChmError
from host_runtime.hymcache.clock import ManualClock, WallClock
from host_runtime.hymcache.manager import KVManager
from host_runtime.hymcache.master import Master
from host_runtime.hymcache.messages import KEY_BYTES, DeviceInfo
from tests.emulator.serve.serving import Server

from .manager_pieces import (BLOCK, PAGE, LogWatch, RecordingMaster, pages_held,  # noqa: F401 (test_lookup's)
                             store)


@pytest.fixture
def setup(two_devices):
    clock = ManualClock()
    master = RecordingMaster(Master(clock))
    mgr = KVManager(0, [s.node for s in two_devices], master, clock, window_bytes=3 * BLOCK)
    yield master, clock, mgr, {i: str(s.path) for i, s in enumerate(two_devices)}
    mgr.close()


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
