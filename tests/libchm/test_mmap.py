"""chm_mmap against a real `chm serve` (issue 26): bytes through the mapping and through chm_read agree both
ways, a scan larger than DRAM reads every byte right and counts as a chm_read scan (CHM_MAP_STRICT), prefetch
by pointer, and what the device refuses (its map request's fields, a policy it cannot map). The tests marked
``MODES`` run with faults served by the handler thread and in the faulting thread (CHM_MAP_INLINE)."""

from __future__ import annotations

import errno
import socket

import pytest

import libchm
from driver.wire import ffi as wire_ffi, lib as wire
from tests.driver.rawclient import RawClient
from tests.emulator.serve.serving import Server

PAGE = 64 << 10  # the small profile's page
SMALL_DRAM = ("--policy", "lru", "--set", "dram.size_bytes=16777216", "--set", "policy.prefetch_window_bytes=4194304")
DRAM_PAGES = 256
COUNTS = ("page_hits", "page_misses", "merged_misses", "reads")
MODES = pytest.mark.parametrize("inline", [False, True], ids=["handler-thread", "inline"])


def _unsupported():
    why = libchm.lib.chm_mmap_unsupported()
    return None if why == libchm.ffi.NULL else libchm.ffi.string(why).decode()


pytestmark = pytest.mark.skipif(_unsupported() is not None, reason=f"chm_mmap unsupported here: {_unsupported()}")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A device of 256 DRAM frames under lru, so a scan of 1024 pages evicts."""
    with Server(tmp_path_factory.mktemp("media"), None, "--format", *SMALL_DRAM) as srv:
        yield srv


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in COUNTS}


@MODES
def test_mapping_and_chm_read_agree(small, inline):
    with libchm.Device(small.path) as dev:
        view = dev.mmap(0, 8 * PAGE, inline=inline)
        view[100:105] = b"hello"  # a store through the mapping ...
        assert dev.read(100, 5) == b"hello"  # ... is what chm_read returns
        dev.write(3 * PAGE + 7, b"world")  # and a chm_write ...
        assert bytes(view[3 * PAGE + 7: 3 * PAGE + 12]) == b"world"  # ... what a load sees
        dev.flush()
        view[102:104] = b"LL"  # written again after the flush write-protected it: still reaches the device
        assert dev.read(100, 5) == b"heLLo"
        stats = dev.stats()
        assert stats["map_write_faults"] >= 2 and stats["map_writeprotects"] >= 1
        dev.munmap(view)


@MODES
def test_scan_larger_than_dram_reads_right_and_counts_as_chm_read(small, inline):
    pages = 4 * DRAM_PAGES
    with libchm.Device(small.path) as dev:
        base = 64 * PAGE
        for i in range(pages):
            dev.write(base + i * PAGE, i.to_bytes(4, "little") * 16)
        dev.flush()
        before = dev.stats()
        for i in range(pages):  # a chm_read scan, for the counts
            assert dev.read(base + i * PAGE, 64) == i.to_bytes(4, "little") * 16
        by_read = _delta(dev.stats(), before)
        view = dev.mmap(base, pages * PAGE, strict=True, inline=inline)
        before = dev.stats()
        wrong = [i for i in range(pages) if bytes(view[i * PAGE: i * PAGE + 64]) != i.to_bytes(4, "little") * 16]
        after = dev.stats()
        assert wrong == []
        assert _delta(after, before) == by_read  # the same hits and misses as the chm_read scan
        assert by_read["page_misses"] == pages  # 4x DRAM in order: every page a miss
        assert after["map_punches"] - before["map_punches"] >= pages - DRAM_PAGES  # evicted while mapped
        # The default mode counts first touches: a second pass over the last DRAM's worth hits.
        dev.munmap(view)
        view = dev.mmap(base, pages * PAGE, inline=inline)
        tail = range(pages - DRAM_PAGES // 2, pages)
        before = dev.stats()
        for _ in range(2):
            for i in tail:
                assert view[i * PAGE] == i & 0xFF
        got = _delta(dev.stats(), before)
        assert got["page_hits"] == len(tail) and got["page_misses"] == 0  # one access per page per residency


@MODES
def test_an_evicted_page_is_never_seen_stale_or_foreign(small, inline):
    base, other = 8 * 1024 * PAGE, 9 * 1024 * PAGE
    with libchm.Device(small.path) as dev, libchm.Device(small.path) as churn:
        for i in range(10):
            dev.write(base + i * PAGE, bytes([i + 1]) * 16)
        view = dev.mmap(base, 10 * PAGE, inline=inline)
        assert [view[i * PAGE] for i in range(10)] == list(range(1, 11))  # mapped: entries present
        for i in range(2 * DRAM_PAGES):  # another client's pages take every frame, ours are evicted
            churn.write(other + i * PAGE, bytes([0xEE]) * 16)
        for i in range(10):
            churn.write(base + i * PAGE, bytes([0x80 + i]) * 16)  # and our pages change meanwhile
        assert [view[i * PAGE] for i in range(10)] == [0x80 + i for i in range(10)]
        assert dev.stats()["map_punches"] >= 10


def _host_pages(page: int) -> bytes:
    """Page ``page``'s bytes: each of its 16 host pages filled with its own value."""
    return b"".join(bytes([(page * 16 + h) & 0xFF]) * 4096 for h in range(PAGE // 4096))


@MODES
def test_a_touch_mid_page_installs_its_host_page_and_a_second_one_the_rest(small, inline):
    """A read fault in the middle of a page installs that host page alone and keeps the lease open (the frame
    pinned); a second fault on the page installs the rest with no new device access. After churn has evicted
    the page, a host page never installed still shows its current bytes, never the frame's next page."""
    base, other = 12 * 1024 * PAGE, 13 * 1024 * PAGE
    with libchm.Device(small.path) as dev, libchm.Device(small.path) as churn:
        for i in range(4):
            dev.write(base + i * PAGE, _host_pages(i))
        view = dev.mmap(base, 4 * PAGE, inline=inline)
        before = dev.stats()
        assert view[2 * PAGE + 5 * 4096] == 2 * 16 + 5
        assert view[2 * PAGE + 9 * 4096] == 2 * 16 + 9
        after = dev.stats()
        assert after["map_faults"] - before["map_faults"] == 1 and after["page_hits"] - before["page_hits"] == 1
        assert bytes(view[2 * PAGE: 3 * PAGE]) == _host_pages(2)
        assert view[PAGE + 3 * 4096] == 16 + 3  # page 1: host page 3 only
        for i in range(2 * DRAM_PAGES):  # another client's pages take every frame
            churn.write(other + i * PAGE, bytes([0xEE]) * 16)
        churn.write(base + PAGE, _host_pages(7))  # and page 1 changes meanwhile
        assert view[PAGE + 3 * 4096] == 7 * 16 + 3 and bytes(view[PAGE: 2 * PAGE]) == _host_pages(7)
        assert bytes(view[2 * PAGE: 3 * PAGE]) == _host_pages(2)


def test_a_store_after_a_flush_survives_eviction(small):
    base, other = 10 * 1024 * PAGE, 11 * 1024 * PAGE
    with libchm.Device(small.path) as dev:
        view = dev.mmap(base, 4 * PAGE)
        view[0:4] = b"one."
        dev.flush()  # the page is clean now, and write-protected again in our mapping
        view[0:4] = b"two."  # so this store is admitted by the device: dirty again
        for i in range(2 * DRAM_PAGES):  # evict it: a clean page would be dropped, its bytes lost
            dev.read(other + i * PAGE, 16)
        assert dev.read(base, 4) == b"two."


def test_prefetch_by_pointer_then_first_touch_hits(small):
    with libchm.Device(small.path) as dev:
        view = dev.mmap(0, 2048 * PAGE)
        address = int(libchm.ffi.cast("uintptr_t", libchm.ffi.from_buffer(view))) + 1500 * PAGE
        req = dev.prefetch_ptr(address, 4 * PAGE)
        dev.wait(req)
        before = dev.stats()
        assert [view[(1500 + i) * PAGE] for i in range(4)] == [0] * 4
        assert _delta(dev.stats(), before)["page_hits"] == 4
        dev.release(req)
        with pytest.raises(libchm.ChmError) as exc:
            dev.prefetch_ptr(address - 1600 * PAGE, PAGE)
        assert exc.value.errno == errno.EFAULT
        assert dev.map_error(address) == 0


def test_bad_arguments_are_named(small):
    with libchm.Device(small.path) as dev:
        for kwargs, err in ((dict(addr=1), errno.EINVAL), (dict(length=PAGE + 1), errno.EINVAL),
                            (dict(addr=dev.info()["capacity_bytes"]), errno.ERANGE), (dict(strict=1), errno.EINVAL),
                            (dict(inline="yes"), errno.EINVAL)):
            with pytest.raises(libchm.ChmError) as exc:
                dev.mmap(**kwargs)
            assert exc.value.errno == err, kwargs


def _map_request(node, fds, **fields) -> int:
    """Attach a raw client, send a map request with ``fields`` over the defaults; the answer's status."""
    c = RawClient(node)
    req = {"magic": wire.CHM_WIRE_MAGIC, "op": wire.CHM_CTL_MAP, "dev_addr": 0, "len": PAGE, "base": 1 << 40,
           **fields}
    payload = bytes(wire_ffi.buffer(wire_ffi.new("struct chm_map_req *", req)))
    socket.send_fds(c.sock, [payload], fds)
    msg, got, _, _ = socket.recv_fds(c.sock, wire_ffi.sizeof("struct chm_map_resp"), 1)
    for fd in got:
        socket.close(fd)
    c.sock.close()
    return wire_ffi.cast("struct chm_map_resp *", wire_ffi.from_buffer(msg)).status


def test_map_request_fields_are_checked(small):
    import os
    uffd = os.open("/dev/null", os.O_RDONLY)  # not a userfaultfd
    try:
        assert _map_request(small.node, [uffd]) == -errno.EINVAL
        assert _map_request(small.node, []) == -errno.EINVAL
        assert _map_request(small.node, [uffd, uffd]) == -errno.EINVAL
        for field, value in (("magic", 1), ("op", 2), ("dev_addr", 1), ("len", 0), ("len", PAGE + 1),
                             ("base", 0), ("base", 1 << 47), ("rsvd0", 1)):
            status = _map_request(small.node, [uffd], **{field: value})
            assert status in (-errno.EINVAL, -errno.EPROTO), (field, value, status)
    finally:
        os.close(uffd)
    with libchm.Device(small.path) as dev:  # the device still maps and serves
        view = dev.mmap(0, PAGE)
        view[0:2] = b"ok"
        assert dev.read(0, 2) == b"ok"


def test_a_device_without_bytes_is_eopnotsupp_and_says_why(tmp_path):
    with Server(tmp_path, None, "--set", "emulation.data=false") as srv, libchm.Device(srv.path) as dev:
        with pytest.raises(libchm.ChmError) as exc:
            dev.mmap(0, PAGE)
        assert exc.value.errno == errno.EOPNOTSUPP and "emulation.data is off" in str(exc.value)


@pytest.fixture(scope="module")
def hym(tmp_path_factory):
    """hymcache: a page written goes to a write-buffer frame of its own, beside its read copy."""
    with Server(tmp_path_factory.mktemp("media"), None, "--format", "--policy", "hymcache") as srv:
        yield srv


@MODES
def test_hymcache_a_store_moves_the_page_to_the_write_buffer_and_no_copy_goes_stale(hym, inline):
    base = 3 << 30
    with libchm.Device(hym.path) as writer, libchm.Device(hym.path) as reader:
        writer.write(base, b"A" * PAGE)
        writer.flush()
        assert writer.read(base, 4) == b"AAAA"  # staged in the read area
        seen = reader.mmap(base, 4 * PAGE, inline=inline)
        assert bytes(seen[0:4]) == b"AAAA"  # the reader maps the read area's frame
        view = writer.mmap(base, 4 * PAGE, inline=inline)
        view[1:3] = b"bc"  # the store: a write-buffer frame with the page's bytes, the read copy dropped
        assert bytes(seen[0:4]) == b"AbcA" and writer.read(base, 4) == b"AbcA"
        writer.flush()  # flushed: the write-buffer frame is freed, later reads stage the page again
        assert bytes(seen[0:4]) == b"AbcA" and bytes(view[0:4]) == b"AbcA"
        view[3:4] = b"d"
        assert reader.read(base, 4) == b"Abcd"
