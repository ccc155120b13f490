"""The bindings' sharp edges (issue #9, item 5): staging-buffer views that outlive their handle, split
writes that are refused part way, arguments checked and named before anything is allocated, closed
C handles, and the client side of the attach request's prefetch share and the node's device epoch."""

import errno
import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from driver.wire import ffi as wire_ffi
from driver.wire import lib as wire_lib
from libchm import ChmError, Device, WriteBufferFull, ffi, lib
from tests.emulator.serve.serving import ROOT, Server, compile_c

HERE = Path(__file__).resolve().parent
MIB = 1 << 20



def run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: a crash there (SIGSEGV) fails the test instead of killing pytest."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


# ---- buffer() views ------------------------------------------------------------------------------------

def test_view_of_a_collected_temporary_device_stays_usable(served):
    # The Device is garbage at once: today's chm_close unmapped the buffer under the view (SIGSEGV).
    proc = run_python(f"""
import gc
from libchm import Device
v = Device({served.node!r}).buffer()
gc.collect()
v[0:4] = b"abcd"
assert bytes(v[0:4]) == b"abcd"
print("ok")
""")
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "ok"


def test_view_after_close_is_detached_and_the_mapping_goes_with_the_last_view(served):
    proc = run_python(f"""
import errno
from pathlib import Path
from libchm import ChmError, Device

def qp_mappings():  # queue pair memfds mapped here (the server names them chm-qp-N)
    return sum("memfd:chm-qp-" in line for line in Path("/proc/self/maps").read_text().splitlines())

d = Device({served.node!r})
d.write(5 << 20, b"device bytes")
view = d.buffer()
head = view[:64]  # a slice holds the mapping as well
d.close()
try:
    d.buffer()
    raise AssertionError("buffer() after close() did not raise")
except ChmError as exc:
    assert exc.errno == errno.ENODEV
view[:12] = b"after close!"  # no fault: still mapped, but nothing reads it any more
assert bytes(head[:12]) == b"after close!"
with Device({served.node!r}) as other:
    assert bytes(other.buffer()[:12]) != b"after close!"  # another queue pair: not those bytes
    assert other.read(5 << 20, 12) == b"device bytes"
del d, view
assert qp_mappings() == 1, qp_mappings()  # `head` still holds it
del head
assert qp_mappings() == 0, qp_mappings()  # the last view took the mapping with it: no leak
print("ok")
""")
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "ok"


# ---- split writes ------------------------------------------------------------------------------------

# A 4 MiB write buffer that nothing drains while the test runs: flushing starts only when a batch is
# full and takes seconds of modelled time on these SSDs (idle wall time passes on the device too, but
# not that much).
FOUR_MIB_WRITE_BUFFER = ("--policy", "hymcache", "--set", "dram.size_bytes=16777216",
                         "--set", "policy.write_buffer_fraction=0.25", "--set", "policy.flush_batch_bytes=4194304",
                         "--set", "policy.prefetch_window_bytes=1048576", "--set", "policy.flush_max_delay_ns=1e15",
                         "--set", "ssd.write_latency_ns=1e9", "--set", "ssd.write_bandwidth_gbps=0.001")


def test_split_write_refused_part_way_raises_with_the_bytes_written(tmp_path):
    with Server(tmp_path / "media", None, *FOUR_MIB_WRITE_BUFFER) as srv, \
            Device(srv.node, staging_bytes=2 * MIB) as d:
        assert d.info()["write_buffer_bytes"] == 4 * MIB and d.info()["staging_bytes"] == 2 * MIB
        data = os.urandom(6 * MIB)  # three commands of 2 MiB: two fit the write buffer, the third does not
        with pytest.raises(WriteBufferFull) as exc:
            d.write(0, data)
        assert exc.value.errno == errno.EAGAIN
        assert exc.value.written == 4 * MIB
        assert "4194304" in str(exc.value)
        assert d.read(0, 4 * MIB) == data[:4 * MIB]     # the parts before the refused one stay written
        assert d.read(4 * MIB, 2 * MIB) == bytes(2 * MIB)  # the refused part is not there
        with pytest.raises(WriteBufferFull) as exc:      # a single command: all or nothing, written 0
            d.write(8 * MIB, data[:MIB])
        assert exc.value.written == 0


def test_write_buffer_full_keeps_its_old_constructor():
    assert WriteBufferFull("refused").written == 0
    assert WriteBufferFull("refused", written=4096).written == 4096


# ---- arguments -------------------------------------------------------------------------------------

class Index:
    """An integer-like object that is not an int (as numpy.int64 is)."""

    def __init__(self, value: int):
        self.value = value

    def __index__(self) -> int:
        return self.value


def expect_error(call, err: int | None, *named: str) -> ChmError:
    """``call()`` raises exactly ChmError, with errno ``err`` (None: any) and every word of ``named``."""
    with pytest.raises(ChmError) as exc:
        call()
    assert type(exc.value) is ChmError and err in (None, exc.value.errno), exc.value
    for word in named:
        assert word in exc.value.message, (word, exc.value.message)
    return exc.value


def test_arguments_are_checked_and_named_before_anything_is_allocated(dev):
    cap = dev.info()["capacity_bytes"]
    # 1 TiB read: refused against the capacity before a 1 TiB buffer is allocated (today: MemoryError).
    expect_error(lambda: dev.read(0, 2**40), errno.ERANGE, "length", str(2**40), f"[1, {cap}]")
    expect_error(lambda: dev.read(cap - 8, 16), errno.ERANGE, "length", "16", "[1, 8]")
    for addr in (2**64, 2**64 + 1, cap, -1):  # today: OverflowError from cffi for 2**64
        expect_error(lambda: dev.read(addr, 1), errno.ERANGE, "address", str(addr), f"[0, {cap - 1}]")
        expect_error(lambda: dev.write(addr, b"x"), errno.ERANGE, "address", str(addr))
        expect_error(lambda: dev.prefetch(addr, 1), errno.ERANGE, "address", str(addr))
        expect_error(lambda: dev.read_into(addr, bytearray(1)), errno.ERANGE, "address", str(addr))
    expect_error(lambda: dev.prefetch(0, 2**64), errno.ERANGE, "size", str(2**64))
    expect_error(lambda: dev.read(0, -5), errno.EINVAL, "length", "-5")
    expect_error(lambda: dev.read(0.0, 4), errno.EINVAL, "address", "0.0", "float")
    expect_error(lambda: dev.read(0, 4.0), errno.EINVAL, "length", "4.0")
    expect_error(lambda: dev.read(True, 4), errno.EINVAL, "address", "True")
    expect_error(lambda: dev.read_into(0, b"read-only"), errno.EINVAL, "buf")
    for handle in (0, -1, 2**63, 2**64):
        expect_error(lambda: dev.wait(handle), errno.EINVAL, "prefetch handle", str(handle), f"[1, {2**63 - 1}]")
        expect_error(lambda: dev.release(handle), errno.EINVAL, "prefetch handle", str(handle))
    for timeout in (-1, 2**31, float("nan"), float("inf"), "10"):
        expect_error(lambda: dev.wait(1, timeout_ms=timeout), errno.EINVAL, "timeout_ms", repr(timeout))
    # What passes: integer-like objects, and fractional timeouts (rounded up to whole ms).
    assert dev.write(Index(4096), b"abc") == 3
    assert dev.read(Index(4096), Index(3)) == b"abc"
    handle = dev.prefetch(0, 4096)
    dev.wait(Index(handle), timeout_ms=2.5)
    dev.release(Index(handle))


def test_open_options_are_checked_and_named(served):
    bad = [
        ({"staging_bytes": -1}, "staging_bytes", "-1"),
        ({"staging_bytes": 2**64}, "staging_bytes", str(2**64)),
        ({"staging_bytes": (1 << 30) + 1}, "staging_bytes", "1073741824"),
        ({"staging_bytes": 1.5}, "staging_bytes", "1.5"),
        ({"queue_entries": 3}, "queue_entries", "power of two in [2, 4096]"),
        ({"queue_entries": 8192}, "queue_entries", "8192"),
        ({"queue_entries": -64}, "queue_entries", "-64"),
        ({"prefetch_share": 0}, "prefetch_share", "(0, 1]"),
        ({"prefetch_share": 1.5}, "prefetch_share", "1.5"),
        ({"prefetch_share": -0.25}, "prefetch_share", "-0.25"),
        ({"prefetch_share": float("nan")}, "prefetch_share", "nan"),
        ({"prefetch_share": "half"}, "prefetch_share", "'half'"),
    ]
    for kwargs, *named in bad:
        expect_error(lambda: Device(served.node, **kwargs), errno.EINVAL, *named)
    with Device(served.node, staging_bytes=Index(4 * MIB), queue_entries=Index(8), prefetch_share=1) as d:
        assert d.info()["staging_bytes"] == 4 * MIB


# ---- the C library -----------------------------------------------------------------------------------

def test_c_double_close_and_use_after_close_are_refused(served, tmp_path):
    exe = compile_c(HERE / "closed_handle.c", tmp_path / "closed_handle")
    proc = subprocess.run([str(exe), served.node], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stdout}{proc.stderr}"  # today: SIGABRT (double free)
    assert "every call refused" in proc.stdout


def test_c_buffer_mapping_outlives_close_until_the_last_reference(served, tmp_path):
    exe = compile_c(HERE / "buffer_mapping.c", tmp_path / "buffer_mapping")
    proc = subprocess.run([str(exe), served.node], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stdout}{proc.stderr}"
    assert "unmapped with the last reference" in proc.stdout


def test_strerror_texts_of_the_media_errors():
    text = {err: ffi.string(lib.chm_strerror(-err)).decode() for err in (errno.ENOSPC, errno.EIO, errno.EBADF)}
    assert text[errno.ENOSPC] == "no space on the media (or a result larger than the buffer)"
    assert text[errno.EIO] == "media I/O error or device internal error"
    assert "closed" in text[errno.EBADF]


class FakeAttachServer:
    """A node and control socket that take one attach request, keep it, and refuse it (EACCES)."""

    def __init__(self, directory: Path):
        self.path = directory / "node"
        node = wire_ffi.new("struct chm_node *", {"magic": wire_lib.CHM_WIRE_MAGIC, "version": wire_lib.CHM_WIRE_VERSION})
        self.path.write_bytes(bytes(wire_ffi.buffer(node)))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(f"{self.path}.sock")
        self.listener.listen(1)
        self.request = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            raw = conn.recv(wire_ffi.sizeof("struct chm_attach_req"), socket.MSG_WAITALL)
            self.request = wire_ffi.new("struct chm_attach_req *")
            wire_ffi.memmove(self.request, raw, len(raw))
            resp = wire_ffi.new("struct chm_attach_resp *", {"status": -errno.EACCES})
            conn.sendall(bytes(wire_ffi.buffer(resp)))

    def attach(self, opts) -> tuple[int, object]:
        out = ffi.new("chm_dev **")
        ret = lib.chm_open_opts(str(self.path).encode(), opts, out)
        self.thread.join(10)
        self.listener.close()
        return ret, self.request


def open_opts(**fields):
    return ffi.new("struct chm_open_opts *", {"size": ffi.sizeof("struct chm_open_opts"), **fields})


@pytest.mark.parametrize("share, ppm", [(0.25, 250000), (1.0, 1000000), (1 / 3, 333333), (1e-9, 1), (0.0, 0)])
def test_prefetch_share_is_sent_in_the_attach_request(tmp_path, share, ppm):
    ret, req = FakeAttachServer(tmp_path).attach(open_opts(prefetch_share=share))
    assert ret == -errno.EACCES
    assert (req.prefetch_share_ppm, req.rsvd0, req.staging_bytes) == (ppm, 0, 16 * MIB)


def test_prefetch_share_reaches_the_device(served):
    # The device holds a client to its share of the prefetch handles (and pages): a quarter of them here.
    with Device(served.node, prefetch_share=0.25) as quarter, Device(served.node) as whole:
        limit = quarter.info()["prefetch_max_handles"] // 4
        handles = [quarter.prefetch(i << 16, 4096) for i in range(limit)]
        with pytest.raises(ChmError) as busy:
            quarter.prefetch(0, 4096)
        assert busy.value.errno == errno.EBUSY
        # The wire carries only the errno; the binding fetches the device's word for which limit it was.
        assert f"this client's prefetch share is full: it holds {limit} of its {limit} handles" in str(busy.value)
        more = whole.prefetch(0, 4096)  # the window itself is not full: only the quarter share is
        for h in handles:
            quarter.release(h)
        whole.release(more)


@pytest.mark.parametrize("size_past_spin_us", [0, 4])
def test_an_older_callers_smaller_options_struct_still_works(tmp_path, size_past_spin_us):
    # An old caller's struct ends before prefetch_share (or within it): bytes past its size are not read.
    raw = ffi.new("char[]", b"\xff" * ffi.sizeof("struct chm_open_opts"))
    opts = ffi.cast("struct chm_open_opts *", raw)
    opts.size, opts.staging_bytes, opts.queue_entries, opts.spin_us = \
        ffi.offsetof("struct chm_open_opts", "prefetch_share") + size_past_spin_us, 4 * MIB, 16, 10
    assert math.isnan(opts.prefetch_share)
    ret, req = FakeAttachServer(tmp_path).attach(opts)
    assert ret == -errno.EACCES
    assert (req.prefetch_share_ppm, req.staging_bytes, req.sq_entries) == (0, 4 * MIB, 16)


@pytest.mark.parametrize("share", [1.0000001, 2.0, -0.5, float("nan"), float("inf"), -float("inf")])
def test_prefetch_share_outside_its_range_is_einval_in_c(share):
    out = ffi.new("chm_dev **")
    assert lib.chm_open_opts(b"/nonexistent/node", open_opts(prefetch_share=share), out) == -errno.EINVAL
    assert out[0] == ffi.NULL


def test_info_carries_the_nodes_device_epoch(served, dev):
    # The server writes the epoch into the node; put a known one there (restored after) and read it back.
    offset = wire_ffi.offsetof("struct chm_node", "device_epoch")
    epoch = 0x0123456789ABCDEF
    with open(served.path, "r+b") as node:
        node.seek(offset)
        published = node.read(8)
        node.seek(offset)
        node.write(epoch.to_bytes(8, sys.byteorder))
        node.flush()
        try:
            info = ffi.new("struct chm_info *")
            assert lib.chm_get_info(dev.dev, info) == 0 and info.device_epoch == epoch
            assert dev.info()["device_epoch"] == epoch
        finally:
            node.seek(offset)
            node.write(published)


def test_submitted_reads_land_in_the_buffer_and_complete_in_order(dev):
    data = bytes(range(256)) * (3 * 4096 // 256)
    dev.write(0, data)
    view = dev.buffer()
    for i in range(3):
        dev.submit_read(i * 4096, view[i * 4096:(i + 1) * 4096], user_data=100 + i)
    with pytest.raises(ChmError) as exc:  # the synchronous calls wait until they are reaped
        dev.read(0, 1)
    assert exc.value.errno == errno.EBUSY
    done = dev.reap(3, 3)
    assert [(u, n) for u, n, _ in done] == [(100, 4096), (101, 4096), (102, 4096)]
    assert all(latency > 0 for _, _, latency in done)
    assert bytes(view[:3 * 4096]) == data
    assert dev.read(0, 4) == data[:4]  # synchronous again


@pytest.mark.parametrize("call, err, words", [
    (lambda d: d.submit_read(0, bytearray(16)), errno.EFAULT, "outside the staging buffer"),
    (lambda d: d.submit_read(0, d.buffer()[:16], user_data=-1), errno.EINVAL, "user_data"),
    (lambda d: d.submit_read(0, b"read-only"), errno.EINVAL, "writable"),
    (lambda d: d.reap(1), errno.EINVAL, "in flight"),
    (lambda d: d.reap(2, 1), errno.EINVAL, "min_wait"),
])
def test_submit_and_reap_arguments_are_checked(dev, call, err, words):
    with pytest.raises(ChmError) as exc:
        call(dev)
    assert exc.value.errno == err and words in str(exc.value)


# ---- misuse: every method's bad arguments are a ChmError naming the argument (issue #21) --------------------

def released_view() -> memoryview:
    view = memoryview(bytearray(16))
    view.release()
    return view


BAD_BUFFERS = [  # (object, words of why it is refused)
    (memoryview(bytearray(16))[::2], "non-contiguous memoryview (shape (8,), strides (2,))"),  # was BufferError
    (np.zeros((4, 4))[:, 1], "non-contiguous ndarray"),                                      # was ValueError
    (released_view(), "released"),                                                           # was ValueError
    ("text", "not str"), (None, "not NoneType"), (7, "not int"),
]


@pytest.mark.parametrize("obj, why", BAD_BUFFERS, ids=[why.split(" (")[0] for _, why in BAD_BUFFERS])
def test_buffers_that_are_not_c_contiguous_bytes_are_einval_naming_the_argument(dev, obj, why):
    expect_error(lambda: dev.write(0, obj), errno.EINVAL, "data must be a C-contiguous bytes-like object", why)
    expect_error(lambda: dev.read_into(0, obj), errno.EINVAL, "buf must be a writable C-contiguous", why)
    expect_error(lambda: dev.submit_read(0, obj), errno.EINVAL, "buf (a writable slice of buffer())", why)


def test_a_read_only_buffer_to_read_into_is_einval_naming_its_size(dev):
    expect_error(lambda: dev.read_into(0, memoryview(b"ro")), errno.EINVAL, "buf", "read-only memoryview of 2 bytes")
    expect_error(lambda: dev.read_into(0, b"abc"), errno.EINVAL, "buf", "read-only bytes of 3 bytes")


BAD_INTEGERS = [None, True, False, 1.5, float("nan"), "1", [1], -1, -2**70, 2**64, 2**200]


def test_every_methods_bad_arguments_are_a_chm_error_naming_argument_and_value(dev):
    handle = dev.prefetch(0, 4096)
    view = dev.buffer()[:16]
    calls = {  # method: (its arguments' names in the errors, good arguments)
        "write": (("address", "data"), (0, b"ab")),
        "read": (("address", "length"), (0, 2)),
        "read_into": (("address", "buf"), (0, bytearray(2))),
        "submit_read": (("address", "buf", "user_data"), (0, view, 0)),
        "reap": (("min_wait", "max_completions"), (0, 1)),
        "prefetch": (("address", "size"), (0, 4096)),
        "wait": (("prefetch handle", "timeout_ms"), (handle, 10)),
        "poll": (("prefetch handle",), (handle,)),
        "release": (("prefetch handle",), (handle,)),
    }
    for method, (names, good) in calls.items():
        for i, name in enumerate(names):
            for value in BAD_INTEGERS:
                if name == "timeout_ms" and value in (None, 1.5):
                    continue  # no bound; a fraction of a ms (rounded up)
                args = list(good)
                args[i] = value
                exc = expect_error(lambda: getattr(dev, method)(*args), None, name)
                assert exc.errno in (errno.EINVAL, errno.ERANGE), (method, name, value, exc)
                if name in ("data", "buf"):
                    assert type(value).__name__ in exc.message, (method, value, exc.message)
                else:
                    assert repr(value) in exc.message or str(value) in exc.message, (method, value, exc.message)
    dev.release(handle)
    assert dev.reap(0) == []  # nothing was submitted
