"""`chm serve` and its media: startup errors are one clear line and exit 1 (no
traceback), foreign or damaged media are refused until --format, and the
device epoch is published in the node."""

from __future__ import annotations

import subprocess
import sys

import pytest

from driver.wire import ffi
from emulator.media import META_NAME
from tests.emulator.serve.serving import ROOT, Server, unique_node
from tests.emulator.media_trouble import read_only_dir


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emulator.serve", "--node", unique_node("media"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def assert_clean_error(run: subprocess.CompletedProcess, *words: str, status: int = 1) -> None:
    assert run.returncode == status, run
    assert "Traceback" not in run.stderr and "chm serve: error:" in run.stderr, run.stderr
    for word in words:
        assert word in run.stderr, run.stderr


def test_media_path_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert_clean_error(serve("--media", str(tmp_path / "afile")), "not a directory", "afile")


def test_read_only_media_directory(tmp_path):
    where = tmp_path / "ro"
    where.mkdir()
    with read_only_dir(where):
        assert_clean_error(serve("--media", str(where)), "not writable", str(where))


def test_capacity_beyond_the_file_system_limit(tmp_path):
    run = serve("--media", str(tmp_path / "m"), "--set", f"ssd.capacity_bytes={1 << 50}")
    if run.returncode == 0:
        pytest.skip("this file system takes 1 PiB files")
    assert_clean_error(run, "EFBIG", "ssd.capacity_bytes = 1125899906842624", "ssd0.img")


def test_binary_profile(tmp_path):
    bad = tmp_path / "binary.toml"
    bad.write_bytes(bytes(range(256)))
    assert_clean_error(serve("--media", str(tmp_path / "m"), "--profile", str(bad)), str(bad), "UTF-8")


def test_bad_drain_timeout(tmp_path):
    # a usage error (exit 2), named with its allowed range
    assert_clean_error(serve("--media", str(tmp_path / "m"), "--drain-timeout", "-1"), "--drain-timeout", "-1",
                       "[0, 86400]", status=2)


def test_bad_fault_field(tmp_path):
    assert_clean_error(serve("--media", str(tmp_path / "m"), "--set", "faults.ops=erase"), "faults.ops", "erase")


def test_damaged_media_are_refused_until_format_and_the_epoch_is_published(tmp_path):
    media = tmp_path / "media"
    with Server(media) as srv:
        epoch = ffi.cast("struct chm_node *", ffi.from_buffer(srv.path.read_bytes())).device_epoch
        assert epoch != 0
    assert int.from_bytes((media / META_NAME).read_bytes()[16:24], "little") == epoch
    (media / "ssd1.img").unlink()
    assert_clean_error(serve("--media", str(media)), "ssd1.img", "missing", "--format")
    with Server(media, None, "--format") as srv:
        new_epoch = ffi.cast("struct chm_node *", ffi.from_buffer(srv.path.read_bytes())).device_epoch
    assert new_epoch not in (0, epoch)
    with Server(media):  # formatted media start without --format
        pass
