"""Lookup, on the worker side: which prefix blocks of a request are stored remotely.

After the engine's own prefix cache, the unmatched blocks' keys go to the Master in batches of at
most 32, one batch at a time, without waiting for the whole request: as soon as a batch's answer
names a node for the first time, the Lookup sends that node's KV Manager a prefetch hint with the
candidate keys from that hit on, and the Master's descriptors of the batch's hits among them, and
keeps looking. The Manager resolves the keys itself (its answer decides what it hands out), but
starts staging from the descriptors at once and answers before its own Master round trip, which
overlaps the staging.
The Master answers the longest stored prefix of each batch, so a batch that comes back short ends
the request's lookup.

The Lookup remembers the descriptors of its recent Master answers (``KNOWN_LOCATIONS``). A request whose
first key it knows (a later turn of a conversation this worker served) hints that key's node before the
Master is asked, with the remembered descriptors of the leading keys on that node: the Manager starts
staging one Master round trip sooner. Nothing is handed out on a remembered descriptor alone: the Manager
confirms every one at the Master before it hands the block out, and restages from the Master's answer if
it differs (a block evicted or moved since). The Lookup's own Master answer still decides the request's
hits and grants their read leases; it refreshes what is remembered and forgets the key it ends at.

``start`` and ``poll`` never block: the calls run on one background thread per Lookup, which owns
its own Master and Manager clients (an RpcClient is one thread's). Requests in flight take turns a
batch at a time, so a long prompt does not hold up a short one. Deadlines read the injected clock.
"""

from __future__ import annotations

import errno
import inspect
import threading
from collections import OrderedDict, deque
from typing import Callable

from driver.errors import ChmError
from host_runtime.hymcache.clock import Clock, WallClock
from host_runtime.hymcache.manager import (LOOKUP_BATCH, MAX_HINT_KEYS, WAIT_STEP_S, _check_keys,
                                           _check_request_id, _check_seconds)
from host_runtime.hymcache.messages import BlockLoc, to

LOOKUP_TIMEOUT_S = 10.0  # the connector's blocking_timeout_secs: past it the request recomputes
KNOWN_LOCATIONS = 1 << 15  # block descriptors remembered from Master answers (512 GiB of 16 MiB blocks)


class _Job:
    __slots__ = ("request_id", "keys", "deadline", "next", "found", "hinted", "done", "error", "cancelled")

    def __init__(self, request_id: str, keys: list[bytes], deadline: float):
        self.request_id, self.keys, self.deadline = request_id, keys, deadline
        self.next = 0                      # keys before it were asked for
        self.found: list[BlockLoc] = []    # the stored prefix so far
        self.hinted: list[int] = []        # nodes whose Manager got a hint, in the order hinted
        self.done = self.cancelled = False
        self.error: ChmError | None = None


class Lookup:
    """Remote prefix lookup of a worker.

    ``master``: a Master-like object (called only from the Lookup's thread), an endpoint string (the
    thread opens its own MasterClient) or a zero-argument factory of one. ``manager_for_node(node)``
    gives the node's Manager (called from the Lookup's thread, once per node); None: a ManagerClient
    to the endpoint the Master's ``nodes()`` names. ``timeout_s`` bounds one request's lookup on
    ``clock``; past it the request keeps what was found (and ``error`` says ETIMEDOUT). ``known_locations``:
    how many Master descriptors it remembers for early hints (0: none, every hint waits for the Master).
    """

    def __init__(self, master, manager_for_node: Callable[[int], object] | None = None, clock: Clock | None = None,
                 *, batch: int = LOOKUP_BATCH, timeout_s: float = LOOKUP_TIMEOUT_S, rpc_timeout_s: float = 5.0,
                 curve_keys: str | None = None, log: Callable[[str], None] | None = None,
                 known_locations: int = KNOWN_LOCATIONS):
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= LOOKUP_BATCH:
            raise ChmError(errno.EINVAL, f"batch {batch!r} is outside the allowed range: an integer in "
                                         f"[1, {LOOKUP_BATCH}]")
        if not (isinstance(master, str) or callable(getattr(master, "lookup", None)) or callable(master)):
            raise ChmError(errno.EINVAL, f"master {master!r} must be a Master, a MasterClient endpoint or a factory")
        if manager_for_node is not None and not callable(manager_for_node):
            raise ChmError(errno.EINVAL, f"manager_for_node {manager_for_node!r} must be callable (node -> Manager)")
        if isinstance(known_locations, bool) or not isinstance(known_locations, int) or known_locations < 0:
            raise ChmError(errno.EINVAL, f"known_locations {known_locations!r} is outside the allowed range: an "
                                         "integer >= 0")
        self.batch = batch
        self.known_locations = known_locations
        self.timeout_s = _check_seconds("timeout_s", timeout_s, allow_zero=False)
        self.rpc_timeout_s = _check_seconds("rpc_timeout_s", rpc_timeout_s, allow_zero=False)
        self.clock = clock or WallClock()
        self.curve_keys = curve_keys
        self.log = log or (lambda msg: None)
        self._master_spec, self._manager_for_node = master, manager_for_node
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._queue: deque[_Job] = deque()   # jobs with batches left, taking turns
        self._closed = False
        self.counters = dict.fromkeys(("num_lookup_requests", "lookup_batches", "num_lookup_tokens",
                                       "num_lookup_hits", "hints_sent", "hint_errors", "lookup_errors",
                                       "lookup_timeouts", "early_hints", "early_hints_stale"), 0)
        self._known: OrderedDict[bytes, BlockLoc] = OrderedDict()  # key -> its last Master descriptor (our thread's)
        self._thread = threading.Thread(target=self._run, name="hymcache-lookup", daemon=True)
        self._thread.start()

    # ---- the worker's side -----------------------------------------------------------
    def start(self, request_id: str, keys: list[bytes]) -> None:
        """Begin looking up ``keys`` (the request's unmatched prefix blocks, in order); returns at once."""
        request_id, keys = _check_request_id(request_id), _check_keys(keys)
        with self._cond:
            if self._closed:
                raise ChmError(errno.ESHUTDOWN, "this Lookup is closed")
            if request_id in self._jobs:
                raise ChmError(errno.EEXIST, f"request_id {request_id!r} has a lookup already; forget() it first")
            job = _Job(request_id, keys, self.clock.now() + self.timeout_s)
            self._jobs[request_id] = job
            self._queue.append(job)
            self.counters["num_lookup_requests"] += 1
            self._cond.notify_all()

    def poll(self, request_id: str) -> list[BlockLoc] | None:
        """The stored prefix's descriptors once the lookup is done; None while it is in flight."""
        with self._cond:
            job = self._job(request_id)
            return list(job.found) if job.done else None

    def result(self, request_id: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> list[BlockLoc]:
        """``poll``, waiting up to ``timeout_s`` on the clock (ETIMEDOUT past it)."""
        timeout_s = _check_seconds("timeout_s", timeout_s)
        with self._cond:
            deadline = self.clock.now() + timeout_s
            while True:
                job = self._job(request_id)
                if job.done:
                    return list(job.found)
                if self.clock.now() >= deadline:
                    raise ChmError(errno.ETIMEDOUT, f"lookup of request {request_id!r} not done within "
                                                    f"{timeout_s:g} s ({job.next} of {len(job.keys)} keys asked)")
                self._cond.wait(WAIT_STEP_S)

    def error(self, request_id: str) -> ChmError | None:
        """Why a finished lookup stopped early (Master unreachable, ETIMEDOUT), or None."""
        with self._cond:
            return self._job(request_id).error

    def hinted_nodes(self, request_id: str) -> list[int]:
        """The nodes whose Manager holds a hint of this request (finish it there when the request ends)."""
        with self._cond:
            return list(self._job(request_id).hinted)

    def forget(self, request_id: str) -> None:
        """Drop a request's lookup (stopping it if in flight). Unknown ids are ignored."""
        with self._cond:
            job = self._jobs.pop(_check_request_id(request_id), None)
            if job is not None:
                job.cancelled = True

    def stats(self) -> dict:
        with self._cond:
            return {**self.counters, "in_flight": sum(not j.done for j in self._jobs.values())}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def __enter__(self) -> "Lookup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _job(self, request_id: str) -> _Job:
        job = self._jobs.get(_check_request_id(request_id))
        if job is None:
            raise ChmError(errno.ENOENT, f"request_id {request_id!r} has no lookup (never started, or forgotten)")
        return job

    # ---- the background thread -------------------------------------------------------
    def _open_master(self):
        spec = self._master_spec
        if isinstance(spec, str):
            from host_runtime.hymcache.master import MasterClient
            return MasterClient(spec, timeout_s=self.rpc_timeout_s, curve_keys=self.curve_keys), True
        if callable(getattr(spec, "lookup", None)):
            return spec, False
        return spec(), True

    def _run(self) -> None:
        master, owned = None, []
        managers: dict[int, object] = {}
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        for job in self._queue:
                            self._finish(job, ChmError(errno.ESHUTDOWN, "the Lookup closed"))
                        return
                    job = self._queue.popleft()
                    if job.cancelled:
                        continue
                    if self.clock.now() > job.deadline:
                        self.counters["lookup_timeouts"] += 1
                        self._finish(job, ChmError(errno.ETIMEDOUT, f"lookup of {job.request_id!r} past its "
                                                                    f"{self.timeout_s:g} s"))
                        continue
                start = job.next
                batch = job.keys[start:start + self.batch]
                try:
                    if master is None:
                        master, own = self._open_master()
                        if own:
                            owned.append(master)
                    early = self._early_hint(managers, master, job) if start == 0 else None
                    # a Master grants this request's read leases (their tokens go to the Managers)
                    answer = (master.lookup(batch, request_id=job.request_id) if _leases(master)
                              else master.lookup(batch))
                    found = [loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc) for loc in answer]
                    self._learn(batch, found)
                except Exception as exc:  # never let one request's failure end the thread (and hang the rest)
                    if not isinstance(exc, ChmError):
                        exc = ChmError(errno.EIO, f"lookup at the Master: {type(exc).__name__}: {exc}")
                    self.log(f"lookup of {job.request_id!r}: the Master failed: {exc}")
                    with self._cond:
                        self.counters["lookup_errors"] += 1
                        self._finish(job, exc)
                    continue
                new_nodes = []
                with self._cond:
                    hinted_before = list(job.hinted)
                    if early is not None and (not found or found[0] != early):
                        self.counters["early_hints_stale"] += 1  # the Manager restages from the Master's answer
                    self.counters["lookup_batches"] += 1
                    self.counters["num_lookup_tokens"] += len(batch)
                    self.counters["num_lookup_hits"] += len(found)
                    for i, loc in enumerate(found):
                        if loc.node not in job.hinted and not job.cancelled:
                            job.hinted.append(loc.node)
                            new_nodes.append((loc.node, start + i))
                    job.found.extend(found)
                    job.next = start + len(batch)
                for node, first in new_nodes:  # hint the node's Manager before asking for the next batch
                    self._hint(managers, master, node, job.request_id, job.keys[first:], found[first - start:])
                for node in hinted_before:  # hinted before this answer (early, or an earlier batch): its leases
                    self._lease(managers, master, node, job.request_id, [loc for loc in found if loc.node == node])
                with self._cond:
                    if len(found) < len(batch) or job.next >= len(job.keys):
                        self._finish(job, None)
                    elif not job.cancelled:
                        self._queue.append(job)  # its next batch after the other requests' turns
        finally:
            for client in owned + [m for m in managers.values() if m is not None and self._manager_for_node is None]:
                try:
                    client.close()
                except Exception:
                    pass

    def _early_hint(self, managers: dict, master, job: _Job) -> BlockLoc | None:
        """Before the request's first Master lookup: hint the node its first key was last seen on, with the
        remembered descriptors of the leading keys there (the Manager confirms them before handing any out).
        The remembered descriptor of the first key, or None if it is not known."""
        first = self._known.get(job.keys[0])
        if first is None:
            return None
        locs = []
        for key in job.keys[:MAX_HINT_KEYS]:
            loc = self._known.get(key)
            if loc is None or loc.node != first.node:
                break
            locs.append(loc)
        with self._cond:
            if job.cancelled:
                return None
            job.hinted.append(first.node)
            self.counters["early_hints"] += 1
        self._hint(managers, master, first.node, job.request_id, job.keys, locs)
        return first

    def _learn(self, batch: list[bytes], found: list[BlockLoc]) -> None:
        """Remember the Master's descriptors of ``batch``'s hits; forget the key its stored prefix ends at."""
        known = self._known
        for loc in found:
            known[loc.key] = loc
            known.move_to_end(loc.key)
        if len(found) < len(batch):
            known.pop(batch[len(found)], None)
        while len(known) > self.known_locations:
            known.popitem(last=False)

    def _hint(self, managers: dict, master, node: int, request_id: str, keys: list[bytes],
              locs: list[BlockLoc]) -> None:
        """Hint ``keys`` to ``node``'s Manager, with the descriptors the Master gave for the first of them
        (``locs``): the Manager starts staging those before its own lookup confirms them."""
        try:
            manager = managers.get(node)
            if manager is None:
                manager = managers[node] = self._manager(node, master)
            manager.hint(request_id, keys[:MAX_HINT_KEYS], locs[:MAX_HINT_KEYS])
            with self._cond:
                self.counters["hints_sent"] += 1
        except Exception as exc:  # the Manager down: the worker's acquire fails later and it recomputes
            self.log(f"hint of {request_id!r} to node {node}: {type(exc).__name__}: {exc}")
            with self._cond:
                self.counters["hint_errors"] += 1

    def _lease(self, managers: dict, master, node: int, request_id: str, locs: list[BlockLoc]) -> None:
        """Hand ``node``'s Manager the Master's read leases of ``locs`` (its served read asks for them)."""
        locs = [loc for loc in locs if loc.lease]
        manager = managers.get(node)
        if not locs or manager is None or not callable(getattr(manager, "lease", None)):
            return
        try:
            manager.lease(request_id, locs[:MAX_HINT_KEYS])
        except Exception as exc:  # the Manager down or the request gone there: its reads fail, the worker recomputes
            self.log(f"leases of {request_id!r} to node {node}: {type(exc).__name__}: {exc}")
            with self._cond:
                self.counters["hint_errors"] += 1

    def _manager(self, node: int, master):
        if self._manager_for_node is not None:
            return self._manager_for_node(node)
        from host_runtime.hymcache.manager import ManagerClient

        nodes = master.nodes()
        entry = nodes.get(node, nodes.get(str(node)))
        if entry is None:
            raise ChmError(errno.ENOENT, f"node {node} has no Manager registered with the Master")
        endpoint = entry["endpoint"] if isinstance(entry, dict) else entry.endpoint
        return ManagerClient(endpoint, self.rpc_timeout_s, curve_keys=self.curve_keys)

    def _finish(self, job: _Job, error: ChmError | None) -> None:
        job.done, job.error = True, error
        self._cond.notify_all()


def _leases(master) -> bool:
    """Does ``master.lookup`` grant leases for a request (``request_id``)? A Master and a MasterClient do."""
    try:
        return "request_id" in inspect.signature(master.lookup).parameters
    except (TypeError, ValueError):
        return False
