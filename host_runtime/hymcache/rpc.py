"""Calls between HyMCache processes over ZeroMQ: one small RPC layer for all.

A server exposes named methods of one object on a ROUTER socket; a client
(DEALER) calls them by name with positional arguments. Messages are
``[request id, header, *payload]``: the header is MessagePack (msgspec), the
payload frames are raw bytes sent without a copy (a KV block never passes
through the encoder). Arguments and results are plain MessagePack values;
Structs from ``messages.py`` travel as arrays and the typed wrappers convert
them back (``messages.to``).

Errors: a method that raises ``ChmError`` answers with its errno and message,
and the client raises ``RemoteError`` with the same errno. A call that gets no
answer within its timeout raises ``RpcTimeout`` (ETIMEDOUT); the client then
drops any late answer to it, so a slow or dead server never wedges a caller.
"""

from __future__ import annotations

import errno
import itertools
import reprlib
import threading
import traceback
from typing import Any, Callable, Iterable

import msgspec
import zmq

from driver.errors import ChmError
from driver.wire import lib as wire
from host_runtime.hymcache import auth

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

# The largest frame a socket takes in (ZMQ_MAXMSGSIZE): a peer that sends, or claims in a frame header, a
# larger one is disconnected before anything is allocated for it. A header of MAX_BATCH (65536) keys and
# their descriptors, read leases included, is under 11 MB (test_adversarial_net); a block frame (the KV
# Manager's read and write) is one block, and a block fits one libchm staging buffer.
MAX_HEADER_BYTES = 16 << 20
MAX_BLOCK_BYTES = wire.CHM_MAX_STAGING_BYTES
# Calls a server answers in a row before its tick (and the KV Manager's held calls) get their turn: a burst
# of calls, however long, never holds them up.
ANSWERS_PER_PASS = 64


class RemoteError(ChmError):
    """The called method failed on the server (its errno and message)."""


class RpcTimeout(ChmError):
    """No answer within the timeout (server slow, dead or unreachable)."""

    def __init__(self, message: str):
        super().__init__(errno.ETIMEDOUT, message)


class Payload:
    """A result with raw frames beside it (e.g. a KV block), sent without a copy."""

    __slots__ = ("result", "frames")

    def __init__(self, result: Any, frames: Iterable):
        self.result, self.frames = result, list(frames)


def curve_server(sock: zmq.Socket, keys_dir: str | None) -> None:
    """CurveZMQ on a server socket, from ``keys_dir/server.key_secret``; only the keys ``keys_dir/authorized``
    lists get in (ZAP, see auth.py)."""
    if keys_dir:
        auth.protect(sock, keys_dir)


def curve_client(sock: zmq.Socket, keys_dir: str | None) -> None:
    """``keys_dir``: a key directory (its ``client`` key) or a client's ``NAME.key_secret`` beside ``server.key``."""
    if keys_dir:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = auth.client_keys(keys_dir)


def make_curve_keys(keys_dir: str, nodes: int = 0) -> None:
    """The keys of a set in ``keys_dir`` (see ``auth.make_keys``): copy what each machine needs to it."""
    auth.make_keys(keys_dir, nodes)


def call_of(frames: list) -> tuple[str, list]:
    """(method, args) of a call as a server receives it ([routing id, call id, header, *payload]); EINVAL
    saying what is wrong with a malformed one."""
    if len(frames) < 3:
        raise ChmError(errno.EINVAL, f"malformed call of {len(frames) - 1} frame(s): a call is [call id, "
                                     "MessagePack [method, args], *payload frames]")
    try:
        call = _decode(frames[2].buffer)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested past msgspec's depth
        raise ChmError(errno.EINVAL, f"malformed call header ({len(frames[2].buffer)} bytes): not MessagePack "
                                     f"[method, args]: {exc}") from None
    if not (isinstance(call, list) and len(call) == 2 and isinstance(call[0], str) and isinstance(call[1], list)):
        raise ChmError(errno.EINVAL, f"malformed call header {reprlib.repr(call)}: a call's header is MessagePack "
                                     "[method (a string), args (an array)]")
    return call[0], call[1]


class RpcServer:
    """Serve ``methods`` of ``target`` on ``endpoint`` (``tcp://127.0.0.1:PORT``, ``ipc://PATH``;
    ``tcp://127.0.0.1:0`` picks a free port: see ``endpoint`` after start).

    A method receives the call's positional arguments, then ``payload=[memoryview, ...]`` if the
    call carried frames and the method accepts that keyword. ``tick`` (if given) runs at least every
    ``tick_s`` seconds while serving: timeouts, leases, background work.
    """

    def __init__(self, target: object, methods: Iterable[str], endpoint: str, *, tick: Callable[[], None] | None = None,
                 tick_s: float = 0.05, curve_keys: str | None = None, log: Callable[[str], None] | None = None,
                 context: zmq.Context | None = None, max_frame_bytes: int = MAX_HEADER_BYTES,
                 roles: dict | None = None, callers: Iterable[str] = (), insecure: bool = False):
        self.target, self.methods = target, frozenset(methods)
        # with keys: method -> the roles that may call it; ``callers``: methods given caller=auth.Identity
        self.roles = roles if curve_keys else None
        self.callers = frozenset(callers)
        self.tick, self.tick_s = tick, tick_s
        self.log = log or (lambda msg: None)
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.maxmsgsize = self.max_frame_bytes = max_frame_bytes
        warning = auth.check_bind(endpoint, curve_keys, insecure)
        curve_server(self.sock, curve_keys)
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = self.sock.bind_to_random_port(endpoint[:-2])
            self.endpoint = f"{endpoint[:-2]}:{port}"
        else:
            self.sock.bind(endpoint)
            self.endpoint = endpoint
        if warning:
            auth.warn(warning, log)
        self._stop = threading.Event()
        self.calls = 0

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(int(self.tick_s * 1000)):
                    for _ in range(ANSWERS_PER_PASS):
                        if not self.sock.poll(0):
                            break
                        self._answer(self.sock.recv_multipart(copy=False))
                if self.tick is not None:
                    self.tick()
        finally:
            self.sock.close(0)

    def _answer(self, frames: list) -> None:
        if len(frames) < 2:
            return  # no call id to answer to
        self._send(frames, *self._run(frames)[:2])

    def _run(self, frames: list) -> tuple[bytes, list, int]:
        """Call the method ``frames`` (a call of at least 3 frames) names: (the encoded reply, its raw frames,
        its errno: 0 on success)."""
        payload = frames[3:]
        result_frames: list = []
        err, method = 0, "?"
        try:
            method, args = call_of(frames)
            if method not in self.methods:
                raise ChmError(errno.EINVAL, f"unknown method {reprlib.repr(method)}; this server answers: "
                                             f"{', '.join(sorted(self.methods))}")
            who = auth.caller_of(frames[1]) if self.roles is not None or method in self.callers else None
            if self.roles is not None and not (who and who.roles & self.roles.get(method, frozenset())):
                raise auth.refuse(method, self.roles.get(method, ()), who)
            kw = {"caller": who} if method in self.callers else {}
            fn = getattr(self.target, method)
            result = fn(*args, payload=[f.buffer for f in payload], **kw) if payload else fn(*args, **kw)
            if isinstance(result, Payload):
                result, result_frames = result.result, result.frames
            reply = _encode((0, result, ""))
        except ChmError as exc:
            err, reply = exc.errno, _encode((exc.errno, None, exc.message))
        except (TypeError, ValueError, msgspec.DecodeError) as exc:  # a malformed call must not end the server
            err, reply = errno.EINVAL, _encode((errno.EINVAL, None, f"bad call of {method}: {exc}"))
        except Exception:
            self.log(f"internal error answering a call:\n{traceback.format_exc()}")
            err, reply = errno.EIO, _encode((errno.EIO, None, "internal error in the server (see its log)"))
        return reply, result_frames, err

    def _send(self, frames: list, reply: bytes, result_frames: list) -> None:
        """The answer to the call ``frames``, to its caller."""
        self.sock.send_multipart([frames[0], frames[1], reply, *result_frames], copy=False)
        self.calls += 1


class RpcClient:
    """Calls to one server. Like a libchm handle it is for one thread at a time."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, *, curve_keys: str | None = None,
                 context: zmq.Context | None = None, max_frame_bytes: int = MAX_HEADER_BYTES):
        if not timeout_s > 0:
            raise ChmError(errno.EINVAL, f"timeout_s {timeout_s!r} must be > 0")
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        # the server's limit too (its pair's constant): a larger frame is refused here, not sent to be dropped
        self.sock.maxmsgsize = self.max_frame_bytes = max_frame_bytes
        curve_client(self.sock, curve_keys)
        # A CurveZMQ server drops a plaintext or unauthorized handshake without a word: say so on a timeout.
        self._no_answer_hint = ("" if curve_keys else "; a service with CurveZMQ keys answers no client without "
                                "an authorized key (--curve-keys DIR, or the connector's key_dir)")
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)

    def call(self, method: str, *args, payload: Iterable | None = None, timeout_s: float | None = None,
             frames: bool = False) -> Any:
        """``method(*args)`` on the server; its result (and, with ``frames``, the reply's raw frames)."""
        wait_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        call_id = self._send(method, args, payload, wait_ms)
        while True:
            if not self.sock.poll(wait_ms):
                raise RpcTimeout(f"{method} to {self.endpoint}: no answer within {wait_ms} ms{self._no_answer_hint}")
            reply = self.sock.recv_multipart(copy=False)
            if reply[0].bytes != call_id:
                continue  # a late answer to a call that timed out
            err, result, message = _decode(reply[1].buffer)
            if err:
                raise RemoteError(err, f"{method} at {self.endpoint}: {message}")
            return (result, [f.buffer for f in reply[2:]]) if frames else result

    def post(self, method: str, *args) -> None:
        """``method(*args)`` on the server without waiting: for calls whose outcome the caller does not need.
        Its answer is dropped when a later ``call`` reads past it, as a timed-out call's is."""
        self.send(method, *args)

    def send(self, method: str, *args) -> bytes:
        """Send ``method(*args)`` without waiting for its answer; its call id (``answer`` gives the answers, for a
        caller that keeps several calls in flight: never mix it with ``call`` on one client)."""
        return self._send(method, args, None, int(1000 * self.timeout_s))

    def answer(self) -> tuple[bytes, int, Any, str] | None:
        """The next answer already received, without waiting: (call id, errno, result, message); None if none."""
        if not self.sock.poll(0):
            return None
        reply = self.sock.recv_multipart(copy=False)
        err, result, message = _decode(reply[1].buffer)
        return reply[0].bytes, err, result, message

    def _send(self, method: str, args, payload: Iterable | None, wait_ms: int) -> bytes:
        """Send the call ``method(*args)`` (and ``payload``'s frames) within ``wait_ms``; its call id. With no
        connection to hand a message to (the server never reached, or its CurveZMQ handshake refused us) a
        DEALER's send would block for ever."""
        call_id = next(self._ids).to_bytes(8, "little")
        frames = [call_id, _encode((method, list(args))), *(payload or ())]
        for i, frame in enumerate(frames[1:]):
            n = frame.nbytes if isinstance(frame, memoryview) else len(frame)
            if n > self.max_frame_bytes:
                what = f"payload[{i - 1}]" if i else "header"
                raise ChmError(errno.EINVAL, f"{method} to {self.endpoint}: its {what} is {n} bytes, outside the "
                                             f"allowed range [0, {self.max_frame_bytes}] (the server's largest frame)")
        self.sock.sndtimeo = wait_ms
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise RpcTimeout(f"{method} to {self.endpoint}: not sent within {wait_ms} ms (no connection to the "
                             "server: down, unreachable, or refusing our CurveZMQ keys)") from None
        return call_id

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> "RpcClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TypedClient:
    """Base of the typed clients (MasterClient, ManagerClient): one ``RpcClient`` in ``self.rpc``,
    closed with the client; a context manager."""

    rpc: RpcClient

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
