"""The Master's rules (issue 10, item 2), each in its own test, in process with a ManualClock; then its
journal and snapshot, in process and as a real process killed with SIGKILL and restarted."""

from __future__ import annotations

import errno
import os

import pytest

from driver.errors import ChmError
from host_runtime.hymcache.clock import ManualClock
from bench.master_footprint import measure_bytes_per_entry
from host_runtime.hymcache.master import ENTRY_DTYPE, MASTER_METHODS, Master, MasterClient, master_options, start_master
from host_runtime.hymcache.messages import BlockLoc, DeviceInfo, WriteLoc
from host_runtime.hymcache.rpc import RemoteError

from .procs import kill9, master_proc, stop_proc

DAY = 86_400.0


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make(clock=None, capacity=1000, nodes=1, devices=1, state_dir=None, **kw) -> Master:
    m = Master(clock or ManualClock(), state_dir, **kw)
    for n in range(nodes):
        m.register_node(n, f"tcp://node{n}", [DeviceInfo(d, f"/dev/shm/n{n}d{d}", capacity, 7) for d in range(devices)])
    return m


def store(m: Master, ids, size=100, request="r") -> list[WriteLoc]:
    locs = m.put_start(request, [key(i) for i in ids], [size] * len(ids))
    assert m.put_end([key(i) for i in ids], [1000 + i for i in ids]) == sum(loc is not None for loc in locs)
    return locs


def found(m: Master, ids) -> list[int]:
    """Which of ``ids`` a lookup of each alone finds (each lookup grants a lease: use where that is fine)."""
    return [i for i in ids if m.lookup([key(i)])]


def device_space(m: Master, node=0, device=0) -> dict:
    return next(d for d in m.stats()["devices"] if (d["node"], d["device"]) == (node, device))


# ---------------------------------------------------------------- entries

def test_entry_is_64_bytes_with_the_documented_fields():
    assert ENTRY_DTYPE.itemsize == 64
    assert set(ENTRY_DTYPE.names) == {"key", "node", "device", "offset", "length", "state", "version", "checksum",
                                      "lease_until", "lease_cap", "lru", "put_deadline"}
    assert ENTRY_DTYPE["key"].itemsize == 16


def test_bytes_per_entry_counted_matches_tracemalloc():
    measured = measure_bytes_per_entry(1 << 13)
    # the count (sys.getsizeof of table, dict, keys, row ints) and tracemalloc agree within 10 %
    assert measured["counted_bytes_per_entry"] == pytest.approx(measured["traced_bytes_per_entry"], rel=0.10)
    assert 64 <= measured["counted_bytes_per_entry"] <= 64 + 200  # the row plus the dict's share
    m = make(capacity=1 << 30)
    store(m, range(300))
    stats = m.stats()
    assert stats["entries"] == 300 and stats["bytes_per_entry"] == m.metadata_bytes()["bytes_per_entry"] > 64


# ---------------------------------------------------------------- visibility

def test_a_block_is_visible_only_after_put_end():
    m = make()
    locs = m.put_start("r1", [key(0), key(1), key(2)], [100, 200, 300])
    assert [loc.length for loc in locs] == [100, 200, 300]
    assert m.lookup([key(0)]) == []
    assert m.put_end([key(0), key(2)], [11, 33]) == 2
    # the longest contiguous prefix: key 1 is still in flight, so key 2 is not returned
    assert (m.stats()["blocks"], m.stats()["pending_blocks"]) == (2, 1)
    got = m.lookup([key(0), key(1), key(2)])
    assert got == [BlockLoc(key(0), 0, 0, locs[0].offset, 100, 11, locs[0].version)]
    assert m.put_end([key(1)], [22]) == 1
    assert [b.checksum for b in m.lookup([key(0), key(1), key(2)])] == [11, 22, 33]
    s = m.stats()
    assert (s["entries"], s["blocks"], s["pending_blocks"]) == (3, 3, 0)
    assert (s["lookup_requests"], s["lookup_keys"], s["lookup_hits"]) == (3, 7, 4)
    assert (s["put_requests"], s["put_blocks"], s["registered_blocks"]) == (1, 3, 3)


def test_put_start_gives_none_for_stored_in_flight_and_repeated_keys():
    m = make()
    store(m, [0])
    m.put_start("a", [key(1)], [100])
    locs = m.put_start("b", [key(0), key(1), key(2), key(2)], [100] * 4)
    assert [loc is None for loc in locs] == [True, True, False, True]
    assert m.put_end([key(2), key(9)], [1, 2]) == 1  # key 9 was never started: skipped, counted out
    assert m.put_end([key(2)], [1]) == 0             # already registered
    v0 = m.lookup([key(0)])[0].version
    m.remove([key(0)])
    assert store(m, [0])[0].version > v0             # stored anew: a new version


# ---------------------------------------------------------------- put timeout, leases

def test_put_start_without_put_end_is_revoked_after_the_timeout():
    clock = ManualClock()
    m = make(clock, put_timeout_s=30.0)
    first = m.put_start("r", [key(0)], [100])[0]
    clock.advance(29.9)
    assert m.put_start("r2", [key(0)], [100]) == [None]  # still in flight
    clock.advance(0.2)
    assert m.put_end([key(0)], [5]) == 0                  # too late: revoked
    s = m.stats()
    # its writer may still be writing: the extent is held one more put timeout before it is free
    assert s["revoked_blocks"] == 1 and device_space(m)["used_bytes"] == 100
    again = m.put_start("r3", [key(0)], [100])[0]
    assert again.offset == first.offset + 100            # append-only: not back over the revoked extent
    assert m.put_revoke([key(0), key(5)]) == 1 and m.stats()["revoked_blocks"] == 2
    assert device_space(m)["used_bytes"] == 100          # revoked by its writer: freed at once
    clock.advance(29.9)
    m.expire()
    assert device_space(m)["used_bytes"] == 100
    clock.advance(0.2)
    m.expire()
    assert device_space(m)["used_bytes"] == 0


def test_a_timed_out_puts_extent_is_not_handed_out_while_its_writer_may_still_write():
    clock = ManualClock()
    m = make(clock, nodes=1, devices=1, capacity=300, put_timeout_s=30.0, high_watermark=1.0, low_watermark=1.0)
    slow = m.put_start("slow", [key(0)], [100])[0]
    m.put_start("fill", [key(1), key(2)], [100, 100])         # the device is full
    m.put_end([key(1), key(2)], [1, 1])
    m.remove([key(1), key(2)])
    clock.advance(31)                                           # the slow writer's put times out
    m.expire()
    # the freed extents come first, the slow writer's only after one more put timeout
    taken = [m.put_start(f"n{i}", [key(10 + i)], [100])[0] for i in range(2)]
    assert slow.offset not in {loc.offset for loc in taken}
    with pytest.raises(ChmError) as e:
        m.put_start("n2", [key(12)], [100])                     # only the held extent is left
    assert e.value.errno == errno.ENOSPC
    m.put_revoke([key(10), key(11)])
    clock.advance(30)
    m.expire()
    assert device_space(m)["used_bytes"] == 0                  # one more put timeout: free again
    later = m.put_start("later", [key(20), key(21), key(22)], [100] * 3)
    assert slow.offset in {loc.offset for loc in later}


def test_a_late_put_end_or_revoke_does_not_touch_another_requests_put_of_the_same_key():
    """A put that timed out, then the key started again by another request: the first writer's late put_end
    (with its WriteLoc.version) must not register the second's entry (whose bytes are not written yet), nor
    its late put_revoke drop it."""
    clock = ManualClock()
    m = make(clock, put_timeout_s=30.0)
    first = m.put_start("slow", [key(0)], [100])[0]
    clock.advance(31)
    second = m.put_start("fresh", [key(0)], [100])[0]      # the first put was revoked at its deadline
    assert second.version != first.version
    assert m.put_end([key(0)], [5], [first.version]) == 0  # the slow writer, too late: not its put any more
    assert m.put_revoke([key(0)], [first.version]) == 0
    assert m.lookup([key(0)]) == []                         # still in flight, for the fresh writer
    assert m.put_end([key(0)], [6], [second.version]) == 1
    assert [loc.checksum for loc in m.lookup([key(0)])] == [6]
    with pytest.raises(ChmError, match="versions has 2 items for 1 keys"):
        m.put_end([key(0)], [6], [1, 2])


def _over_watermark_with_pending(m: Master, first_id: int, count: int) -> None:
    """In-flight blocks (never evicted) that keep the device past its high watermark."""
    m.put_start("filler", [key(i) for i in range(first_id, first_id + count)], [100] * count)


def test_lease_renewals_stop_lease_max_after_the_first_grant():
    clock = ManualClock()
    m = make(clock, put_timeout_s=1000.0)   # lease 10 s, at most 30 s after the first grant
    store(m, [0])
    assert m.lookup([key(0)])               # t=0: first grant
    _over_watermark_with_pending(m, 100, 9)  # 1000 of 1000 bytes: only key 0 could be evicted
    for t in (9, 18, 27, 29.9):             # each renewal keeps it leased
        clock.advance(t - clock.now())
        assert m.lookup([key(0)]), t
    clock.advance(30.1 - clock.now())       # renewed at 27 for 10 s, but capped at 0 + 30
    assert m.lookup([key(0)]) == []
    assert m.stats()["evictions"] == 1


def test_a_lease_granted_after_the_last_one_ended_starts_a_new_cap():
    clock = ManualClock()
    m = make(clock, put_timeout_s=1000.0)
    store(m, [0])
    m.lookup([key(0)])        # lease until 10, cap 30
    clock.advance(25)         # ended; nothing forced an eviction
    m.lookup([key(0)])        # a new first grant: until 35, cap 55 (not the old cap of 30)
    _over_watermark_with_pending(m, 100, 9)
    clock.advance(6)
    assert found(m, [0]) == [0]   # t = 31: renewed to 41
    clock.advance(10.1)
    assert m.lookup([key(0)]) == []


def test_leased_and_in_flight_blocks_are_never_evicted():
    clock = ManualClock()
    m = make(clock, put_timeout_s=1000.0)
    store(m, range(5))                       # 500 bytes, complete
    m.lookup([key(i) for i in range(5)])     # all leased
    _over_watermark_with_pending(m, 100, 5)  # 1000 bytes: past 90 %
    assert m.stats()["evictions"] == 0 and device_space(m)["used_bytes"] == 1000
    clock.advance(10.0)                      # leases end: evicted down to 85 %, least recently used first
    m.expire()
    assert m.stats()["evictions"] == 2 and device_space(m)["used_bytes"] == 800
    assert found(m, range(5)) == [2, 3, 4]
    assert m.put_end([key(i) for i in range(100, 105)], [0] * 5) == 5  # the in-flight ones all survived


def test_watermark_eviction_takes_least_recently_used_complete_blocks():
    clock = ManualClock()
    m = make(clock)
    store(m, range(8))                 # 800 bytes, stored in order 0..7
    m.lookup([key(0)])                 # 0 becomes the most recently used
    clock.advance(11)                  # its lease is over
    m.put_start("p", [key(100)], [100])  # 900: not past 90 %
    assert m.stats()["evictions"] == 0
    m.put_start("q", [key(101)], [100])  # 1000 > 900: evict down to 850
    s = m.stats()
    assert s["evictions"] == 2 and device_space(m)["used_bytes"] == 800
    assert found(m, range(8)) == [0, 3, 4, 5, 6, 7]


# ---------------------------------------------------------------- allocation

def test_allocation_is_append_only_then_freed_extents_in_the_order_freed():
    m = make(capacity=1000, high_watermark=1.0, low_watermark=1.0)
    offsets = {i: loc.offset for i, loc in zip(range(8), store(m, range(8)))}
    assert list(offsets.values()) == [0, 100, 200, 300, 400, 500, 600, 700]
    m.remove([key(1)])
    assert store(m, [8])[0].offset == 800               # the head, not the hole at 100
    m.remove([key(5)])
    m.remove([key(3)])
    assert store(m, [9])[0].offset == 900               # the last room before the end
    assert [loc.offset for loc in store(m, [10, 11, 12])] == [100, 500, 300]  # freed order: 1, 5, 3


def test_a_full_device_evicts_to_make_room_and_refuses_only_when_all_is_leased():
    clock = ManualClock()
    m = make(clock, capacity=1000, high_watermark=1.0, low_watermark=1.0)
    store(m, range(10))
    assert m.put_start("x", [key(10)], [100])[0].offset == 0   # block 0 (least recently used) evicted for it
    assert m.stats()["evictions"] == 1 and found(m, [0]) == []
    m.lookup([key(i) for i in range(1, 10)])                   # every complete block leased
    assert m.put_revoke([key(10)]) == 1                         # room for one block, not two
    with pytest.raises(ChmError) as err:
        m.put_start("y", [key(11), key(12)], [100, 100])
    assert err.value.errno == errno.ENOSPC and "no room for 100 bytes" in str(err.value)
    s = m.stats()                                               # all or nothing: key 11 was given back
    assert (s["put_no_space"], s["pending_blocks"], s["used_bytes"]) == (1, 0, 900)
    assert m.put_start("z", [key(11)], [100])[0].offset == 0


def test_freed_neighbours_merge_and_fragmentation_is_reported():
    m = make(capacity=1000, high_watermark=1.0, low_watermark=1.0)
    store(m, range(10))
    m.remove([key(1)])
    m.remove([key(2)])                 # merges with 1: one extent [100, 300)
    m.remove([key(6)])
    space = device_space(m)
    assert (space["free_bytes"], space["freed_extents"], space["largest_free_extent"]) == (300, 2, 200)
    assert space["fragmentation"] == pytest.approx(1 - 200 / 300)
    assert store(m, [20], size=200)[0].offset == 100  # the merged extent holds a 200-byte block
    assert device_space(m)["fragmentation"] == 0.0    # one free run left


def test_a_block_removed_while_leased_keeps_its_space_until_the_lease_ends():
    clock = ManualClock()
    m = make(clock, capacity=1000, high_watermark=1.0, low_watermark=1.0)
    store(m, range(10))
    m.lookup([key(3)])                  # a reader holds block 3
    assert m.remove([key(3)]) == 1
    assert m.lookup([key(3)]) == []     # gone for new readers at once
    assert device_space(m)["used_bytes"] == 1000
    m.remove([key(5)])
    assert store(m, [20])[0].offset == 500   # 3's bytes are not handed out while leased
    clock.advance(10)
    m.expire()
    assert store(m, [21])[0].offset == 300


def test_draining_blocks_are_freed_in_lease_order_past_a_forgotten_one_whose_row_came_back():
    clock = ManualClock()
    m = make(clock, nodes=2, capacity=1000, high_watermark=1.0, low_watermark=1.0)
    on0 = m.put_start("a", [key(0)], [100])[0]
    on1 = m.put_start("b", [key(1), key(2)], [100, 100])
    assert (on0.node, {loc.node for loc in on1}) == (0, {1})
    m.put_end([key(0), key(1), key(2)], [1, 1, 1])
    m.lookup([key(0)])                       # t=0: leased until 10 s
    m.remove([key(0)])                       # draining on node 0
    clock.advance(5)
    m.lookup([key(1)])                       # t=5: leased until 15 s
    m.remove([key(1)])                       # draining on node 1, behind node 0's in the free order
    # node 0's device comes back with another epoch: its draining block is forgotten, its row reused
    m.register_node(0, "tcp://node0", [DeviceInfo(0, "/dev/shm/n0d0", 1000, 8)])
    m.put_start("c", [key(3)], [100])          # may take the forgotten row; its put deadline is 35 s
    m.lookup([key(2)])
    assert device_space(m, node=1)["used_bytes"] == 200
    clock.advance(10.5)                      # t=15.5: node 1's block's lease is over
    m.expire()
    assert device_space(m, node=1)["used_bytes"] == 100


# ---------------------------------------------------------------- placement and nodes

def test_round_robin_places_each_request_on_one_node_and_device():
    m = make(nodes=2, devices=2, capacity=10_000)
    placed = []
    for r in range(5):
        locs = m.put_start(f"r{r}", [key(10 * r + i) for i in range(3)], [100] * 3)
        assert len({(loc.node, loc.device) for loc in locs}) == 1   # a request stays on one device
        placed.append((locs[0].node, locs[0].device))
    assert placed == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0)]


def test_load_aware_places_on_the_node_with_the_least_used_bytes():
    m = make(nodes=3, devices=1, capacity=10_000, placement="load_aware")
    assert m.put_start("a", [key(0)], [500])[0].node == 0
    assert m.put_start("b", [key(1)], [300])[0].node == 1
    assert m.put_start("c", [key(2)], [100])[0].node == 2
    assert m.put_start("d", [key(3)], [100])[0].node == 2   # 100 < 300 < 500
    assert m.put_start("e", [key(4)], [150])[0].node == 2   # 200 < 300
    assert m.put_start("f", [key(5)], [10])[0].node == 1    # 300 < 350


def test_a_device_with_a_new_epoch_loses_its_blocks():
    m = make(devices=2)
    m.put_start("a", [key(0)], [100]); m.put_end([key(0)], [1])  # device 0
    m.put_start("b", [key(1)], [100]); m.put_end([key(1)], [1])  # device 1
    devices = [DeviceInfo(0, "/dev/shm/n0d0", 1000, 7), DeviceInfo(1, "/dev/shm/n0d1", 1000, 7)]
    m.register_node(0, "tcp://node0", devices)                    # same epochs: nothing changes
    assert found(m, [0, 1]) == [0, 1]
    m.register_node(0, "tcp://moved", [devices[0], DeviceInfo(1, "/dev/shm/n0d1", 1000, 8)])
    assert found(m, [0, 1]) == [0]
    assert m.stats()["stale_blocks"] == 1 and device_space(m, 0, 1)["used_bytes"] == 0
    assert m.nodes()[0]["endpoint"] == "tcp://moved" and m.nodes()[0]["devices"][1].epoch == 8


# ---------------------------------------------------------------- validation

OUTSIDE = "is outside the allowed range:"  # common.checks' one wording: field, value, allowed range
U32, U64 = "an integer in [1, 4294967295]", "an integer in [0, 18446744073709551615]"


@pytest.mark.parametrize("call, err, names", [
    (lambda m: m.lookup([b"short"]), errno.EINVAL, "keys[0] must be 16 bytes, got 5 bytes"),
    (lambda m: m.lookup("abc"), errno.EINVAL, "keys must be a list of 0 to 65536 items, got 'abc'"),
    (lambda m: m.lookup([key(0), 5]), errno.EINVAL, "keys[1] must be 16 bytes, got int"),
    (lambda m: m.put_start("r", [key(0)], [0]), errno.EINVAL, f"sizes[0] 0 {OUTSIDE} {U32}"),
    (lambda m: m.put_start("r", [key(0)], [2**32]), errno.EINVAL, f"sizes[0] 4294967296 {OUTSIDE} {U32}"),
    (lambda m: m.put_start("r", [key(0)], [1, 2]), errno.EINVAL, "sizes has 2 items for 1 keys"),
    (lambda m: m.put_start("", [key(0)], [1]), errno.EINVAL, f"request_id '' {OUTSIDE} a str of 1 to 256 characters"),
    (lambda m: m.put_start("r", [key(0)], [5000]), errno.ENOSPC, "5000 bytes exceed device 0 of node 0"),
    (lambda m: m.put_end([key(0)], [-1]), errno.EINVAL, f"checksums[0] -1 {OUTSIDE} {U64}"),
    (lambda m: m.put_end([key(0)], [2**64]), errno.EINVAL, f"checksums[0] 18446744073709551616 {OUTSIDE} {U64}"),
    (lambda m: m.put_end([key(0)], [True]), errno.EINVAL, f"checksums[0] True {OUTSIDE} {U64}"),
    (lambda m: m.register_node(70000, "e", [DeviceInfo(0, "p", 1, 1)]), errno.EINVAL,
     f"node 70000 {OUTSIDE} an integer in [0, 65535]"),
    (lambda m: m.register_node(1, "e", [DeviceInfo(256, "p", 1, 1)]), errno.EINVAL,
     f"devices[0].device 256 {OUTSIDE} an integer in [0, 255]"),
    (lambda m: m.register_node(1, "e", [DeviceInfo(0, "p", 0, 1)]), errno.EINVAL,
     f"devices[0].capacity_bytes 0 {OUTSIDE} an integer in [1, 9223372036854775807]"),
    (lambda m: m.register_node(1, "e", [DeviceInfo(0, "p", 1, 1)] * 2), errno.EINVAL, "devices[1].device 0 appears"),
    (lambda m: m.register_node(1, "e", []), errno.EINVAL, "devices must be a list of 1 to 65536 items, got 0 items"),
    (lambda m: m._device(0, 9), errno.ENOENT, "device 9 of node 0 is not registered"),
    (lambda m: m._device(4, 0), errno.ENOENT, "node 4 is not registered"),
])
def test_bad_input_is_refused_naming_field_value_and_range(call, err, names):
    m = make()
    with pytest.raises(ChmError) as exc:
        call(m)
    assert exc.value.errno == err and names in str(exc.value)


@pytest.mark.parametrize("kw, names", [
    ({"lease_s": 0}, f"lease_s 0 {OUTSIDE} a number in (0, 86400]"),
    ({"lease_s": 20, "lease_max_s": 10}, f"lease_max_s 10 {OUTSIDE} a number >= lease_s 20"),
    ({"put_timeout_s": float("nan")}, f"put_timeout_s nan {OUTSIDE} a number in (0, 86400]"),
    ({"high_watermark": 1.5}, f"high_watermark 1.5 {OUTSIDE} a number in (0, 1]"),
    ({"low_watermark": 0.95}, f"low_watermark 0.95 {OUTSIDE} a number <= high_watermark 0.9"),
    ({"placement": "random"}, f"placement 'random' {OUTSIDE} one of load_aware, round_robin"),
])
def test_bad_settings_are_refused(kw, names):
    with pytest.raises(ChmError) as exc:
        Master(ManualClock(), **kw)
    assert exc.value.errno == errno.EINVAL and names in str(exc.value)


def test_no_node_registered_is_enodev():
    with pytest.raises(ChmError) as exc:
        Master(ManualClock()).put_start("r", [key(0)], [1])
    assert exc.value.errno == errno.ENODEV


def test_leases_and_put_timeouts_hold_across_months_of_uptime():
    clock = ManualClock()
    m = make(clock, put_timeout_s=30.0)
    store(m, [0])
    for _ in range(4):               # 100 days: the u4 ms time base moves (every 24.8 days)
        clock.advance(25 * DAY)
        m.put_start("r", [key(1)], [100])
        clock.advance(29)
        assert m.put_start("r", [key(1)], [100]) == [None]   # still in flight after 29 s
        clock.advance(2)
        m.expire()
        assert m.put_end([key(1)], [1]) == 0                  # revoked after 30 s
        clock.advance(30)
        m.expire()                                            # and its extent free 30 s later
        assert m.lookup([key(0)])
        _over_watermark_with_pending(m, 100, 9)
        clock.advance(9.9)
        assert found(m, [0]) == [0]                             # still leased (renewed at +9.9)
        m.put_revoke([key(i) for i in range(100, 109)])
    assert m.stats()["evictions"] == 0


# ---------------------------------------------------------------- journal and snapshot, in process

def abandon(m: Master) -> None:
    """What kill -9 leaves: the journal as written so far, no snapshot, the lock released by the kernel."""
    m._journal.close()
    m._journal = None


def test_recovery_replays_the_journal_to_the_same_state(tmp_path):
    clock = ManualClock()
    m = make(clock, nodes=2, devices=2, state_dir=tmp_path, capacity=1000, put_timeout_s=30.0)
    for r in range(12):                                        # enough to evict, free and reuse extents
        store(m, range(10 * r, 10 * r + 3), request=f"r{r}")
    m.remove([key(11), key(51)])
    m.lookup([key(20)])
    m.remove([key(20)])                                        # leased: drained when the lease ends
    clock.advance(11)
    m.put_start("late", [key(500)], [100])
    m.put_revoke([key(500)])
    m.register_node(1, "tcp://node1", [DeviceInfo(0, "/dev/shm/n1d0", 1000, 7),
                                       DeviceInfo(1, "/dev/shm/n1d1", 1000, 9)])  # a new epoch: drops blocks
    m.expire()
    before_space = m.stats()["devices"]
    all_ids = range(200)
    before = {i: m.lookup([key(i)]) for i in all_ids}
    assert m.stats()["evictions"] > 0 and sum(bool(v) for v in before.values()) > 10
    abandon(m)
    r = Master(ManualClock(), str(tmp_path))
    assert r.stats()["devices"] == before_space                 # allocator state replayed exactly
    assert {i: r.lookup([key(i)]) for i in all_ids} == before
    assert r.nodes() == m.nodes()
    r.close()


def test_replay_keeps_a_removed_leased_block_out_of_the_free_order_until_its_lease_ends(tmp_path):
    clock = ManualClock()
    m = make(clock, state_dir=tmp_path, high_watermark=1.0, low_watermark=1.0)
    store(m, range(10))                     # the head is at the end: new blocks take freed extents
    m.lookup([key(3)])
    m.remove([key(3)])                      # leased: freed only when its lease ends
    m.remove([key(5)])
    assert store(m, [20])[0].offset == 500
    clock.advance(10)
    m.expire()
    assert store(m, [21])[0].offset == 300
    before = m.stats()["devices"]
    abandon(m)
    # replay must free 3's extent where the live Master did, or the offsets differ
    r = Master(ManualClock(), str(tmp_path), high_watermark=1.0, low_watermark=1.0)
    assert r.stats()["devices"] == before
    assert [b.offset for b in r.lookup([key(20)]) + r.lookup([key(21)])] == [500, 300]
    r.close()


def test_put_starts_in_flight_do_not_survive_and_their_space_is_freed(tmp_path):
    m = make(state_dir=tmp_path)
    store(m, [0])
    m.put_start("r", [key(1), key(2)], [100, 100])
    abandon(m)
    r = Master(ManualClock(), str(tmp_path))
    assert r.put_end([key(1), key(2)], [1, 2]) == 0
    space = device_space(r)
    assert (space["used_bytes"], space["write_head"], space["freed_extents"]) == (100, 300, 1)
    assert [b.key for b in r.lookup([key(0), key(1)])] == [key(0)]
    r.close()


def test_put_end_returns_only_after_its_records_are_fsynced(tmp_path, monkeypatch):
    import host_runtime.hymcache.journal as journal_module  # the journal's writes and fsyncs
    m = make(state_dir=tmp_path)
    journal = next(p for p in tmp_path.iterdir() if p.name.startswith("journal-"))
    synced_sizes = []
    real_fsync = os.fsync
    monkeypatch.setattr(journal_module.os, "fsync", lambda fd: (synced_sizes.append(os.fstat(fd).st_size),
                                                                real_fsync(fd)))
    m.put_start("r", [key(0)], [100])
    m.put_end([key(0)], [7])
    assert synced_sizes and synced_sizes[-1] == journal.stat().st_size > 0  # everything written is on disk
    count = len(synced_sizes)
    m.lookup([key(0)])                  # reads are not journaled: no fsync
    assert len(synced_sizes) == count
    m.close()


def test_snapshots_truncate_the_journal_and_recover_with_it(tmp_path):
    m = make(state_dir=tmp_path, capacity=1 << 20, snapshot_every=7)
    for i in range(40):
        store(m, [i])
    journals = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("journal-"))
    assert len(journals) == 1 and journals != ["journal-1"]    # several generations came and went
    assert (tmp_path / "snapshot.msgpack").exists()
    abandon(m)
    r = Master(ManualClock(), str(tmp_path))
    assert len(r.lookup([key(i) for i in range(40)])) == 40
    r.close()


def test_a_torn_last_record_is_dropped(tmp_path):
    m = make(state_dir=tmp_path)
    store(m, [0, 1])
    journal = next(p for p in tmp_path.iterdir() if p.name.startswith("journal-"))
    abandon(m)
    with open(journal, "ab") as f:
        f.write(b"\x30\x00\x00\x00garbage")              # a frame cut short by the crash
    r = Master(ManualClock(), str(tmp_path))
    assert len(r.lookup([key(0), key(1)])) == 2
    r.close()


def test_a_second_master_on_the_same_state_dir_is_refused(tmp_path):
    m = make(state_dir=tmp_path)
    with pytest.raises(ChmError) as exc:
        Master(ManualClock(), str(tmp_path))
    assert exc.value.errno == errno.EBUSY and str(os.getpid()) in str(exc.value)
    m.close()
    Master(ManualClock(), str(tmp_path)).close()


# ---------------------------------------------------------------- as a process over ZeroMQ

class MasterProcess:
    """``chm hymcache master`` as its own process (a SIGKILL needs one), on a free port."""

    def __init__(self, state_dir, *args):
        self.proc, info = master_proc(None, *args, state_dir=state_dir)
        self.endpoint = info["endpoint"]

    def kill9(self):
        kill9(self.proc)

    def stop(self) -> int:
        return stop_proc(self.proc)[0]


def test_a_master_killed_with_sigkill_answers_every_registered_block_after_restart(tmp_path):
    proc = MasterProcess(tmp_path, "--snapshot-every", "20")   # some blocks in the snapshot, some in the journal
    try:
        with MasterClient(proc.endpoint, timeout_s=10) as c:
            c.register_node(0, "tcp://manager0", [DeviceInfo(0, "/dev/shm/d0", 1 << 30, 3),
                                                  DeviceInfo(1, "/dev/shm/d1", 1 << 30, 3)])
            stored = []
            for r in range(9):
                keys = [key(100 * r + i) for i in range(4)]
                locs = c.put_start(f"req{r}", keys, [4096] * 4)
                assert all(isinstance(loc, WriteLoc) for loc in locs)
                assert c.put_end(keys, [r * 10 + i for i in range(4)]) == 4
                stored.append(keys)
            c.put_start("unfinished", [key(9999)], [4096])
            expected = [c.lookup(keys) for keys in stored]
            assert all(len(e) == 4 for e in expected)
        proc.kill9()
        proc = MasterProcess(tmp_path)
        with MasterClient(proc.endpoint, timeout_s=10) as c:
            assert [c.lookup(keys) for keys in stored] == expected
            assert c.lookup([key(9999)]) == [] and c.put_end([key(9999)], [0]) == 0
            assert c.nodes()[0]["devices"][1] == DeviceInfo(1, "/dev/shm/d1", 1 << 30, 3)
            with pytest.raises(RemoteError) as exc:                  # a bad call: the server answers, names it
                c.lookup([b"x" * 15])
            assert exc.value.errno == errno.EINVAL and "keys[0] must be 16 bytes, got 15 bytes" in str(exc.value)
            assert c.stats()["entries"] == 36
        assert proc.stop() == 0
    finally:
        if proc.proc.poll() is None:
            proc.kill9()


def test_served_methods_answer_typed_over_zeromq():
    with start_master(master_options(endpoint="tcp://127.0.0.1:0"), clock=ManualClock()) as running:
        m = running.master
        m.register_node(0, "tcp://node0", [DeviceInfo(0, "/dev/shm/n0d0", 10_000, 7)])
        running.serve_in_thread()
        with MasterClient(running.endpoint, timeout_s=10) as c:
            locs = c.put_start("r", [key(0), key(1)], [10, 20])
            assert locs == [WriteLoc(key(0), 0, 0, 0, 10, 1), WriteLoc(key(1), 0, 0, 10, 20, 2)]
            assert c.put_start("r", [key(0)], [10]) == [None]
            assert c.put_end([key(0), key(1)], [5, 6]) == 2
            assert c.lookup([key(0), key(1)]) == m.lookup([key(0), key(1)])
            assert (c.remove([key(1)]), c.put_revoke([key(0)])) == (1, 0)
            assert c.stats()["registered_blocks"] == 2
        assert set(MASTER_METHODS) == {"register_node", "nodes", "lookup", "put_start", "put_end", "put_revoke",
                                       "remove", "stats"}


@pytest.mark.parametrize("kw, names", [
    ({"metrics_port": 70000}, f"metrics_port 70000 {OUTSIDE} an integer in [0, 65535]"),
    ({"snapshot_every": 0}, f"snapshot_every 0 {OUTSIDE} an integer in [1, 1099511627776]"),
    ({"lease_s": True}, f"lease_s True {OUTSIDE} a number in (0, 86400]"),
    ({"recover_damaged": True}, f"recover_damaged True {OUTSIDE} false without a state_dir"),
    ({"lease": 5}, "lease is not a known field; known: lease_s, lease_max_s"),
])
def test_served_options_are_declared_once_and_refused_naming_field_value_and_range(kw, names):
    with pytest.raises(ChmError) as exc:
        master_options(**kw)
    assert exc.value.errno == errno.EINVAL and names in str(exc.value)


def test_a_started_master_that_never_served_closes_its_socket_and_state_dir(tmp_path):
    running = start_master(master_options(endpoint="tcp://127.0.0.1:0", state_dir=str(tmp_path)), clock=ManualClock())
    running.close()
    assert running.server.sock.closed
    Master(ManualClock(), str(tmp_path)).close()  # the state dir's lock is free again
