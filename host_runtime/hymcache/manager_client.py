"""A KV Manager over ZeroMQ (ManagerClient): the same methods as KVManager, for a worker on another machine
(or another process)."""

from __future__ import annotations

import errno
import time

from host_runtime.hymcache.clock import Clock, WallClock
from host_runtime.hymcache.manager_state import _check_seconds
from host_runtime.hymcache.messages import BlockLoc, DeviceInfo, ReadToken, to
from host_runtime.hymcache.rpc import MAX_BLOCK_BYTES, RemoteError, RpcClient, TypedClient


FIRST_POLL_S = 50e-6  # ManagerClient's first pause before asking again for a block not staged yet


class ManagerClient(TypedClient):
    """A KV Manager over ZeroMQ, the same methods (one thread at a time, like RpcClient).

    ``acquire``/``read`` poll the server (which never blocks on them) until ``timeout_s`` passes on ``clock``."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, *, curve_keys: str | None = None,
                 clock: Clock | None = None, poll_s: float = 0.001):
        self.rpc = RpcClient(endpoint, timeout_s, curve_keys=curve_keys, max_frame_bytes=MAX_BLOCK_BYTES)
        self.endpoint, self.clock = endpoint, clock or WallClock()
        self.poll_s = _check_seconds("poll_s", poll_s, allow_zero=False)

    def hint(self, request_id: str, keys: list[bytes], locs: list[BlockLoc] | None = None) -> int:
        return self.rpc.call("hint", request_id, list(keys), None if locs is None else list(locs))

    def _poll(self, method: str, request_id: str, key: bytes, timeout_s: float):
        timeout_s = _check_seconds("timeout_s", timeout_s)
        deadline = self.clock.now() + timeout_s
        pause = min(FIRST_POLL_S, self.poll_s)  # a block staged soon is asked for again soon
        while True:
            # the server holds the call until the block is staged, for at most hold_s (well inside our RPC timeout)
            hold_s = min(max(deadline - self.clock.now(), 0.0), self.rpc.timeout_s / 2)
            try:
                return self.rpc.call(method, request_id, key, hold_s, frames=True)
            except RemoteError as exc:
                if exc.errno != errno.ETIMEDOUT or self.clock.now() >= deadline:
                    raise
            if hold_s <= 0:
                time.sleep(pause)
                pause = min(2 * pause, self.poll_s)

    def acquire(self, request_id: str, key: bytes, timeout_s: float = 10.0) -> ReadToken:
        result, _ = self._poll("acquire", request_id, key, timeout_s)
        return to(ReadToken, result)

    def read(self, request_id: str, key: bytes, timeout_s: float = 10.0) -> tuple[ReadToken, memoryview]:
        """The token and the block's bytes (a view of the received frame: no copy)."""
        result, frames = self._poll("read", request_id, key, timeout_s)
        return to(ReadToken, result), frames[0]

    def write(self, device: int, offset: int, data) -> int:
        return self.rpc.call("write", device, offset, payload=[data])

    def lease(self, request_id: str, locs: list[BlockLoc]) -> int:
        return self.rpc.call("lease", request_id, list(locs))

    def release(self, request_id: str, key: bytes) -> bool:
        return self.rpc.call("release", request_id, key)

    def finish(self, request_id: str) -> int:
        return self.rpc.call("finish", request_id)

    def release_later(self, request_id: str, key: bytes) -> None:
        """Sent without waiting for the answer: the load goes on while the Manager releases."""
        self.rpc.post("release", request_id, key)

    def finish_later(self, request_id: str) -> None:
        self.rpc.post("finish", request_id)

    def touch(self, request_ids: list[str]) -> int:
        return self.rpc.call("touch", list(request_ids))

    def progress(self) -> None:
        self.rpc.call("progress")

    def stats(self) -> dict:
        return self.rpc.call("stats")

    def devices(self) -> list[DeviceInfo]:
        return to(list[DeviceInfo], self.rpc.call("devices"))
