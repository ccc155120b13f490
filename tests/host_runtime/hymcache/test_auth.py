"""Authentication and roles on the HyMCache network (auth.py): the ZAP allow-list, each role's methods, the
loopback-only bind without keys, the Master's read leases at the Manager, node keys, 0600 secrets, and
``chm hymcache up``'s keys by default. Real sockets and, where the thing is a process, real processes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import threading

import pytest

from driver.errors import ChmError
from host_runtime.hymcache import auth
from host_runtime.hymcache.clock import ManualClock, WallClock
from host_runtime.hymcache.manager import KVManager, ManagerClient, serve_manager
from host_runtime.hymcache.master import Master, MasterClient, master_options, start_master
from host_runtime.hymcache.messages import KEY_BYTES, DeviceInfo
from host_runtime.hymcache.rpc import RpcClient, RpcServer, RpcTimeout, make_curve_keys
from tests.emulator.serve.serving import ROOT, Server

from . import manager_pieces
from .procs import CHM

BLOCK = 128 << 10
DEVICES = [DeviceInfo(0, "/dev/shm/auth-n0d0", 1 << 30, 1)]


def serving(server):
    """Run ``server`` on a thread; a function that stops it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop():
        server.stop()
        thread.join(timeout=10)
    return stop


@pytest.fixture
def keys(tmp_path):
    """A key directory: the set's (client, node-0, node-1) and one key per role."""
    d = str(tmp_path / "keys")
    make_curve_keys(d, nodes=2)
    for role in auth.ROLES:
        auth.add_key(d, f"a-{role}", role)
    return d


def key(keys: str, name: str) -> str:
    return os.path.join(keys, f"{name}.key_secret")


@pytest.fixture
def master_served(keys):
    with start_master(master_options(endpoint="tcp://127.0.0.1:0", curve_keys=keys)) as running:
        running.serve_in_thread()
        yield running.master, running.endpoint


def refused(call, words: str) -> ChmError:
    with pytest.raises(ChmError) as e:
        call()
    assert e.value.errno == errno.EACCES and words in e.value.message, e.value.message
    return e.value


# ---- the allow-list ----------------------------------------------------------------------------------------
def test_a_key_outside_the_allow_list_is_refused(keys, master_served, tmp_path):
    """A client that knows the server's public key and made its own pair (the issue's attack) gets no answer;
    an authorized key does. Removing a key from authorized/ refuses it from the next connection on."""
    _, endpoint = master_served
    stranger = tmp_path / "stranger"
    stranger.mkdir(mode=0o700)
    make_curve_keys(str(stranger))  # its own client key, authorized only in its own directory
    shutil.copy(os.path.join(keys, "server.key"), stranger / "server.key")
    with MasterClient(endpoint, timeout_s=0.5, curve_keys=str(stranger)) as mc, pytest.raises(RpcTimeout):
        mc.register_node(9, "tcp://evil:1", DEVICES)
    with MasterClient(endpoint, timeout_s=10, curve_keys=key(keys, "a-monitor")) as mc:
        assert mc.nodes() == {}
    os.remove(os.path.join(keys, auth.AUTHORIZED, "a-monitor.key"))
    with MasterClient(endpoint, timeout_s=0.5, curve_keys=key(keys, "a-monitor")) as mc, pytest.raises(RpcTimeout):
        mc.nodes()


# ---- roles ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("who, method, args, needs", [
    ("a-monitor", "lookup", ([os.urandom(KEY_BYTES)],), "lookup needs the node or worker role"),
    ("a-admin", "put_start", ("r", [os.urandom(KEY_BYTES)], [BLOCK]), "put_start needs the worker role"),
    ("a-worker", "remove", ([os.urandom(KEY_BYTES)],), "remove needs the admin role"),
    ("a-worker", "stats", (), "stats needs the admin or monitor role"),
    ("a-node", "put_end", ([os.urandom(KEY_BYTES)], [1]), "put_end needs the worker role"),
    ("a-worker", "register_node", (9, "tcp://evil:1", DEVICES), "register_node needs the node role"),
    ("a-admin", "register_node", (9, "tcp://evil:1", DEVICES), "register_node needs the node role"),
])
def test_a_call_outside_the_keys_role_is_refused_naming_the_role(keys, master_served, who, method, args, needs):
    master, endpoint = master_served
    with RpcClient(endpoint, 10, curve_keys=key(keys, who)) as c:
        refused(lambda: c.call(method, *args), f"{needs}; key {who!r} has role {who[2:]}")
    assert master.nodes() == {}  # nothing registered


def test_each_role_gets_its_own_calls(keys, master_served):
    master, endpoint = master_served
    with MasterClient(endpoint, 10, curve_keys=key(keys, "a-worker")) as w, \
            MasterClient(endpoint, 10, curve_keys=key(keys, "a-admin")) as a, \
            MasterClient(endpoint, 10, curve_keys=key(keys, "a-monitor")) as m:
        assert w.lookup([os.urandom(KEY_BYTES)]) == [] and w.nodes() == {}
        assert a.remove([os.urandom(KEY_BYTES)]) == 0 and "lookup_requests" in a.stats()
        assert "lookup_requests" in m.stats()


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("auth")) as srv:
        yield srv


def store(master, path: str, n: int, tag: str):
    """``n`` blocks stored through the in-process Master and libchm on the one device (flushed); keys, bytes."""
    keys, data, _ = manager_pieces.store(master, {0: path}, n, BLOCK, tag)
    return keys, data


def test_the_managers_calls_are_within_their_roles(keys, master_served, device):
    """A served Manager with keys registers through its node key (and gets its lease secret); a monitor key may
    read its stats but not hint or read; a worker key may not read its stats."""
    master, master_ep = master_served
    with MasterClient(master_ep, 10, curve_keys=key(keys, "node-0")) as as_node:
        mgr = KVManager(0, [device.node], as_node, WallClock())
        server = serve_manager(mgr, "tcp://127.0.0.1:0", curve_keys=keys)
        stop = serving(server)
        try:
            assert mgr.lease_secret == master.node_secret(0)  # register_node's answer, over CurveZMQ
            ks, _ = store(master, str(device.path), 1, "roles")
            with ManagerClient(server.endpoint, curve_keys=key(keys, "a-monitor")) as mon, \
                    ManagerClient(server.endpoint, curve_keys=key(keys, "a-worker")) as w:
                assert mon.stats()["node"] == 0
                refused(lambda: mon.hint("r", ks), "hint needs the worker role; key 'a-monitor' has role monitor")
                refused(lambda: mon.read("r", ks[0], 1.0), "read needs the worker role")
                refused(lambda: w.stats(), "stats needs the admin or monitor role; key 'a-worker' has role worker")
                assert w.hint("r", ks) == 1
        finally:
            stop()
            mgr.close()


# ---- node keys -------------------------------------------------------------------------------------------
def test_a_nodes_registration_changes_only_through_its_own_key(keys, master_served):
    master, endpoint = master_served
    auth.add_key(keys, "loose-node", "node")  # a node key bound to no node number
    with MasterClient(endpoint, 10, curve_keys=key(keys, "node-0")) as n0, \
            MasterClient(endpoint, 10, curve_keys=key(keys, "node-1")) as n1, \
            MasterClient(endpoint, 10, curve_keys=key(keys, "loose-node")) as loose:
        assert n0.register_node(0, "tcp://node0:1", DEVICES) == master.node_secret(0)
        refused(lambda: n1.register_node(0, "tcp://evil:1", DEVICES),
                "key 'node-1' is node 1's; it may not register node 0")
        bumped = [DeviceInfo(0, DEVICES[0].node_path, DEVICES[0].capacity_bytes, DEVICES[0].epoch + 1)]
        refused(lambda: loose.register_node(0, "tcp://evil:1", bumped),
                "node 0 is registered by key 'node-0'; key 'loose-node' may not change it")
        assert master.nodes()[0]["endpoint"] == "tcp://node0:1" and master.nodes()[0]["devices"] == DEVICES
        n0.register_node(0, "tcp://node0:1", bumped)  # its own key: a new epoch
        assert master.nodes()[0]["devices"] == bumped


# ---- binding without keys ----------------------------------------------------------------------------------
class Target:
    def ping(self):
        return "pong"


def test_without_keys_a_non_loopback_bind_is_refused_unless_insecure(capsys):
    for endpoint in ("tcp://0.0.0.0:0", "tcp://*:0", "tcp://192.0.2.1:0"):
        refused(lambda: RpcServer(Target(), ["ping"], endpoint), f"endpoint {endpoint} is not loopback")
    for endpoint in ("tcp://127.0.0.1:0", "tcp://localhost:0", "tcp://[::1]:0"):
        assert auth.is_loopback(endpoint), endpoint
    server = RpcServer(Target(), ["ping"], "tcp://0.0.0.0:0", insecure=True)  # this machine's addresses only
    server.sock.close(0)
    assert "WARNING: serving tcp://0.0.0.0:" in capsys.readouterr().err


def test_the_cli_refuses_a_non_loopback_bind_without_keys():
    r = subprocess.run([CHM, "hymcache", "master", "--bind", "0.0.0.0"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.startswith("chm hymcache master: error: [EACCES] endpoint tcp://0.0.0.0:0")
    assert "--insecure" in r.stderr


# ---- leases -----------------------------------------------------------------------------------------------
@pytest.fixture
def plain_set(device):
    """No keys (loopback): an in-process Master, the device's served Manager."""
    master = Master(WallClock())
    mgr = KVManager(0, [device.node], master, WallClock())
    server = serve_manager(mgr, "tcp://127.0.0.1:0")
    stop = serving(server)
    yield master, mgr, server.endpoint
    stop()
    mgr.close()
    master.close()


def test_a_read_without_the_masters_lease_is_refused(plain_set, device):
    master, mgr, endpoint = plain_set
    ks, data = store(master, str(device.path), 2, "lease")
    with ManagerClient(endpoint) as c:
        assert c.hint("r", ks) == 2
        refused(lambda: c.read("r", ks[0], 10.0), "refused to request 'r': it holds no lease on it")
        assert c.lease("r", master.lookup(ks, request_id="r")) == 2
        token, frame = c.read("r", ks[0], 10.0)
        assert bytes(frame) == data[0]
    assert mgr.stats()["reads_refused"] == 1


def test_a_forged_expired_or_other_requests_lease_is_refused(plain_set, device):
    import msgspec

    master, mgr, endpoint = plain_set
    ks, _ = store(master, str(device.path), 1, "forged")
    (loc,) = master.lookup(ks, request_id="r")
    forged = msgspec.structs.replace(loc, lease=loc.lease[:-1] + bytes([loc.lease[-1] ^ 1]))
    later = msgspec.structs.replace(loc, lease=(int.from_bytes(loc.lease[:8], "little") + 10**9).to_bytes(8, "little")
                                    + loc.lease[8:])  # a longer expiry under the same MAC
    (theirs,) = master.lookup(ks, request_id="someone-else")
    secret = master.node_secret(0)
    expired = msgspec.structs.replace(loc, lease=auth.lease_token(secret, "r", loc.key, loc.version, 0,
                                                                  auth.now_ms() - 1))
    stale = msgspec.structs.replace(loc, version=loc.version + 1, lease=auth.lease_token(
        secret, "r", loc.key, loc.version + 1, 0, auth.now_ms() + 60_000))
    with ManagerClient(endpoint) as c:
        c.hint("r", ks)
        for bad in (forged, later, theirs, msgspec.structs.replace(theirs, lease=b"x" * auth.LEASE_BYTES)):
            assert c.lease("r", [bad]) == 0
            refused(lambda: c.read("r", ks[0], 10.0), "holds no lease on it")
        assert c.lease("r", [expired]) == 1  # a true token, past its end
        refused(lambda: c.read("r", ks[0], 10.0), "its lease ended")
        assert c.lease("r", [stale]) == 1  # a true token of another version of the key
        refused(lambda: c.read("r", ks[0], 10.0), f"its lease is on version {loc.version + 1}")
        assert c.lease("r", [loc]) == 1
        assert c.read("r", ks[0], 10.0)[0].key == ks[0]
    assert mgr.stats()["leases_refused"] == 4


def test_a_hints_descriptors_bring_their_leases(plain_set, device):
    """The Lookup's way: a hint whose descriptors carry the Master's leases for the request needs no lease()."""
    master, mgr, endpoint = plain_set
    ks, data = store(master, str(device.path), 2, "hinted")
    with ManagerClient(endpoint) as c:
        assert c.hint("h", ks, master.lookup(ks, request_id="h")) == 2
        assert [bytes(c.read("h", k, 10.0)[1]) for k in ks] == data
        c.hint("other", ks, master.lookup(ks, request_id="h"))  # another request's descriptors: no lease here
        refused(lambda: c.read("other", ks[0], 10.0), "holds no lease on it")


# ---- secret files --------------------------------------------------------------------------------------------
def test_secrets_are_0600_and_a_service_refuses_a_readable_one(keys, tmp_path):
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700
    secrets = [f for f in os.listdir(keys) if f.endswith(".key_secret")] + [auth.LEASE_SECRET]
    assert len(secrets) >= 4 + len(auth.ROLES)
    for name in secrets:
        assert stat.S_IMODE(os.stat(os.path.join(keys, name)).st_mode) == 0o600, name
    for name, mode, start in (("server.key_secret", 0o644, lambda: RpcServer(Target(), ["ping"], "tcp://127.0.0.1:0",
                                                                              curve_keys=keys)),
                              (auth.LEASE_SECRET, 0o640, lambda: start_master(master_options(curve_keys=keys),
                                                                              clock=ManualClock())),
                              ("a-worker.key_secret", 0o604, lambda: RpcClient("tcp://127.0.0.1:1", 1,
                                                                               curve_keys=key(keys, "a-worker")))):
        path = os.path.join(keys, name)
        os.chmod(path, mode)
        refused(start, f"secret file {path} is mode {mode:04o}: readable by group or others")
        os.chmod(path, 0o600)


def test_keys_add_and_list(tmp_path):
    d = tmp_path / "k"
    r = subprocess.run([CHM, "hymcache", "keys", "add", "--role", "worker", "--dir", str(d), "vllm-0"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(d / "vllm-0.key_secret").st_mode) == 0o600 and (d / "server.key").exists()
    r = subprocess.run([CHM, "hymcache", "keys", "add", "--role", "root", "--dir", str(d), "x"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "role root is not one of worker, node, admin, monitor" in r.stderr
    r = subprocess.run([CHM, "hymcache", "keys", "list", "--dir", str(d), "--json"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    listed = {k["name"]: k["roles"] for k in json.loads(r.stdout)}
    assert listed["vllm-0"] == ["worker"] and listed["client"] == ["admin", "worker"]


# ---- up ----------------------------------------------------------------------------------------------------
def test_up_sets_up_keys_and_roles_for_its_processes_by_default():
    from .test_cli import Up

    with Up("--nodes", "1", "--devices-per-node", "1", "--keys-default") as up:
        keys = up.desc["curve_keys"]
        assert keys and stat.S_IMODE(os.stat(os.path.join(keys, "server.key_secret")).st_mode) == 0o600
        assert {k["name"]: k["roles"] for k in auth.list_keys(keys)}["node-0"] == ["node"]
        with MasterClient(up.desc["master"], timeout_s=0.5) as mc, pytest.raises(RpcTimeout, match="answers no client "
                                                                                           "without an authorized key"):
            mc.nodes()  # plaintext: no answer, and the timeout says why it may be
        with MasterClient(up.desc["master"], timeout_s=10, curve_keys=keys) as mc:
            assert list(mc.nodes()) == [0]  # the Manager registered with its node key
        rc, _, err = up.stop()
    assert rc == 0, err
    assert not os.path.exists(keys)  # a temporary key directory: gone with the set


def test_the_readme_lists_every_method_with_its_roles():
    """docs/hymcache.md's table of RPC methods is the code's (MASTER_ROLES, MANAGER_ROLES), row for row."""
    from host_runtime.hymcache.manager import MANAGER_METHODS, MANAGER_ROLES
    from host_runtime.hymcache.master import MASTER_METHODS, MASTER_ROLES
    rows = {}
    for line in (ROOT / "docs" / "hymcache.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in ("Master", "KV Manager") and not cells[1].endswith(".py`"):
            rows[(cells[0], cells[1].strip("`"))] = set(cells[2].split(", "))
    want = {("Master", m): MASTER_ROLES[m] for m in MASTER_METHODS}
    want.update({("KV Manager", m): MANAGER_ROLES[m] for m in MANAGER_METHODS})
    assert rows == want
