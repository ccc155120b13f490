"""The RPC layer every HyMCache process speaks: real ZeroMQ sockets, a server thread."""

import errno
import threading
import time

import pytest

from driver.errors import ChmError
from host_runtime.hymcache.messages import BlockLoc, to
from host_runtime.hymcache.rpc import Payload, RemoteError, RpcClient, RpcServer, RpcTimeout


class Target:
    def add(self, a, b):
        return a + b

    def block(self, n):
        return Payload({"n": n}, [bytes(range(256)) * (n // 256)])

    def total(self, payload=None):
        return sum(len(p) for p in payload)

    def full(self):
        raise ChmError(errno.ENOSPC, "media full")

    def locs(self):
        return [BlockLoc(b"k" * 16, 0, 1, 4096, 8192, 7, 1)]

    def slow(self, seconds):
        time.sleep(seconds)  # a slow answer: the sleep is the behaviour under test
        return "late"

    def hidden(self):
        return "never served"


@pytest.fixture
def served():
    srv = RpcServer(Target(), ["add", "block", "total", "full", "locs", "slow"], "tcp://127.0.0.1:0")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.thread = thread
    yield srv
    srv.stop()
    thread.join(5)


def test_calls_results_frames_and_typed_structs(served):
    with RpcClient(served.endpoint, 5) as c:
        assert c.call("add", 2, 3) == 5
        result, frames = c.call("block", 1 << 20, frames=True)
        assert result == {"n": 1 << 20} and bytes(frames[0]) == bytes(range(256)) * 4096
        assert c.call("total", payload=[b"abc", b"de"]) == 5
        assert to(list[BlockLoc], c.call("locs")) == Target().locs()


def test_errors_carry_the_errno_and_only_named_methods_are_served(served):
    with RpcClient(served.endpoint, 5) as c:
        with pytest.raises(RemoteError) as exc:
            c.call("full")
        assert exc.value.errno == errno.ENOSPC and "media full" in str(exc.value)
        for bad in ("hidden", "__init__", "nope"):
            with pytest.raises(RemoteError) as exc:
                c.call(bad)
            assert exc.value.errno == errno.EINVAL and repr(bad) in str(exc.value)
        with pytest.raises(RemoteError) as exc:
            c.call("add", 1)  # a malformed call answers EINVAL and the server goes on
        assert exc.value.errno == errno.EINVAL
        assert c.call("add", 1, 1) == 2


def test_a_slow_answer_times_out_and_is_dropped_when_it_comes_late(served):
    with RpcClient(served.endpoint, 5) as c:
        with pytest.raises(RpcTimeout) as exc:
            c.call("slow", 0.3, timeout_s=0.05)
        assert exc.value.errno == errno.ETIMEDOUT and "slow" in str(exc.value)
        assert c.call("add", 20, 22) == 42  # not the late "late"


class Counter:
    def __init__(self):
        self.seen = []

    def note(self, x):
        self.seen.append(x)
        return x

    def fail(self):
        raise ChmError(errno.EIO, "posted calls' errors are not the caller's")


def test_posted_calls_run_in_order_and_their_answers_never_reach_a_later_call():
    target = Counter()
    srv = RpcServer(target, ["note", "fail"], "tcp://127.0.0.1:0")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        with RpcClient(srv.endpoint, 5) as c:
            for i in range(5):
                c.post("note", i)
            c.post("fail")
            assert c.call("note", "last") == "last"  # not a posted call's answer, not its error
            assert target.seen == [0, 1, 2, 3, 4, "last"]
    finally:
        srv.stop()
        thread.join(5)


def test_a_dead_server_times_out(served):
    c = RpcClient(served.endpoint, 5)
    assert c.call("add", 1, 2) == 3
    served.stop()
    served.thread.join(5)
    with pytest.raises(RpcTimeout):
        c.call("add", 1, 2, timeout_s=0.2)
    c.close()


def test_bad_timeout_is_refused():
    with pytest.raises(ChmError) as exc:
        RpcClient("tcp://127.0.0.1:1", 0)
    assert exc.value.errno == errno.EINVAL and "timeout_s" in str(exc.value)


def test_a_client_without_the_servers_curve_keys_times_out_and_never_hangs(tmp_path):
    from host_runtime.hymcache.rpc import make_curve_keys

    keys = str(tmp_path / "keys")
    make_curve_keys(keys)
    srv = RpcServer(Target(), ["add"], "tcp://127.0.0.1:0", curve_keys=keys)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    outcomes = []

    def calls():
        with RpcClient(srv.endpoint, 0.3) as c:  # no keys: the handshake is refused
            for _ in range(5):
                try:
                    c.call("add", 1, 2)
                    outcomes.append("answered")
                except RpcTimeout as exc:
                    outcomes.append(exc.errno)
            try:  # nor does a posted call block: it is queued, or refused within the timeout
                c.post("add", 1, 2)
                outcomes.append("posted")
            except RpcTimeout as exc:
                outcomes.append(exc.errno)

    try:
        caller = threading.Thread(target=calls, daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), f"a call blocked: {outcomes}"
        assert outcomes[:5] == [errno.ETIMEDOUT] * 5 and outcomes[5] in ("posted", errno.ETIMEDOUT)
        with RpcClient(srv.endpoint, 5, curve_keys=keys) as c:  # with the keys it answers
            assert c.call("add", 1, 2) == 3
    finally:
        srv.stop()
        thread.join(5)
