"""Lookup: batches of at most 32 keys to the Master, a hint to each node's Manager as soon as a hit
names it (before the next batch), non-blocking start/poll, deadlines on the injected clock."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import xxhash

import libchm
from driver.errors import ChmError
from host_runtime.hymcache.clock import ManualClock, WallClock
from host_runtime.hymcache.lookup import Lookup
from host_runtime.hymcache.manager import KVManager, ManagerClient, serve_manager
from host_runtime.hymcache.master import MasterClient, master_options, start_master
from host_runtime.hymcache.messages import KEY_BYTES, BlockLoc
from tests.host_runtime.hymcache.test_manager import BLOCK, PAGE, store


def keys_(n: int) -> list[bytes]:
    return [os.urandom(KEY_BYTES) for _ in range(n)]


class ScriptedMaster:
    """A unit-test stand-in for the Master's lookup: ``stored`` key -> node; records every call in ``events``."""

    def __init__(self, stored: dict[bytes, int], events: list, gate: threading.Event | None = None):
        self.stored, self.events, self.gate = stored, events, gate
        self.fail = False
        self.called = threading.Event()  # a lookup came in (it may be waiting at the gate)

    def lookup(self, keys):
        self.called.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail:
            raise ChmError(errno.ETIMEDOUT, "master gone")
        self.events.append(("lookup", list(keys)))
        out = []
        for k in keys:
            if k not in self.stored:
                break
            out.append(BlockLoc(k, self.stored[k], 0, 0, 4096, 0, 1))
        return out


class RecordingManager:
    def __init__(self, node: int, events: list):
        self.node, self.events = node, events

    def hint(self, request_id, keys, locs=None):
        self.events.append(("hint", self.node, request_id, list(keys)))
        self.locs = list(locs or [])
        return len(keys)


class SteppingClock(ManualClock):
    """A ManualClock that also moves 1 s at each read while ``stepping``: a wait on it ends after a few reads."""

    stepping = False

    def now(self) -> float:
        if self.stepping:
            self.t += 1
        return self.t


def make(stored, events, gate=None, clock=None, **kwargs):
    master = ScriptedMaster(stored, events, gate)
    managers = {}
    lookup = Lookup(master, lambda n: managers.setdefault(n, RecordingManager(n, events)), clock or ManualClock(),
                    **kwargs)
    return master, lookup


def test_batches_of_32_in_order_and_a_hint_before_the_next_batch():
    keys = keys_(100)
    stored = {k: 0 for k in keys[:40]} | {k: 1 for k in keys[40:70]}  # node 0, then node 1; 70.. missing
    events = []
    _, lookup = make(stored, events)
    with lookup:
        lookup.start("r", keys)
        found = lookup.result("r", timeout_s=0.0 + 10)
        assert [loc.key for loc in found] == keys[:70]
        assert [loc.node for loc in found] == [0] * 40 + [1] * 30
        assert lookup.hinted_nodes("r") == [0, 1] and lookup.error("r") is None
    kinds = [(e[0], len(e[-1])) if e[0] == "lookup" else (e[0], e[1], len(e[-1])) for e in events]
    # Batch 1 names node 0: its hint (all 100 candidates, from the first hit on) goes before batch 2;
    # batch 2 names node 1 at key 40: a hint from there on; batch 3 comes back short (key 70 is missing): done.
    assert kinds == [("lookup", 32), ("hint", 0, 100), ("lookup", 32), ("hint", 1, 60), ("lookup", 32)]
    assert events[0][1] == keys[:32] and events[2][1] == keys[32:64] and events[4][1] == keys[64:96]
    assert events[1][3] == keys and events[3][3] == keys[40:]
    stats = lookup.stats()
    assert stats["lookup_batches"] == 3 and stats["num_lookup_hits"] == 70 and stats["hints_sent"] == 2


def test_the_hint_carries_the_masters_descriptors_of_the_batch():
    keys = keys_(100)
    stored = {k: 0 for k in keys[:40]} | {k: 1 for k in keys[40:70]}
    events, managers = [], {}
    master = ScriptedMaster(stored, events)
    with Lookup(master, lambda n: managers.setdefault(n, RecordingManager(n, events)), ManualClock()) as lookup:
        lookup.start("r", keys)
        found = lookup.result("r", 10)
    # each hint: the descriptors the Master gave in the batch that named the node, from its first hit on,
    # aligned with the hinted keys (locs[i] describes keys[i]), so the Manager can start staging them
    assert managers[0].locs == found[:32] and [loc.key for loc in managers[0].locs] == keys[:32]
    assert managers[1].locs == found[40:64] and [loc.key for loc in managers[1].locs] == keys[40:64]


def calls(events) -> list:
    """The Master lookups and (hint, node) calls, in order."""
    return [e[0] if e[0] == "lookup" else (e[0], e[1]) for e in events]


def scripted(stored: dict) -> tuple[list, Lookup]:
    """A Lookup on a ScriptedMaster of ``stored`` (key -> node), and the list its calls go to."""
    events = []
    return events, make(stored, events)[1]


def look(lookup, request_id: str, keys: list[bytes]) -> list[BlockLoc]:
    lookup.start(request_id, keys)
    return lookup.result(request_id, 10)


def test_a_later_lookup_hints_the_remembered_node_before_asking_the_master():
    keys = keys_(40)
    stored = {k: 0 for k in keys[:20]}  # a conversation's earlier turn; its new blocks (20..) come later
    events, managers = [], {}
    master = ScriptedMaster(stored, events)
    with Lookup(master, lambda n: managers.setdefault(n, RecordingManager(n, events)), ManualClock()) as lookup:
        first = look(lookup, "turn1", keys[:20])
        assert calls(events) == ["lookup", ("hint", 0)]  # nothing remembered yet: the Master first
        stored.update({k: 0 for k in keys[20:]})
        events.clear()
        found = look(lookup, "turn2", keys)
        # The hint goes out before the Master is asked, with every key of the request and the remembered
        # descriptors of the leading ones (the Manager stages those at once and resolves the rest itself);
        # the Master's answer, naming the same node, sends no second hint.
        assert calls(events) == [("hint", 0), "lookup", "lookup"]
        assert events[0][3] == keys and managers[0].locs == first
        assert [loc.key for loc in found] == keys and lookup.hinted_nodes("turn2") == [0]
        stats = lookup.stats()
        assert stats["early_hints"] == 1 and stats["early_hints_stale"] == 0 and stats["hints_sent"] == 2


def test_a_lookup_that_remembers_nothing_always_asks_the_master_first():
    keys = keys_(3)
    events = []
    _, lookup = make({k: 0 for k in keys}, events, known_locations=0)
    with lookup:
        look(lookup, "a", keys)
        look(lookup, "b", keys)
        assert calls(events) == ["lookup", ("hint", 0), "lookup", ("hint", 0)]
        assert lookup.stats()["early_hints"] == 0


def test_a_stale_remembered_node_still_gets_the_masters_node_hinted():
    keys = keys_(3)
    stored = {k: 0 for k in keys}
    events, lookup = scripted(stored)
    with lookup:
        look(lookup, "a", keys)
        stored.update({k: 1 for k in keys})  # evicted from node 0 and stored again on node 1 since
        events.clear()
        assert [loc.node for loc in look(lookup, "b", keys)] == [1, 1, 1]
        assert calls(events) == [("hint", 0), "lookup", ("hint", 1)]
        assert lookup.hinted_nodes("b") == [0, 1] and lookup.stats()["early_hints_stale"] == 1
        events.clear()
        look(lookup, "c", keys)  # the Master's answer replaced what was remembered
        assert calls(events) == [("hint", 1), "lookup"]


def test_a_key_the_master_no_longer_has_is_forgotten():
    keys = keys_(4)
    stored = {k: 0 for k in keys}
    events, lookup = scripted(stored)
    with lookup:
        look(lookup, "a", keys)
        del stored[keys[0]]  # evicted
        assert look(lookup, "b", keys) == []
        events.clear()
        look(lookup, "c", keys)
        assert calls(events) == ["lookup"]  # nothing hinted before the Master: it was forgotten
        # What is remembered is bounded: the oldest descriptors go first.
        lookup.known_locations = 2
        more = keys_(3)
        stored.update({k: 0 for k in more})
        look(lookup, "d", more)
        assert list(lookup._known) == more[1:]


def test_no_hit_no_hint():
    events = []
    _, lookup = make({}, events)
    with lookup:
        lookup.start("r", keys_(10))
        assert lookup.result("r", 10) == []
    assert [e[0] for e in events] == ["lookup"]


def test_start_does_not_block_and_poll_says_in_flight():
    keys = keys_(3)
    events, gate = [], threading.Event()
    _, lookup = make({k: 0 for k in keys}, events, gate)
    with lookup:
        lookup.start("r", keys)  # the Master has not answered (it waits for the gate)
        assert lookup.poll("r") is None and lookup.stats()["in_flight"] == 1
        gate.set()
        assert [loc.key for loc in lookup.result("r", 10)] == keys
        assert [loc.key for loc in lookup.poll("r")] == keys
        lookup.forget("r")
        with pytest.raises(ChmError) as e:
            lookup.poll("r")
        assert e.value.errno == errno.ENOENT


def test_requests_take_turns_a_batch_at_a_time():
    long, short = keys_(100), keys_(5)
    events, gate = [], threading.Event()
    _, lookup = make({k: 0 for k in long + short}, events, gate)
    with lookup:
        lookup.start("long", long)
        lookup.start("short", short)
        gate.set()
        lookup.result("long", 10)
        lookup.result("short", 10)
    batches = [len(e[1]) for e in events if e[0] == "lookup"]
    assert batches == [32, 5, 32, 32, 4]  # the short request did not wait for the whole long one


def test_the_deadline_reads_the_clock():
    keys = keys_(64)
    events, gate, clock = [], threading.Event(), SteppingClock()
    master, lookup = make({k: 0 for k in keys}, events, gate, clock, timeout_s=5)
    with lookup:
        lookup.start("r", keys)
        assert master.called.wait(10)  # the first batch is at the Master, stuck at the gate
        clock.stepping = True
        with pytest.raises(ChmError) as e:
            lookup.result("r", timeout_s=2)  # the Master is stuck: the wait ends on the clock
        clock.stepping = False
        assert e.value.errno == errno.ETIMEDOUT and clock.t <= 4
        clock.advance(10)  # past the lookup's own 5 s: after the stuck batch, the rest is given up
        gate.set()
        found = lookup.result("r", 10)
        assert len(found) == 32 and lookup.error("r").errno == errno.ETIMEDOUT
        assert lookup.stats()["lookup_timeouts"] == 1


def test_a_failing_master_ends_the_lookup_with_what_was_found():
    keys = keys_(64)
    events = []
    master, lookup = make({k: 0 for k in keys}, events)
    with lookup:
        master.fail = True
        lookup.start("r", keys)
        assert lookup.result("r", 10) == [] and lookup.error("r").errno == errno.ETIMEDOUT
        assert lookup.stats()["lookup_errors"] == 1


def test_a_failing_manager_does_not_stop_the_lookup():
    keys = keys_(40)
    events = []

    def unreachable(node):
        raise ChmError(errno.ETIMEDOUT, f"node {node}: no answer")

    with Lookup(ScriptedMaster({k: 0 for k in keys}, events), unreachable, ManualClock()) as lookup:
        lookup.start("r", keys)
        assert [loc.key for loc in lookup.result("r", 10)] == keys  # the worker learns the hits all the same
        assert lookup.error("r") is None
        assert lookup.stats()["hint_errors"] == 1 and lookup.stats()["hints_sent"] == 0


def test_inputs_are_checked_and_named():
    _, lookup = make({}, [])
    with lookup:
        for call, words in [(lambda: lookup.start("", keys_(1)), "request_id"),
                            (lambda: lookup.start("r", [b"x"]), "keys[0] must be 16 bytes"),
                            (lambda: lookup.result("r", -1), "timeout_s -1"),
                            (lambda: Lookup(ScriptedMaster({}, []), None, ManualClock(), batch=33), "batch 33"),
                            (lambda: Lookup(ScriptedMaster({}, []), None, ManualClock(), timeout_s=0), "timeout_s 0"),
                            (lambda: Lookup(42, None, ManualClock()), "master 42"),
                            (lambda: Lookup(ScriptedMaster({}, []), None, ManualClock(), known_locations=-1),
                             "known_locations -1")]:
            with pytest.raises(ChmError) as e:
                call()
            assert e.value.errno == errno.EINVAL and words in e.value.message, (words, e.value.message)
        lookup.start("r", keys_(1))
        with pytest.raises(ChmError) as e:
            lookup.start("r", keys_(1))
        assert e.value.errno == errno.EEXIST


# ---- the real pieces: a served Master (start_master, in process), two nodes' Managers, over ZeroMQ ------------
@pytest.fixture
def two_nodes(tmp_path):
    from tests.emulator.serve.serving import Server

    master = start_master(master_options(endpoint="tcp://127.0.0.1:0")).serve_in_thread()
    master_ep = master.endpoint
    servers, managers, threads = [], [], []
    try:
        for node in (0, 1):
            srv = Server(tmp_path / f"media{node}")
            servers.append(srv)
            mgr = KVManager(node, [srv.node], MasterClient(master_ep), WallClock(), window_bytes=2 * BLOCK)
            server = serve_manager(mgr, "tcp://127.0.0.1:0")
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            managers.append((mgr, server))
            threads.append(thread)
        yield master_ep, managers, {node: str(srv.path) for node, srv in enumerate(servers)}
    finally:
        for (mgr, server), thread in zip(managers, threads):
            server.stop()
            thread.join(10)
            mgr.close()
            mgr.master.close()
        for srv in servers:
            srv.stop()
        master.close()


def test_lookup_hints_each_node_and_the_managers_stage_the_blocks(two_nodes):
    master_ep, managers, paths = two_nodes
    stored = []
    with MasterClient(master_ep) as master:
        for node in (0, 1):  # round robin: the first request's blocks on node 0, the second's on node 1
            keys, data, _ = store(master, {0: paths[node]}, 5 if node == 0 else 4, tag=str(node))
            assert {loc.node for loc in master.lookup(keys)} == {node}
            stored.append((keys, data))
    (keys0, data0), (keys1, data1) = stored
    missing = os.urandom(KEY_BYTES)
    with Lookup(master_ep, None, WallClock()) as lookup:  # its own MasterClient and ManagerClients
        lookup.start("req", keys0 + keys1 + [missing])
        found = lookup.result("req", 10)
        assert [loc.key for loc in found] == keys0 + keys1
        assert lookup.hinted_nodes("req") == [0, 1] and lookup.error("req") is None
        # Each node's Manager got the hint and staged its own blocks, a window (2) at a time.
        assert [mgr.stats()["hints"] for mgr, _ in managers] == [1, 1]
        assert [mgr.stats()["handles_held"] for mgr, _ in managers] == [2, 2]
        with libchm.Device(paths[0]) as d0, libchm.Device(paths[1]) as d1:
            assert d0.stats()["prefetch_pages_held"] == d1.stats()["prefetch_pages_held"] == 2 * BLOCK // PAGE
        for (mgr, server), keys, data in zip(managers, (keys0, keys1), (data0, data1)):
            with ManagerClient(server.endpoint) as worker:
                for key, block in zip(keys, data):
                    token, frame = worker.read("req", key)
                    assert bytes(frame) == block and xxhash.xxh3_64_intdigest(frame) == token.checksum
                    worker.release("req", key)
                assert worker.finish("req") == 0
        assert [mgr.stats()["prefetches"] for mgr, _ in managers] == [5, 4]
