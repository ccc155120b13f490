"""The command line a user runs: `chm info` and `chm demo`."""

import subprocess
import sys

import pytest

from emulator.cli import main


def chm(*args):
    return subprocess.run([sys.executable, "-m", "emulator", *args], capture_output=True, text=True, timeout=300)


def test_info_prints_the_modelled_hardware(capsys):
    assert main(["info", "--profile", "paper"]) == 0
    out = capsys.readouterr().out
    assert "64.0 GiB" in out and "25 GB/s" in out and "hymcache" in out and "1.8 TiB" in out


def test_info_rejects_an_unknown_profile(capsys):
    assert main(["info", "--profile", "nope"]) == 1
    assert "unknown profile 'nope'" in capsys.readouterr().err


def test_demo_prints_the_table_and_verifies_every_read():
    result = chm("demo", "--objects", "12", "--dram-mib", "16")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["lru"], ["hymcache"])}
    assert set(rows) == {"lru", "hymcache"}
    assert rows["lru"][1] == "0"            # lru: no page hit on either pass (footprint > DRAM)
    assert int(rows["hymcache"][2]) == 0    # hymcache: prefetched ahead, no read misses
    assert rows["lru"][-1] == rows["hymcache"][-1] == "0"  # no bad reads


@pytest.mark.parametrize("args", [["demo", "--objects", "0"], ["demo", "--window", "-1"]])
def test_demo_rejects_bad_arguments(args):
    result = chm(*args)
    assert result.returncode != 0 and "must be >= 1" in result.stderr
