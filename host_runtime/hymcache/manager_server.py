"""The KV Manager served over ZeroMQ: the RPC adapter (which methods, who may call them, the caller's
connection), ManagerServer (held acquires and reads, disconnected callers) and serve_manager."""

from __future__ import annotations

import errno
import functools
import time
from typing import Callable

import zmq
import zmq.utils.monitor

from host_runtime.hymcache.manager_core import KVManager
from host_runtime.hymcache.manager_state import LOOK_STEP_S
from host_runtime.hymcache.rpc import ANSWERS_PER_PASS, MAX_BLOCK_BYTES, RpcServer, call_of

MANAGER_METHODS = ("hint", "acquire", "read", "write", "release", "finish", "touch", "progress", "stats", "devices",
                   "lease")
# Served with keys, who may call what (auth.py): a worker's load and store; stats for admin and monitor.
MANAGER_ROLES = {**{m: {"worker"} for m in ("hint", "acquire", "read", "write", "release", "finish", "touch",
                                             "lease")},
                 "progress": {"worker", "admin"}, "devices": {"worker", "admin", "monitor"},
                 "stats": {"admin", "monitor"}}
CALLER_METHODS = ("lease", "release", "touch")  # besides hint, acquire and read: they keep a request alive


class _Served:
    """What the server exposes for one call: the Manager's methods, given the caller's connection (``caller``, its
    ZeroMQ routing id) where it counts: a request is cancelled when the last connection that used it closes."""

    def __init__(self, manager: KVManager, caller: bytes | None):
        self.manager, self.caller = manager, caller

    def __getattr__(self, name):
        manager, caller = self.manager, self.caller
        # A block not staged yet answers ETIMEDOUT at once, without waiting for the device: the server holds
        # the call (``hold_s``, see ManagerServer) and asks again, and the client asks again after that.
        if name == "acquire":
            return lambda request_id, key, hold_s=0.0: manager.acquire(request_id, key, 0.0, look=True, caller=caller)
        if name == "read":  # bytes leave the node: only to a request holding the Master's lease
            return lambda request_id, key, hold_s=0.0: manager.read(request_id, key, 0.0, look=True,
                                                                    need_lease=True, caller=caller)
        if name == "hint":  # answered once staging starts: the Lookup does not wait for our Master round trip
            return lambda request_id, keys, locs=None: manager.hint(request_id, keys, locs, confirm_later=True,
                                                                    caller=caller)
        if name in CALLER_METHODS:
            return functools.partial(getattr(manager, name), caller=caller)
        return getattr(manager, name)


HOLD_MAX_S = 1.0        # longest the server holds an acquire or read whose block is not staged yet
MAX_HELD = 64           # calls held at once (a few per worker); past it a call answers ETIMEDOUT at once and its
                        # client asks again, so one pass over the held calls stays short


def _hold_of(frames: list) -> tuple[float, tuple]:
    """How long the caller lets the server hold this call (acquire/read: their third argument), in [0, HOLD_MAX_S];
    and what it asks for (method, request id, key: held calls asking the same look at the device once a pass)."""
    try:
        method, args = call_of(frames)
        hold = args[2] if method in ("acquire", "read") and len(args) > 2 else 0.0
        hold = min(float(hold), HOLD_MAX_S) if isinstance(hold, (int, float)) and hold > 0 else 0.0
        return hold, (method, *args[:2])
    except Exception:  # malformed: answered (EINVAL) as any call
        return 0.0, ()


class ManagerServer(RpcServer):
    """An RpcServer that also notices callers whose connection closed (see the module docstring), and holds an
    acquire or read whose block is still staging: it looks at the device again every LOOK_STEP_S and answers
    once the block is staged, or ETIMEDOUT when the caller's ``hold_s`` has passed. Nothing waits on the device,
    so one request's staging never holds up the others' calls."""

    def __init__(self, manager: KVManager, endpoint: str, *, curve_keys: str | None = None, tick_s: float = 0.02,
                 log: Callable[[str], None] | None = None, insecure: bool = False):
        super().__init__(_Served(manager, None), MANAGER_METHODS, endpoint, tick=manager.progress, tick_s=tick_s,
                         curve_keys=curve_keys, log=log, max_frame_bytes=MAX_BLOCK_BYTES,  # blocks travel here
                         roles=MANAGER_ROLES, insecure=insecure)
        self.manager = manager
        self.held: list[tuple[list, float, tuple]] = []  # (frames, when to answer ETIMEDOUT, what it asks), oldest first
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.callers_by_fd: dict[int, set[bytes]] = {}
        if not manager.endpoint:  # registered in process so far: now workers can reach it here
            manager.register(self.endpoint)

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self._stop.is_set():
                if self.held:  # no sub-millisecond poll timeout in ZeroMQ: a short sleep between looks
                    time.sleep(LOOK_STEP_S)
                if poller.poll(0 if self.held else int(self.tick_s * 1000)):
                    self._disconnects()
                    for _ in range(ANSWERS_PER_PASS):  # then the held calls' turn, however many more are queued
                        if not self.sock.poll(0):
                            break
                        # Before each message, not once a pass: a connection closed during the pass may have
                        # its fd reused by one whose message is next; its DISCONNECTED event, queued before that
                        # message, must not then cancel the new caller's requests.
                        self._disconnects()
                        frames = self.sock.recv_multipart(copy=False)
                        if len(frames) >= 3:
                            try:
                                fd = frames[1].get(zmq.SRCFD)
                            except zmq.ZMQError:  # a libzmq without it: the request timeout still cancels
                                fd = None
                            if fd is not None:
                                self.callers_by_fd.setdefault(fd, set()).add(frames[0].bytes)
                        self._answer(frames)
                if self.held:
                    self._answer_held()
                if self.tick is not None and time.monotonic() >= next_tick:
                    self.tick()
                    next_tick = time.monotonic() + (self.tick_s if self.held else 0.0)
        finally:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)

    def _run(self, frames: list) -> tuple[bytes, list, int]:
        """RpcServer's call, the Manager's methods given the caller's connection (its routing id)."""
        self.target = _Served(self.manager, frames[0].bytes if len(frames) >= 3 else None)
        return super()._run(frames)

    def _answer(self, frames: list) -> None:
        if len(frames) < 2:
            return  # no call id to answer to
        reply, result_frames, err = self._run(frames)
        hold, call = _hold_of(frames) if err == errno.ETIMEDOUT and len(self.held) < MAX_HELD else (0.0, ())
        if hold:
            self.held.append((frames, time.monotonic() + hold, call))
            self.manager.held_calls = len(self.held)
        else:
            self._send(frames, reply, result_frames)

    def _answer_held(self) -> None:
        """Ask again for every held call; answer those staged, failed or past their hold. Calls for the same block
        of the same request look at the device once per pass."""
        still, not_yet = [], set()
        for frames, until, call in self.held:
            if call in not_yet and time.monotonic() < until:
                still.append((frames, until, call))
                continue
            reply, result_frames, err = self._run(frames)
            if err == errno.ETIMEDOUT and time.monotonic() < until:
                still.append((frames, until, call))
                not_yet.add(call)
            else:
                self._send(frames, reply, result_frames)
        self.held = still
        self.manager.held_calls = len(still)

    def _disconnects(self) -> None:
        while self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for caller in self.callers_by_fd.pop(int(event["value"]), ()):
                    self.manager.caller_gone(caller)


def serve_manager(manager: KVManager, endpoint: str, curve_keys: str | None = None, **kwargs) -> ManagerServer:
    """A server for ``manager`` bound to ``endpoint`` (registered with the Master under the bound address
    unless the Manager was given one to advertise);
    run ``serve_forever()`` in a thread or as the main loop, ``stop()`` to end it."""
    return ManagerServer(manager, endpoint, curve_keys=curve_keys, **kwargs)

