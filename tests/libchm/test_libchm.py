"""libchm through its Python binding (which calls the C API): errors, data, parity with the in-process Device."""

import errno
import os
import random

import pytest

import libchm
from emulator import Device as InProcessDevice
from libchm import ChmError, Device, WriteBufferFull
from libchm import ffi, lib
from tests.emulator.serve.serving import Server, unique_node

# A device whose write buffer fills fast and is flushed only when full, by SSDs so slow (seconds of
# modelled time per batch) that the wall time the device idles between our calls never empties it.
TIGHT_WRITE_BUFFER = ("--set", "dram.size_bytes=8388608", "--set", "policy.write_buffer_fraction=0.25",
                      "--set", "policy.flush_batch_bytes=2097152", "--set", "policy.prefetch_window_bytes=1048576",
                      "--set", "policy.flush_max_delay_ns=1e15", "--set", "ssd.write_latency_ns=1e9",
                      "--set", "ssd.write_bandwidth_gbps=0.001")



def test_missing_node_is_enodev():
    with pytest.raises(ChmError) as exc:
        Device(unique_node("absent"))
    assert exc.value.errno == errno.ENODEV
    out = ffi.new("chm_dev **")
    assert lib.chm_open(b"/dev/shm/" + unique_node("absent").encode(), out) == -errno.ENODEV


def test_device_env_variable_names_the_node(served, monkeypatch):
    monkeypatch.setenv("CHM_DEVICE", served.node)
    with Device() as d:
        assert d.info()["server_pid"] == served.proc.pid


def test_bad_addresses_and_lengths(dev):
    cap = dev.info()["capacity_bytes"]
    cases = [
        (lambda: dev.read(cap, 1), errno.ERANGE),
        (lambda: dev.read(cap - 10, 11), errno.ERANGE),
        (lambda: dev.write(cap - 1, b"ab"), errno.ERANGE),
        (lambda: dev.read(-1, 4), errno.ERANGE),
        (lambda: dev.read(0, 0), errno.EINVAL),
        (lambda: dev.write(0, b""), errno.EINVAL),
        (lambda: dev.write(0, "text"), errno.EINVAL),
        (lambda: dev.prefetch(cap - 4096, 8192), errno.ERANGE),
        (lambda: dev.prefetch(0, 0), errno.EINVAL),
    ]
    for call, err in cases:
        with pytest.raises(ChmError) as exc:
            call()
        assert exc.value.errno == err
    # The same checks in the C library itself (no Python guard in front).
    buf = ffi.new("char[]", 16)
    assert lib.chm_read(dev.dev, cap, buf, 16) == -errno.ERANGE
    assert lib.chm_read(dev.dev, 2**64 - 8, buf, 16) == -errno.ERANGE
    assert lib.chm_read(dev.dev, 0, buf, 0) == -errno.EINVAL
    assert lib.chm_write(dev.dev, 0, ffi.NULL, 16) == -errno.EINVAL
    assert lib.chm_prefetch_object(dev.dev, 0, 0) == -errno.EINVAL


def test_unknown_released_and_foreign_handles_are_einval(served, dev):
    h = dev.prefetch(0, 65536)
    with Device(served.node) as other:
        for call in (lambda: other.wait(h), lambda: other.release(h)):
            with pytest.raises(ChmError) as exc:
                call()
            assert exc.value.errno == errno.EINVAL
    dev.wait(h)
    dev.release(h)
    for call in (lambda: dev.wait(h), lambda: dev.release(h), lambda: dev.wait(987654)):
        with pytest.raises(ChmError) as exc:
            call()
        assert exc.value.errno == errno.EINVAL
    assert lib.chm_prefetch_wait(dev.dev, h, -1) == -errno.EINVAL
    assert lib.chm_prefetch_release(dev.dev, h) == -errno.EINVAL


def test_prefetch_wait_times_out(tmp_path):
    # SSD reads of 1 s modelled time: far more than the wall time the device idles between our calls
    # (idle wall time passes on the device too), so a 0 ms wait must time out, whatever the machine's load.
    with Server(tmp_path / "media", None, "--set", "ssd.read_latency_ns=1e9") as srv, Device(srv.node) as dev:
        h = dev.prefetch(512 << 20, 1 << 20)  # never written: staged from the SSDs
        with pytest.raises(ChmError) as exc:
            dev.wait(h, timeout_ms=0)
        assert exc.value.errno == errno.ETIMEDOUT
        assert lib.chm_prefetch_wait(dev.dev, h, 10) == -errno.ETIMEDOUT
        dev.wait(h, timeout_ms=5000)
        assert dev.last_latency_ns > 0.9e9
        dev.release(h)


def test_refused_write_is_eagain_and_writes_nothing(tmp_path):
    with Server(tmp_path / "media", None, "--policy", "hymcache", *TIGHT_WRITE_BUFFER) as srv, Device(srv.node) as d:
        assert d.info()["write_buffer_bytes"] == 2 << 20
        chunk = 256 << 10
        refused = None
        for i in range(64):
            try:
                d.write(i * chunk, bytes([i + 1]) * chunk)
            except WriteBufferFull as exc:
                refused = i
                assert exc.errno == errno.EAGAIN and isinstance(exc, ChmError)
                break
        assert refused is not None and refused >= 8
        assert d.read(refused * chunk, chunk) == bytes(chunk)  # nothing of the refused write landed
        assert d.stats()["refused_writes"] == 1
        assert lib.chm_write(d.dev, refused * chunk, ffi.new("char[]", chunk), chunk) in (-errno.EAGAIN, chunk)


def test_data_round_trip_copy_zero_copy_and_pipelined(dev):
    rng = random.Random(3)
    small = os.urandom(5000)
    assert dev.write(123, small) == len(small)
    assert dev.read(123, len(small)) == small
    big = os.urandom(40 << 20)  # larger than the 16 MiB staging buffer: split writes, pipelined reads
    dev.write(64 << 20, big)
    assert dev.read(64 << 20, len(big)) == big
    for _ in range(20):
        off, n = rng.randrange(len(big) - 1), rng.randrange(1, 3 << 20)
        n = min(n, len(big) - off)
        assert dev.read((64 << 20) + off, n) == big[off: off + n]
    staging = dev.buffer()
    assert len(staging) == dev.info()["staging_bytes"] == 16 << 20
    assert dev.read_into(64 << 20, staging[4096: 4096 + (1 << 20)]) == 1 << 20  # zero-copy
    assert bytes(staging[4096: 4096 + (1 << 20)]) == big[: 1 << 20]
    staging[: 8192] = small[:8192] if len(small) >= 8192 else small + bytes(8192 - len(small))
    dev.write(7 << 20, staging[:8192])  # zero-copy write
    assert dev.read(7 << 20, 5000) == small


def test_async_submit_and_reap(dev):
    size = ffi.new("size_t *")
    base = lib.chm_buffer(dev.dev, size)
    assert size[0] == 16 << 20
    ffi.memmove(base, b"A" * 4096 + b"B" * 4096, 8192)
    assert lib.chm_submit_write(dev.dev, 1 << 30, base, 4096, 11) == 0
    assert lib.chm_submit_write(dev.dev, (1 << 30) + 4096, base + 4096, 4096, 12) == 0
    assert lib.chm_read(dev.dev, 0, base, 16) == -errno.EBUSY  # no synchronous call while async ones fly
    comps = ffi.new("struct chm_completion[4]")
    assert lib.chm_reap(dev.dev, comps, 4, 2) == 2
    assert [(comps[i].user_data, comps[i].res) for i in range(2)] == [(11, 4096), (12, 4096)]
    assert lib.chm_submit_read(dev.dev, 1 << 30, base + 65536, 8192, 13) == 0
    assert lib.chm_submit_read(dev.dev, 0, ffi.new("char[]", 16), 16, 14) == -errno.EFAULT  # not in the buffer
    assert lib.chm_reap(dev.dev, comps, 4, 1) == 1 and comps[0].res == 8192
    assert ffi.buffer(base + 65536, 8192)[:] == b"A" * 4096 + b"B" * 4096


def test_same_api_as_the_in_process_device(served, tmp_path):
    """One script, two devices: the results and the stats keys agree."""
    def script(d):
        out = [d.write(0, b"x" * 70000), d.read(100, 1000)]
        h = d.prefetch(0, 70000)
        d.wait(h, timeout_ms=1000)
        d.release(h)
        d.flush()
        out.append(d.read(0, 70000) == b"x" * 70000)
        return out, d.stats(), d.info()

    with InProcessDevice.open("small", tmp_path / "m") as local:
        expect, local_stats, local_info = script(local)
    with Device(served.node) as remote:
        got, remote_stats, remote_info = script(remote)
    assert got == expect
    assert set(local_stats) <= set(remote_stats)
    # Each device formatted media of its own: their epochs differ by design.
    assert local_info.pop("device_epoch") != remote_info.pop("device_epoch")
    assert {k: v for k, v in local_info.items()} == {k: remote_info[k] for k in local_info}
    assert remote_stats["clock_ns"] > 0


def test_closed_device_and_strerror(served):
    d = Device(served.node)
    d.close()
    d.close()
    with pytest.raises(ChmError) as exc:
        d.read(0, 1)
    assert exc.value.errno == errno.ENODEV
    assert ffi.string(lib.chm_strerror(-errno.EAGAIN)).startswith(b"write buffer full")
    assert libchm.WriteBufferFull.__mro__[1] is libchm.ChmError


def test_device_going_away_is_enodev(tmp_path):
    srv = Server(tmp_path / "media")
    d = Device(srv.node)
    d.write(0, b"abc")
    srv.kill()
    with pytest.raises(ChmError) as exc:
        d.read(0, 3)
    assert exc.value.errno == errno.ENODEV
    d.close()
    for p in (srv.path, f"{srv.path}.sock"):
        os.unlink(p)


def test_libchm_does_not_import_the_emulator():
    import subprocess
    import sys

    # libchm uses the driver's shared definitions (wire, errors), never the emulator (nor its device process)
    code = "import sys, libchm; print([m for m in sys.modules if m.split('.')[0] == 'emulator'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))).stdout
    assert out.strip() == "[]"


def test_public_header_stands_alone(tmp_path):
    """chm.h compiles by itself as strict C99 and as C++, and exposes no wire internals."""
    import subprocess

    from tests.emulator.serve.serving import LIBCHM

    src = tmp_path / "use.c"
    src.write_text("#include <chm.h>\nint main(void) { chm_dev *d = 0; return chm_open(0, &d) == -ENODEV ? 0 : 1; }\n")
    subprocess.run(["cc", "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-fsyntax-only",
                    f"-I{LIBCHM / 'include'}", str(src)], check=True)
    if subprocess.run(["sh", "-c", "command -v c++"], capture_output=True).returncode == 0:
        subprocess.run(["c++", "-x", "c++", "-Wall", "-Werror", "-fsyntax-only", f"-I{LIBCHM / 'include'}", str(src)],
                       check=True)
    header = (LIBCHM / "include" / "chm.h").read_text()
    assert "chm_wire" not in header and "chm_sqe" not in header


def test_full_prefetch_window_is_ebusy(dev):
    limit = dev.info()["prefetch_max_handles"]
    handles = [dev.prefetch(i << 16, 4096) for i in range(limit)]
    with pytest.raises(ChmError) as exc:
        dev.prefetch(0, 4096)
    assert exc.value.errno == errno.EBUSY
    for h in handles:
        dev.release(h)
    dev.release(dev.prefetch(0, 4096))  # room again
