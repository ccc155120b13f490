"""`chm serve`, `chm info --device` and `chm stats` as a user runs them."""

import json
import subprocess


from emulator.cli import main as chm_main
from libchm import Device
from tests.emulator.serve.serving import CHM, Server, unique_node


def chm(capsys, *args: str) -> tuple[int, str, str]:
    """The `chm` command line, in this process (the command itself is run once, in the first test)."""
    try:
        rc = chm_main(list(args))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_of_each_subcommand(capsys):
    run = subprocess.run([str(CHM), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "usage: chm serve" in run.stdout and "--media" in run.stdout
    for sub in ("stats", "info"):
        rc, out, _ = chm(capsys, sub, "--help")
        assert rc == 0 and "usage: chm " + sub in out


def test_info_and_stats_of_a_running_device(tmp_path, capsys):
    with Server(tmp_path / "media", None, "--policy", "lru") as srv, Device(srv.node) as d:
        d.write(0, b"z" * 10000)
        rc, out, err = chm(capsys, "info", "--device", srv.node)
        assert rc == 0, err
        assert "policy           lru" in out and "1 attached" in out
        assert f"pid {srv.proc.pid}" in out
        rc, out, err = chm(capsys, "stats", srv.node, "--json")
        assert rc == 0, err
        stats = json.loads(out)
        assert stats["clients_other_than_this_tool"] == 1
        assert stats["stats"]["writes"] == 1 and stats["stats"]["write_bytes"] == 10000
        assert stats["info"]["policy"] == "lru"
        rc, out, err = chm(capsys, "stats", srv.node)
        assert "clients attached: 1" in out and "write_bytes" in out


def test_clear_errors(capsys, tmp_path):
    node = unique_node("none")
    rc, out, err = chm(capsys, "info", "--device", node)
    assert rc == 1 and "ENODEV" in err and node in err
    rc, out, err = chm(capsys, "stats", node)
    assert rc == 1 and "ENODEV" in err
    rc, out, err = chm(capsys, "serve", "--node", "bad name", "--media", str(tmp_path))
    assert rc == 1 and "bad name" in err
    rc, out, err = chm(capsys, "serve", "--node", unique_node(), "--set", "dram.size_bytes=12")
    assert rc == 1 and "dram.size_bytes" in err
    rc, out, err = chm(capsys, "serve", "--set", "nonsense")
    assert rc == 2 and "section.field=value" in err
