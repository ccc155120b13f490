"""The controller's decision blocks on their own (also the RTL's reference models)."""

import errno

import pytest

from emulator import ChmError
from emulator.frame_table import FrameTable
from emulator.prefetch import PrefetchEngine
from emulator.write_buffer import FlushArbiter, WriteAdmission


def test_frame_table_set_mapping_and_free_ways():
    t = FrameTable(frames=8, ways=2)  # 4 sets
    assert t.insert(5).frame == 2  # set 1, way 0
    assert t.insert(9).frame == 3  # set 1, way 1
    assert t.lookup(5) == 2 and t.lookup(13) is None
    t.invalidate(2)
    assert t.insert(13).frame == 2  # lowest free way again


def test_frame_table_lru_victim_skips_pinned_and_reports_dirty():
    t = FrameTable(frames=3)  # fully associative
    for page in (10, 11, 12):
        t.insert(page)
    t.mark_dirty(t.lookup(10))
    t.touch(t.lookup(10))  # LRU order now 11, 12, 10
    t.pin(t.lookup(11))
    ins = t.insert(13)
    assert (ins.victim_page, ins.victim_dirty) == (12, False)
    t.unpin(t.lookup(11))
    ins = t.insert(14)
    assert ins.victim_page == 11
    ins = t.insert(15)
    assert (ins.victim_page, ins.victim_dirty) == (10, True)
    for page in (13, 14, 15):
        t.pin(t.lookup(page))
    assert t.insert(16) is None  # every way pinned


def test_frame_table_rejects_bad_geometry():
    with pytest.raises(ValueError, match="multiple of ways"):
        FrameTable(frames=6, ways=4)


def test_prefetch_engine_window_and_handles():
    e = PrefetchEngine(window_pages=4, max_handles=2)
    e.issue(1, first_page=10, pages=3)
    assert [e.next_fetch() for _ in range(3)] == [(1, 10), (1, 11), (1, 12)] and e.next_fetch() is None
    with pytest.raises(ChmError) as exc:
        e.issue(2, 0, 2)
    assert exc.value.errno == errno.EBUSY
    e.issue(2, 0, 1)
    with pytest.raises(ChmError) as exc:
        e.issue(3, 0, 1)
    assert exc.value.errno == errno.EBUSY  # handle limit
    assert [e.arrived(1), e.arrived(1), e.arrived(1)] == [False, False, True]
    assert e.release(1).pages == 3 and e.pages_held == 1
    with pytest.raises(ChmError) as exc:
        e.release(1)
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(ChmError) as exc:
        e.issue(2, 0, 1)
    assert exc.value.errno == errno.EINVAL  # handle in use


def test_write_admission_is_all_or_nothing():
    w = WriteAdmission(4)
    assert w.admit(3) and not w.admit(2) and w.used_pages == 3
    assert w.admit(1) and w.free_pages == 0
    w.release(2)
    assert w.admit(2) and not w.admit(1)


@pytest.mark.parametrize("dirty,reads,age,force,grant", [
    (0, 0, 1e9, True, 0),      # nothing to flush
    (10, 5, 0, True, 4),       # forced: regardless of reads, in batches
    (10, 1, 1e9, False, 0),    # reads in flight: wait
    (10, 0, 0, False, 4),      # a full batch while reads are idle
    (3, 0, 0, False, 0),       # a partial batch waits ...
    (3, 0, 500, False, 3),     # ... until its oldest page is old enough
])
def test_flush_arbiter(dirty, reads, age, force, grant):
    assert FlushArbiter(batch_pages=4, max_reads_in_flight=0, max_delay_ns=500).grant(dirty, reads, age, force) == grant
