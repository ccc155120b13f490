"""The KV Manager's block path (a mixin of KVManager, manager_core.py): each request's prefetch window moved on
in consumption order, read tokens handed out once a block is staged (``acquire``), the remote read and write
paths, releases, and requests cancelled (finish, timeout, disconnect). ``caller`` is the connection a served
call came on (ManagerServer passes it); a request is cancelled when the last connection that used it closes."""

from __future__ import annotations

import errno

from driver.errors import ChmError
from host_runtime.hymcache.manager_state import (FAILED, ISSUED, LOOK_STEP_S, MAX_U64, QUEUED, RELEASED, STAGED,
                                                 WAIT_STEP_S, _Block, check, _check_key, _check_request_id,
                                                 _check_seconds, _Request, _Unconfirmed)
from host_runtime.hymcache.messages import BlockLoc, ReadToken
from host_runtime.hymcache.rpc import Payload


class BlockPath:
    """The window, tokens, reads, writes and cancellation; the state is KVManager's (see there)."""

    # ---- the window ----------------------------------------------------------------
    def _issue(self, req: _Request, busy: set | None = None) -> None:
        """Prefetch ``req``'s next blocks, in order, while its window has room and the device takes them."""
        busy = set() if busy is None else busy
        while req.next_issue < len(req.blocks) and req.held < req.window:
            block = req.blocks[req.next_issue]
            dev_index = block.loc.device
            if dev_index in busy:
                return  # EBUSY on this device in this pass: keep the order, try at the next progress
            try:
                block.handle = self._prefetch(block)
            except ChmError as exc:
                if exc.errno == errno.EBUSY:
                    busy.add(dev_index)
                    self.counters["ebusy"] += 1
                    self.device_counters[dev_index]["ebusy"] += 1
                    return
                if exc.errno == errno.EINVAL and self._never_fits(dev_index, block.loc):
                    # More than one prefetch there may ever hold: served unstaged (a plain DRAM-path read).
                    self.counters["unfit"] += 1
                    block.state, block.handle = STAGED, 0
                else:
                    block.state, block.error = FAILED, exc
                    self.counters["num_load_errors"] += 1
                req.next_issue += 1
                continue
            block.state = ISSUED
            req.next_issue += 1
            req.held += 1
            self.held_bytes[dev_index] += block.loc.length
            self.counters["prefetches"] += 1
            self.device_counters[dev_index]["prefetches"] += 1
            self.device_counters[dev_index]["prefetch_bytes"] += block.loc.length
        self.window_bytes_max = max(self.window_bytes_max, sum(self.held_bytes))
        self.handles_max = max(self.handles_max, sum(r.held for r in self.requests.values()))

    def _prefetch(self, block: _Block) -> int:
        """``block``'s prefetch; on ENODEV once more on a reopened handle (its device may be back already)."""
        i = block.loc.device
        for retry in (False, True):
            dev = self._handle(i)
            if block.epoch != self.infos[i].epoch:
                raise ChmError(errno.ESTALE, f"device {i} ({self.infos[i].node_path}) came back with epoch "
                                             f"{self.infos[i].epoch}, the block was stored under {block.epoch}: "
                                             "it is gone (the Master dropped it)")
            try:
                return dev.prefetch(block.loc.offset, block.loc.length)
            except ChmError as exc:
                self._device_error(i, exc)
                if exc.errno != errno.ENODEV or retry:
                    raise

    def _never_fits(self, i: int, loc: BlockLoc) -> bool:
        """Does ``loc`` span more pages than one prefetch on device ``i`` may ever hold (its window, or this
        handle's share of it)? Decided from the handle's numbers: served and in-process devices alike."""
        info = self.handles[i].info() if self.handles[i] is not None else {}
        page = info.get("page_size")
        if not page:
            return False  # a device that does not say: its EINVAL is a load error
        limit = info.get("prefetch_limit_pages") or -(-info.get("prefetch_window_bytes", 0) // page)
        return (loc.offset + loc.length - 1) // page - loc.offset // page + 1 > limit

    def progress(self) -> None:
        """Reopen gone devices; cancel requests past their timeout; move every window on (oldest request first)."""
        with self._lock:
            self._check_devices()
            self._confirm_pending()
            now = self.clock.now()
            for req in [r for r in self.requests.values() if now - r.touched > self.request_timeout_s]:
                self.log(f"request {req.request_id}: untouched for {now - req.touched:.3g} s, cancelled")
                self.counters["num_timeouts_recompute"] += 1
                self._cancel(req)
            busy: set[int] = set()
            for req in self.requests.values():
                self._issue(req, busy)
            self._changed.notify_all()

    # ---- blocks to workers ---------------------------------------------------------
    def _block(self, request_id: str, key: bytes, caller=None, to_hand_out: bool = True) -> tuple[_Request, _Block]:
        req = self.requests.get(request_id)
        if req is None:
            raise ChmError(errno.ENOENT, f"request_id {request_id!r} has no hint here (never hinted, finished, "
                                         "timed out or its worker disconnected)")
        if to_hand_out and req.confirmation is not None:  # no block is handed out before the Master confirmed it here
            if self._confirmer is not None:
                raise _Unconfirmed(errno.ETIMEDOUT, f"request {request_id!r}: this Manager's Master lookup of its "
                                                    "hint is in flight")
            self._confirm(req)
        block = req.by_key.get(key)
        if block is None:
            raise ChmError(errno.ENOENT, f"key {key.hex()} is not a hit of request {request_id!r} on node "
                                         f"{self.node} (not stored here, or past the stored prefix)")
        self._touch(req, caller)
        return req, block

    def _touch(self, req: _Request, caller=None) -> None:
        """``req`` was used now, by ``caller`` (a connection of the served Manager; None in process)."""
        req.touched = self.clock.now()
        if caller is not None:
            req.callers.add(caller)

    def acquire(self, request_id: str, key: bytes, timeout_s: float = 10.0, *, look: bool = False,
                caller=None) -> ReadToken:
        """A read token once ``key``'s block is staged in device DRAM; ETIMEDOUT past ``timeout_s`` (the clock).

        ``look``: with ``timeout_s`` 0 a block whose SSD reads are in flight answers ETIMEDOUT at once (the served
        Manager looks, and holds the call); without it an issued block is waited for whatever ``timeout_s``.
        A libchm device is never waited on with the lock held: the acquire polls it (``chm_prefetch_poll``) and
        sleeps on the condition between looks, so other threads' calls, the served Manager's among them, go on
        meanwhile."""
        request_id, key = _check_request_id(request_id), _check_key(key)
        timeout_s = _check_seconds("timeout_s", timeout_s)
        with self._lock:
            deadline = self.clock.now() + timeout_s
            while True:
                try:
                    req, block = self._block(request_id, key, caller)
                except _Unconfirmed:
                    if look or self.clock.now() >= deadline:
                        raise
                    self._changed.wait(WAIT_STEP_S)
                    continue
                if block.state == QUEUED:
                    self.progress()
                if block.state == ISSUED:
                    dev = self.handles[block.loc.device]  # ISSUED: its device has a handle
                    try:
                        if look or hasattr(dev, "poll"):  # a libchm device: never wait on it holding the lock
                            staged = dev.poll(block.handle)
                        else:  # the simulation's device (virtual time) answers at once
                            dev.wait(block.handle)
                            staged = True
                    except ChmError as exc:
                        if exc.errno == errno.ENODEV:
                            self._gone(block.loc.device, exc)  # fails this block and the rest staged there
                        else:
                            self._drop(req, block)
                            block.state, block.error = FAILED, exc
                            self.counters["num_load_errors"] += 1
                    else:
                        if staged:
                            block.state = STAGED
                if block.state == STAGED:
                    self.counters["num_hit_tokens"] += 1
                    self.counters["num_retrieve_requests"] += 1
                    loc = block.loc
                    return ReadToken(request_id, key, self.node, loc.device, loc.offset, loc.length, loc.checksum,
                                     block.handle)
                if block.state == FAILED:
                    raise ChmError(block.error.errno, f"block {key.hex()} of request {request_id!r}: "
                                                      f"{block.error.message}")
                if block.state == RELEASED:
                    raise ChmError(errno.ENOENT, f"block {key.hex()} of request {request_id!r} was released")
                # QUEUED: behind this request's window or the device's (EBUSY). Others' releases move it.
                # ISSUED: its SSD reads are in flight; look again soon (the lock is free meanwhile). As a wait on
                # the device would, an in-process acquire waits for them whatever its timeout (which bounds
                # the queueing); a look does not.
                if self.clock.now() >= deadline and (look or block.state != ISSUED):
                    if block.state == ISSUED:
                        why = "staging: its SSD reads are in flight"
                    elif req.held >= req.window:
                        why = f"queued: its window of {req.window} blocks is held: release earlier blocks"
                    else:
                        why = "queued: the device's prefetch window is busy (EBUSY)"
                    raise ChmError(errno.ETIMEDOUT, f"block {key.hex()} of request {request_id!r} not staged "
                                                    f"within {timeout_s:g} s ({why})")
                self._changed.wait(LOOK_STEP_S if block.state == ISSUED else WAIT_STEP_S)

    def read(self, request_id: str, key: bytes, timeout_s: float = 10.0, *, look: bool = False,
             need_lease: bool = False, caller=None) -> Payload:
        """The remote path: the token's fields and the block's bytes as one zero-copy frame. ``need_lease`` (the
        served read): only to a request holding the Master's lease on the block (``lease``), else EACCES."""
        with self._lock:
            token = self.acquire(request_id, key, timeout_s, look=look, caller=caller)
            if need_lease:
                self._check_lease(request_id, key)
            data = bytearray(token.length)  # a fresh buffer per block: ZeroMQ sends it after we return
            try:
                self._handle(token.device).read_into(token.offset, data)
            except ChmError as exc:
                self._device_error(token.device, exc)
                raise
            self.counters["remote_reads"] += 1
            self.counters["remote_read_bytes"] += token.length
            self.device_counters[token.device]["read_bytes"] += token.length
            return Payload(token, [data])

    def write(self, device: int, offset: int, payload: list | None = None) -> int:
        """The remote write path: one frame's bytes at ``offset`` of ``device`` (from a WriteLoc).
        EAGAIN (write buffer full) and ENOSPC pass through: the worker skips the block."""
        with self._lock:
            device = check.int("device", device, 0, len(self.handles) - 1)
            offset = check.int("offset", offset, 0, MAX_U64)  # past the device's end: its ERANGE
            if not payload or len(payload) != 1:
                raise ChmError(errno.EINVAL, f"payload must be exactly one frame (the block), got "
                                             f"{len(payload or ())}")
            data = payload[0]
            try:
                n = self._handle(device).write(offset, data)
            except ChmError as exc:
                self._device_error(device, exc)
                if exc.errno in (errno.EAGAIN, errno.ENOSPC):
                    self.counters["write_refused"] += 1
                    self.device_counters[device]["write_refused"] += 1
                raise
            self.counters["remote_writes"] += 1
            self.counters["remote_write_bytes"] += n
            self.device_counters[device]["written_bytes"] += n
            return n

    def release(self, request_id: str, key: bytes, *, caller=None) -> bool:
        """Give a token back: its handle is released and the window moves on. False if already gone."""
        request_id, key = _check_request_id(request_id), _check_key(key)
        with self._lock:
            if request_id not in self.requests:
                return False  # finished or cancelled already: its handles went with it
            req, block = self._block(request_id, key, caller, to_hand_out=False)
            if block.state in (RELEASED, FAILED) or (block.state == STAGED and block.handle == 0):
                block.state = RELEASED if block.state != FAILED else FAILED
                return False
            if block.state == QUEUED:
                raise ChmError(errno.EINVAL, f"key {key.hex()} of request {request_id!r} was never acquired "
                                             "(still queued)")
            self._drop(req, block)
            self.progress()
            return True

    def release_later(self, request_id: str, key: bytes) -> None:
        """``release`` for a caller that does not need its outcome (over ZeroMQ nobody waits for the answer)."""
        self.release(request_id, key)

    def _drop(self, req: _Request, block: _Block) -> None:
        """Release ``block``'s device handle (the device may be gone: the handle went with it)."""
        if block.state in (ISSUED, STAGED) and block.handle:
            handle, block.state = block.handle, RELEASED  # first: _gone below must not count it again
            req.held -= 1
            self.held_bytes[block.loc.device] -= block.loc.length
            self.counters["releases"] += 1
            try:
                if self._attached(block.loc.device):  # else the handle went with the device
                    self.handles[block.loc.device].release(handle)
            except ChmError as exc:
                self.log(f"release of handle {handle} on device {block.loc.device}: {exc}")
                self._device_error(block.loc.device, exc)
        block.state = RELEASED

    def _cancel(self, req: _Request) -> int:
        held = req.held
        for block in req.blocks:
            if block.state in (ISSUED, STAGED):
                self._drop(req, block)
        self.requests.pop(req.request_id, None)
        self._changed.notify_all()
        return held

    def finish(self, request_id: str) -> int:
        """The request is done: cancel what is left of it; how many handles that released."""
        request_id = _check_request_id(request_id)
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return 0
            self.counters["finished"] += 1
            released = self._cancel(req)
            self.progress()
            return released

    def finish_later(self, request_id: str) -> None:
        """``finish`` for a caller that does not need its outcome."""
        self.finish(request_id)

    def touch(self, request_ids: list[str], *, caller=None) -> int:
        """Keep requests alive (a worker busy between acquires); how many were still here."""
        if not isinstance(request_ids, (list, tuple)):
            raise ChmError(errno.EINVAL, f"request_ids must be a list of request ids, not {type(request_ids).__name__}")
        with self._lock:
            alive = 0
            for rid in request_ids:
                req = self.requests.get(_check_request_id(rid))
                if req is not None:
                    self._touch(req, caller)
                    alive += 1
            return alive

    def caller_gone(self, caller) -> int:
        """A connection closed: cancel the requests no other live connection has used; how many."""
        with self._lock:
            gone = []
            for req in self.requests.values():
                if caller in req.callers:
                    req.callers.discard(caller)
                    if not req.callers:
                        gone.append(req)
            for req in gone:
                self.log(f"request {req.request_id}: its worker disconnected, cancelled")
                self.counters["cancelled_disconnect"] += 1
                self._cancel(req)
            if gone:
                self.progress()
            return len(gone)

