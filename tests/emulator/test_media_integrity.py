"""Media integrity at start: chm.meta (magic, version, geometry, clean flag,
epoch, checksum), refusal of missing, truncated or foreign media unless
formatting is asked for, the unclean-shutdown report, and clear errors for
media directories that cannot be used."""

import errno
import os
import subprocess
import sys

import pytest

from emulator import ChmError, ConfigError, Device, load_profile
from emulator.media import META_NAME, META_SIZE, MediaMeta
from emulator.ssd import media_file

from .conftest import KiB, TINY
from .media_trouble import read_only_dir

CFG = load_profile("small").with_overrides(TINY)


def meta_of(media_dir) -> MediaMeta:
    return MediaMeta.unpack((media_dir / META_NAME).read_bytes(), media_dir / META_NAME)


def make_media(media_dir, data=b"kept") -> int:
    with Device.open(config=CFG, media_dir=media_dir) as dev:
        dev.write(0, data)
        return dev.info()["device_epoch"]


def test_fresh_directory_is_formatted_and_keeps_its_epoch(media_dir):
    epoch = make_media(media_dir)
    raw = (media_dir / META_NAME).read_bytes()
    assert len(raw) == META_SIZE == 64 and raw[:8] == b"CHMMEDIA"
    meta = meta_of(media_dir)
    assert meta.epoch == epoch != 0 and meta.clean
    assert meta.geometry == {"ssd.count": 2, "ssd.capacity_bytes": 256 * KiB, "ssd.stripe_bytes": 8 * KiB,
                             "device.page_size_bytes": 4 * KiB}
    with Device.open(config=CFG, media_dir=media_dir) as dev:
        assert dev.info()["device_epoch"] == dev.controller.device_epoch == epoch
        assert dev.stats()["device_epoch"] == epoch and dev.stats()["unclean_shutdown"] is False
        assert not meta_of(media_dir).clean  # cleared while open
        assert dev.read(0, 4) == b"kept"
    assert meta_of(media_dir).clean


def test_format_erases_and_draws_a_new_epoch(media_dir):
    epoch = make_media(media_dir)
    with Device.open(config=CFG, media_dir=media_dir, format_media=True) as dev:
        assert dev.info()["device_epoch"] != epoch
        assert dev.read(0, 4) == bytes(4)
    assert os.stat(media_file(media_dir, 0)).st_size == CFG.ssd.capacity_bytes


def _truncate(media_dir):
    os.truncate(media_file(media_dir, 0), 0)


def _delete_one(media_dir):
    media_file(media_dir, 1).unlink()


def _delete_meta(media_dir):
    (media_dir / META_NAME).unlink()


def _bad_magic(media_dir):
    raw = bytearray((media_dir / META_NAME).read_bytes())
    raw[0:8] = b"NOTMEDIA"
    (media_dir / META_NAME).write_bytes(bytes(raw))


def _bad_checksum(media_dir):
    raw = bytearray((media_dir / META_NAME).read_bytes())
    raw[30] ^= 0xFF  # a geometry byte: only the checksum notices
    (media_dir / META_NAME).write_bytes(bytes(raw))


def _short_meta(media_dir):
    (media_dir / META_NAME).write_bytes(b"CHMMEDIA")


@pytest.mark.parametrize("damage,file,words", [
    (_truncate, "ssd0.img", ["is 0 bytes", "truncated"]),
    (_delete_one, "ssd1.img", ["missing"]),
    (_delete_meta, META_NAME, ["missing", "ssd0.img"]),
    (_bad_magic, META_NAME, ["magic"]),
    (_bad_checksum, META_NAME, ["checksum"]),
    (_short_meta, META_NAME, ["is 8 bytes"]),
])
def test_missing_truncated_or_foreign_media_are_refused_unless_formatted(media_dir, damage, file, words):
    make_media(media_dir)
    damage(media_dir)
    with pytest.raises(ChmError) as exc:
        Device.open(config=CFG, media_dir=media_dir)
    message = str(exc.value)
    assert file in message and "--format" in message
    for word in words:
        assert word in message
    with Device.open(config=CFG, media_dir=media_dir, format_media=True) as dev:
        assert dev.read(0, 4) == bytes(4)


def test_geometry_mismatch_names_the_field(media_dir):
    make_media(media_dir)
    with pytest.raises(ChmError) as exc:
        Device.open("small", media_dir, overrides={**TINY, "device.page_size_bytes": 8 * KiB})
    assert "device.page_size_bytes = 4096" in str(exc.value) and "8192" in str(exc.value)
    assert "--format" in str(exc.value)


CRASH = """
import os, sys
from emulator import Device
from tests.emulator.conftest import TINY
dev = Device.open("small", sys.argv[1], overrides=TINY)
dev.write(0, b"flushed!")
dev.flush()
dev.write(64 * 1024, b"only in DRAM")
os._exit(0)  # like kill -9: no close
"""


def test_unclean_shutdown_is_reported_once(media_dir):
    make_media(media_dir)
    subprocess.run([sys.executable, "-c", CRASH, str(media_dir)], check=True, cwd=os.getcwd())
    logs = []
    with Device.open(config=CFG, media_dir=media_dir, log=logs.append) as dev:
        assert dev.stats()["unclean_shutdown"] is True
        assert dev.read(0, 8) == b"flushed!"
        assert dev.read(64 * KiB, 12) == bytes(12)  # acknowledged, never flushed: lost
    assert any("unclean shutdown: writes acknowledged but not flushed before it may be lost" in line for line in logs)
    with Device.open(config=CFG, media_dir=media_dir) as dev:
        assert dev.stats()["unclean_shutdown"] is False


def test_media_truncated_or_deleted_while_serving(media_dir):
    data = os.urandom(16 * KiB)
    logs = []
    dev = Device.open(config=CFG, media_dir=media_dir, log=logs.append)
    dev.write(0, data)
    dev.flush()  # hymcache frees the write-buffer frames: the next read goes to the media
    os.truncate(media_file(media_dir, 0), 0)
    with pytest.raises(ChmError) as exc:
        dev.read(0, len(data))
    assert exc.value.errno == errno.EIO and "ssd0.img" in str(exc.value)
    dev.close()
    with pytest.raises(ChmError, match="ssd0.img.*is 0 bytes"):  # not an empty device
        Device.open(config=CFG, media_dir=media_dir)
    for i in range(CFG.ssd.count):
        media_file(media_dir, i).unlink()
    with pytest.raises(ChmError, match="ssd0.img.*missing"):
        Device.open(config=CFG, media_dir=media_dir)


def test_media_path_that_is_a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("x")
    with pytest.raises(ChmError) as exc:
        Device.open(config=CFG, media_dir=path)
    assert exc.value.errno == errno.ENOTDIR and str(path) in str(exc.value)


def test_read_only_media_directory(tmp_path):
    where = tmp_path / "ro"
    where.mkdir()
    with read_only_dir(where):
        with pytest.raises(ChmError) as exc:
            Device.open(config=CFG, media_dir=where)
    assert "not writable" in str(exc.value) and str(where) in str(exc.value)
    assert exc.value.errno in (errno.EROFS, errno.EACCES)


def test_capacity_beyond_the_file_system_limit(tmp_path):
    huge = load_profile("small").with_overrides({"ssd.capacity_bytes": 1 << 50})
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        try:
            os.ftruncate(f.fileno(), 1 << 50)
            pytest.skip("this file system takes 1 PiB files")
        except OSError as exc:
            assert exc.errno == errno.EFBIG
    with pytest.raises(ChmError) as exc:
        Device.open(config=huge, media_dir=tmp_path / "media")
    assert exc.value.errno == errno.EFBIG and "ssd.capacity_bytes = 1125899906842624" in str(exc.value)
    assert "ssd0.img" in str(exc.value)
    assert not list((tmp_path / "media").glob("ssd*.img"))  # nothing half-formatted left behind


def test_binary_profile_is_a_config_error(tmp_path):
    bad = tmp_path / "binary.toml"
    bad.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError) as exc:
        load_profile(bad)
    assert str(bad) in str(exc.value) and "UTF-8" in str(exc.value)

