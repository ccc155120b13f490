"""``chm replay``'s start: --no-plot writes the JSON alone, and its imports leave out the server side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from emulator.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "replay_golden.jsonl"

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


def test_a_replay_imports_no_plotting_zmq_nor_progress_bar():
    """The whole replay of a small trace, with no plot and no progress bar: no matplotlib, ZeroMQ, tqdm or server
    side of the Master is loaded (each costs start-up time of a command benchmarked as a whole process)."""
    run = ("from host_runtime.replay.cli import *\n"
           "from host_runtime.replay.driver import Replay, replay_config\n"
           "from host_runtime.replay.traces import MooncakeTrace\n"
           f"w = MooncakeTrace({str(GOLDEN)!r}, 262144, tokens_per_block=512)\n"
           "Replay(replay_config('small', 'lru'), 'lru', w, progress=False).run()")
    assert _imported(run, ("matplotlib", "zmq", "tqdm", "host_runtime.hymcache.master")) == []
