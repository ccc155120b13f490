"""The in-process Device API: persistence on the media files and every error case."""

import errno
import os

import pytest

from emulator import ChmError, ConfigError, Device, WriteBufferFull, load_profile
from emulator.config import from_dict
from emulator.ssd import locate, media_file

from .conftest import KiB, TINY


@pytest.mark.parametrize("policy", ["lru", "hymcache"])
def test_flushed_data_survives_reopen(media_dir, policy):
    data = os.urandom(100 * KiB)
    addr = 3 * KiB + 17  # not page aligned, crosses pages and both SSDs
    with Device.open("small", media_dir, policy=policy, overrides=TINY) as dev:
        for off in range(0, len(data), 8 * KiB):  # the write buffer holds 4 pages
            try:
                dev.write(addr + off, data[off:off + 8 * KiB])
            except WriteBufferFull:
                dev.flush()
                dev.write(addr + off, data[off:off + 8 * KiB])
        dev.flush()
    with Device.open("small", media_dir, policy=policy, overrides=TINY) as dev:
        assert dev.stats()["page_hits"] == 0
        assert dev.read(addr, len(data)) == data
        assert dev.stats()["page_misses"] > 0  # it really came from the media


def test_close_drains_the_write_buffer(media_dir):
    data = os.urandom(12 * KiB)
    dev = Device.open("small", media_dir, policy="hymcache", overrides=TINY)
    dev.write(0, data)
    assert dev.stats()["dirty_pages"] == 3
    dev.close()
    with Device.open("small", media_dir, policy="lru", overrides=TINY) as dev:
        assert dev.read(0, len(data)) == data


def test_bytes_are_in_the_files_at_the_documented_offsets(media_dir):
    cfg = load_profile("small").with_overrides(TINY)
    chunks = {addr: os.urandom(300) for addr in (0, 5 * KiB, 8 * KiB + 1, 100 * KiB + 4000, 2 * 256 * KiB - 300)}
    with Device.open(config=cfg, media_dir=media_dir) as dev:
        for addr, data in chunks.items():
            dev.write(addr, data)
    for addr, data in chunks.items():
        for i, byte in enumerate(data):  # byte by byte: a chunk may straddle a stripe
            ssd, offset = locate(cfg, addr + i)
            with open(media_file(media_dir, ssd), "rb") as f:
                f.seek(offset)
                assert f.read(1)[0] == byte, f"address {addr + i} expected on ssd{ssd} at {offset}"
    # The documented formula, spelled out once more for one address.
    assert locate(cfg, 8 * KiB + 1) == (1, 1)
    assert locate(cfg, 16 * KiB + 2) == (0, 8 * KiB + 2)


def test_backing_files_are_sparse_and_sized(media_dir):
    cfg = load_profile("small")
    with Device.open("small", media_dir) as dev:
        dev.write(0, b"x")
    for i in range(cfg.ssd.count):
        st = os.stat(media_file(media_dir, i))
        assert st.st_size == cfg.ssd.capacity_bytes
        assert st.st_blocks * 512 < 16 << 20  # GiB file, almost nothing allocated


@pytest.mark.parametrize("addr,length,err", [
    (-1, 10, errno.ERANGE),
    (2 * 256 * KiB, 1, errno.ERANGE),
    (2 * 256 * KiB - 5, 10, errno.ERANGE),
    (0, 0, errno.EINVAL),
    (0, -4, errno.EINVAL),
    ("0", 4, errno.EINVAL),
    (0, 2.5, errno.EINVAL),
])
def test_bad_ranges(tiny, addr, length, err):
    dev = tiny()
    for call in (lambda: dev.read(addr, length), lambda: dev.prefetch(addr, length),
                 lambda: dev.write(addr, b"y" * length if isinstance(length, int) and length > 0 else b"")):
        with pytest.raises(ChmError) as exc:
            call()
        assert exc.value.errno == err
        assert str(addr) in str(exc.value) or str(length) in str(exc.value)


def test_write_of_non_bytes_is_einval(tiny):
    with pytest.raises(ChmError) as exc:
        tiny().write(0, 1234)
    assert exc.value.errno == errno.EINVAL and "bytes-like" in str(exc.value)


def test_unknown_and_double_released_handles(tiny):
    dev = tiny()
    for call in (dev.wait, dev.release):
        with pytest.raises(ChmError) as exc:
            call(999)
        assert exc.value.errno == errno.EINVAL and "999" in str(exc.value)
    h = dev.prefetch(0, 8 * KiB)
    dev.wait(h)
    dev.release(h)
    with pytest.raises(ChmError) as exc:
        dev.release(h)
    assert exc.value.errno == errno.EINVAL


def test_prefetch_beyond_the_window(tiny):
    dev = tiny()  # window: 4 pages, 4 handles
    h1 = dev.prefetch(0, 12 * KiB)
    with pytest.raises(ChmError) as exc:
        dev.prefetch(64 * KiB, 8 * KiB)  # 3 + 2 pages > 4
    assert exc.value.errno == errno.EBUSY
    h2 = dev.prefetch(64 * KiB, 4 * KiB)  # exactly full
    dev.release(h1)
    dev.prefetch(128 * KiB, 12 * KiB)  # room again after a release
    dev.release(h2)
    with pytest.raises(ChmError) as exc:
        dev.prefetch(0, 20 * KiB)  # larger than the whole window: can never succeed
    assert exc.value.errno == errno.EINVAL


def test_prefetch_handle_limit(tiny):
    dev = tiny(more={"policy.prefetch_max_handles": 2})
    dev.prefetch(0, 1)
    dev.prefetch(4 * KiB, 1)
    with pytest.raises(ChmError) as exc:
        dev.prefetch(8 * KiB, 1)
    assert exc.value.errno == errno.EBUSY and "handles" in str(exc.value)


def test_write_buffer_full_refuses_whole_write_then_retry_succeeds(tiny):
    # 4 write-buffer pages, flushed only as one full batch or on flush()
    dev = tiny("hymcache", {"policy.flush_max_delay_ns": 1e12, "policy.flush_batch_bytes": 16 * KiB})
    dev.write(0, b"a" * (3 * 4 * KiB))
    before = dev.read(100 * KiB, 8 * KiB)
    with pytest.raises(WriteBufferFull) as exc:
        dev.write(100 * KiB, b"b" * (8 * KiB))  # needs 2 pages, 1 free
    assert exc.value.errno == errno.EAGAIN
    assert dev.read(100 * KiB, 8 * KiB) == before  # nothing partial written
    assert dev.stats()["refused_writes"] == 1
    dev.write(8 * KiB, b"c" * 10)  # a page already in the buffer needs no new room
    dev.flush()
    dev.write(100 * KiB, b"b" * (8 * KiB))
    assert dev.read(100 * KiB, 8 * KiB) == b"b" * (8 * KiB)
    assert dev.read(0, 8 * KiB + 10) == b"a" * (8 * KiB) + b"c" * 10


def test_write_larger_than_the_write_buffer_is_einval(tiny):
    with pytest.raises(ChmError) as exc:
        tiny("hymcache").write(0, bytes(20 * KiB))
    assert exc.value.errno == errno.EINVAL and "split" in str(exc.value)


def test_lru_never_refuses(tiny):
    dev = tiny("lru")
    for i in range(40):  # far more than DRAM
        dev.write(i * 4 * KiB, bytes([i]) * 4 * KiB)
    assert dev.stats()["refused_writes"] == 0
    assert all(dev.read(i * 4 * KiB, 1) == bytes([i]) for i in range(40))


def test_wait_timeout(tiny):
    dev = tiny()
    h = dev.prefetch(0, 8 * KiB)  # an SSD read takes ~80 us of modelled time
    with pytest.raises(ChmError) as exc:
        dev.wait(h, timeout_ms=0.001)
    assert exc.value.errno == errno.ETIMEDOUT
    dev.wait(h, timeout_ms=10)
    with pytest.raises(ChmError) as exc:
        dev.wait(h, timeout_ms=-1)
    assert exc.value.errno == errno.EINVAL


def test_closed_device(tiny):
    dev = tiny()
    dev.close()
    with pytest.raises(ChmError) as exc:
        dev.read(0, 1)
    assert exc.value.errno == errno.ENODEV


def test_media_directory_is_exclusive(media_dir):
    with Device.open("small", media_dir, overrides=TINY):
        with pytest.raises(ChmError) as exc:
            Device.open("small", media_dir, overrides=TINY)
        assert exc.value.errno == errno.EBUSY


def test_media_of_another_profile_is_refused(media_dir):
    with Device.open("small", media_dir, overrides=TINY):
        pass
    with pytest.raises(ChmError) as exc:
        Device.open("small", media_dir)
    assert "capacity" in str(exc.value)


def test_info(tiny):
    info = tiny("lru").info()
    assert info["capacity_bytes"] == 512 * KiB and info["dram_bytes"] == 64 * KiB
    assert info["page_size"] == 4 * KiB and info["ssd_count"] == 2 and info["policy"] == "lru"


# ---- profiles -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["small", "paper", "cmmh"])
def test_shipped_profiles_load(name):
    cfg = load_profile(name)
    assert cfg.capacity_bytes > cfg.dram.size_bytes > 0


@pytest.mark.parametrize("key,value,words", [
    ("ssd.read_latency_ns", -5.0, ["ssd.read_latency_ns", "-5", "out of range"]),
    ("ssd.count", 0, ["ssd.count", "0", "[1, 64]"]),
    ("ssd.count", "two", ["ssd.count", "'two'", "int"]),
    ("policy.name", "nonesuch", ["policy.name", "nonesuch", "fifo", "hymcache", "lru"]),
    ("device.page_size_bytes", 12288, ["power of two"]),
    ("dram.size_bytes", 4096 * 10 + 1, ["multiple of device.page_size_bytes"]),
    ("policy.prefetch_window_bytes", 256 << 20, ["prefetch_window_bytes", "read-staging"]),
    ("policy.write_buffer_fraction", 0.0, ["write_buffer_fraction", "no write-buffer frame"]),
    ("host_link.bandwidth_gbps", float("nan"), ["bandwidth_gbps", "finite"]),
    ("emulation.data", 1, ["emulation.data", "bool"]),
    ("nonsense.field", 1, ["unknown field", "nonsense.field"]),
])
def test_invalid_profile_fields(key, value, words):
    with pytest.raises(ConfigError) as exc:
        load_profile("small").with_overrides({key: value})
    assert exc.value.errno == errno.EINVAL
    for word in words:
        assert word in str(exc.value)


def test_missing_and_unknown_sections():
    raw = load_profile("small").as_dict()
    del raw["ssd"]["parallelism"]
    with pytest.raises(ConfigError, match="missing field ssd.parallelism"):
        from_dict(raw)
    raw = load_profile("small").as_dict()
    raw["extra"] = {}
    with pytest.raises(ConfigError, match=r"unknown section \[extra\]"):
        from_dict(raw)


def test_profile_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown profile 'huge'"):
        load_profile("huge")
    bad = tmp_path / "bad.toml"
    bad.write_text("[device\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(tmp_path / "missing.toml")
