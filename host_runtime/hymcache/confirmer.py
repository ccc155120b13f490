"""The KV Manager's background confirmation (``KVManager.confirm_in_background``): its Master lookups of hints
answered before them, on a thread and a socket of their own."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

import zmq

from driver.errors import ChmError
from host_runtime.hymcache.manager_state import _Request
from host_runtime.hymcache.rpc import RemoteError, RpcClient, RpcTimeout

if TYPE_CHECKING:
    from host_runtime.hymcache.manager_core import KVManager


class _Confirmer:
    """The Manager's Master lookups of hints it answered first (``KVManager.confirm_in_background``), on a thread
    with a socket of its own: every request's lookup is in flight at once, and each one that gets no answer
    within ``timeout_s`` fails alone (its request is cancelled), so a Master that hangs or dies holds up
    neither the Manager's calls nor the other requests' confirmations."""

    def __init__(self, manager: "KVManager", endpoint: str, timeout_s: float, curve_keys: str | None):
        self.manager, self.endpoint, self.timeout_s, self.curve_keys = manager, endpoint, timeout_s, curve_keys
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hymcache-confirm", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """There is work: a request to confirm (called under the Manager's lock)."""
        os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        self._stopping = True
        self.kick()
        self._thread.join(timeout=30)
        os.close(self._wake)

    def _run(self) -> None:
        client = RpcClient(self.endpoint, self.timeout_s, curve_keys=self.curve_keys)
        poller = zmq.Poller()
        poller.register(client.sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        calls: dict[bytes, tuple[_Request, float]] = {}  # call id -> (its request, when it fails: monotonic s)
        try:
            while not self._stopping:
                try:
                    self._step(client, poller, calls)
                except Exception as exc:  # never let one bad answer end the thread (every hint would then hang)
                    self.manager.log(f"confirmer: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    def _step(self, client: RpcClient, poller, calls: dict) -> None:
        """Send the new requests' lookups, wait for an answer, the next request or the first deadline; apply."""
        self._send_next(client, calls, self._take_new())
        due = min((d for _, d in calls.values()), default=None)
        events = dict(poller.poll(None if due is None else max(0.0, 1000 * (due - time.monotonic())) + 1))
        if self._wake in events:
            try:
                os.eventfd_read(self._wake)
            except BlockingIOError:
                pass
        while (got := client.answer()) is not None:
            call_id, err, result, message = got
            entry = calls.pop(call_id, None)
            if entry is not None:  # else the answer came after its call had failed
                self._send_next(client, calls, self._answered(entry[0], err, result, message))
        now = time.monotonic()
        for call_id in [c for c, (_, due) in calls.items() if due <= now]:
            req, _ = calls.pop(call_id)
            self._failed(req, RpcTimeout(f"lookup to {self.endpoint}: no answer within {self.timeout_s:g} s"))

    def _take_new(self) -> list[tuple[_Request, list[bytes]]]:
        """Requests whose confirmation has not been asked for: (request, first batch) of each."""
        mgr = self.manager
        with mgr._lock:
            out = []
            for req in mgr.requests.values():
                state = req.confirmation
                if state is not None and not state.asked:
                    state.asked = True
                    out.append((req, mgr._next_batch(state)))
            return out

    def _send_next(self, client: RpcClient, calls: dict, work: list[tuple[_Request, list[bytes]]]) -> None:
        for req, batch in work:
            try:
                calls[client.send("lookup", batch)] = (req, time.monotonic() + self.timeout_s)
            except ChmError as exc:
                self._failed(req, exc)

    def _answered(self, req: _Request, err: int, result, message: str) -> list[tuple[_Request, list[bytes]]]:
        """Apply one lookup's answer; the request's next batch to ask for, if any."""
        mgr = self.manager
        with mgr._lock:
            state = req.confirmation
            if mgr.requests.get(req.request_id) is not req or state is None:
                return []  # finished, timed out or cancelled meanwhile
            try:
                if err:
                    raise RemoteError(err, f"lookup at {self.endpoint}: {message}")
                if not mgr._confirmed_batch(req, state, result):
                    return [(req, mgr._next_batch(state))]
            except Exception as exc:
                mgr._confirm_failed(req, exc)
            return []

    def _failed(self, req: _Request, exc: Exception) -> None:
        mgr = self.manager
        with mgr._lock:
            if mgr.requests.get(req.request_id) is req and req.confirmation is not None:
                mgr._confirm_failed(req, exc)

