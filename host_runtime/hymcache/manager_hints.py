"""The KV Manager's hint path (a mixin of KVManager, manager_core.py): a hint's keys resolved at the Master
(by this Manager, or first from the Lookup's own descriptors, confirmed after), the hits appended to the
request in consumption order, and the read leases a served read checks."""

from __future__ import annotations

import errno

import msgspec

from driver.errors import ChmError
from host_runtime.hymcache import auth
from host_runtime.hymcache.confirmer import _Confirmer
from host_runtime.hymcache.manager_state import (MAX_HINT_KEYS, MAX_U64, _Block, check, _check_keys,
                                                 _check_request_id, _check_seconds, _Confirmation, _Request)
from host_runtime.hymcache.messages import BlockLoc, to
from host_runtime.hymcache.window import window_blocks


class HintPath:
    """Hints, their confirmation at the Master and leases; the state is KVManager's (see there)."""

    def hint(self, request_id: str, keys: list[bytes], locs: list | None = None, confirm_later: bool = False,
             *, caller=None) -> int:
        """Stage ``keys``' blocks stored on this node, in this order, a window at a time; how many it will stage
        (a block the device then fails to stage reports its error at ``acquire``).

        ``locs``: the descriptors the Lookup's own Master lookup gave for the first keys (``locs[i]`` is
        ``keys[i]``'s). Those on this node start staging at once, before this Manager's own lookup -- which
        stays the authority: no block is handed out before the Master has confirmed its descriptor here, and
        if the answers differ every unconfirmed staging is released and the Master's answer is staged instead
        (``hint_locs_unconfirmed``). The Manager's Master round trip is then off the load's critical path.

        ``confirm_later`` (with ``locs``): return once the descriptors are staging and confirm them at the next
        ``progress`` or block call, whichever comes first (the served Manager's hint: the Lookup does not wait
        for this Manager's Master round trip). With ``confirm_in_background`` the confirmer's thread confirms
        it instead, and a block call before that answers ETIMEDOUT (the served Manager holds it). The count
        returned is then the descriptors' blocks here; a confirmation that fails cancels the request, so its
        blocks answer ENOENT and the worker recomputes. Without ``locs`` the hint is resolved at the Master
        before it returns. ``caller``: the connection it came on (the served Manager's), whose close cancels it."""
        request_id, keys = _check_request_id(request_id), _check_keys(keys)
        locs = self._check_hint_locs(keys, locs)
        with self._lock:
            if request_id in self.requests:
                raise ChmError(errno.EEXIST, f"request_id {request_id!r} already has a hint here; finish() it first")
            req = _Request(request_id, caller, self.clock.now())
            self.requests[request_id] = req
            self._take_leases(req, locs)
            locs = [msgspec.structs.replace(loc, lease=b"") if loc.lease else loc for loc in locs]  # as the Master's
            self.counters["hints"] += 1
            self.counters["hinted_keys"] += len(keys)
            if locs:
                try:
                    self._speculate(req, locs)
                except Exception:
                    self._cancel(req)  # nothing of this request stays held
                    raise
            req.confirmation = _Confirmation(keys, any(not block.confirmed for block in req.blocks))
            if not (locs and confirm_later):
                self._confirm(req)
            elif self._confirmer is not None:
                self._confirmer.kick()
            self._changed.notify_all()
            return len(req.blocks)

    def lease(self, request_id: str, locs: list, *, caller=None) -> int:
        """The Master's read leases of ``request_id`` on blocks here (``BlockLoc.lease`` of a lookup for that
        request: the Lookup hands over those its hint did not carry); how many are valid. A served ``read`` sends
        a block's bytes only to a request holding a valid lease on the block's version."""
        request_id = _check_request_id(request_id)
        if not isinstance(locs, (list, tuple)) or len(locs) > MAX_HINT_KEYS:
            raise ChmError(errno.EINVAL, f"locs must be a list of at most {MAX_HINT_KEYS} block descriptors")
        try:
            locs = [loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc) for loc in locs]
        except (TypeError, ValueError, msgspec.ValidationError) as exc:
            raise ChmError(errno.EINVAL, f"locs must be a list of block descriptors (BlockLoc): {exc}") from None
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                raise ChmError(errno.ENOENT, f"request_id {request_id!r} has no hint here (never hinted, finished, "
                                             "timed out or its worker disconnected)")
            self._touch(req, caller)
            return self._take_leases(req, locs)

    def _take_leases(self, req: _Request, locs: list[BlockLoc]) -> int:
        """Keep the valid lease tokens among ``locs`` (others' leases, other nodes' and forged ones are not)."""
        taken = 0
        for loc in locs:
            if not loc.lease or self.lease_secret is None or loc.node != self.node:
                continue
            expiry = auth.lease_expiry(self.lease_secret, loc.lease, req.request_id, loc.key, loc.version, self.node)
            if expiry is None:
                self.counters["leases_refused"] += 1
                continue
            req.leases[loc.key] = (loc.version, expiry)
            taken += 1
        return taken

    def _check_lease(self, request_id: str, key: bytes) -> None:
        """EACCES unless ``request_id`` holds an unexpired Master lease on ``key``'s block, at its version."""
        req = self.requests.get(request_id)
        block = req.by_key.get(key) if req is not None else None
        held = req.leases.get(key) if req is not None else None
        why = None
        if self.lease_secret is None:
            why = "this Manager has no lease secret (its Master gave none at register_node)"
        elif held is None:
            why = "it holds no lease on it: pass the Master's (lookup with this request id) in the hint or lease()"
        elif block is not None and held[0] != block.loc.version:
            why = f"its lease is on version {held[0]}, the block stored is version {block.loc.version}"
        elif auth.now_ms() >= held[1]:
            why = f"its lease ended {auth.now_ms() - held[1]} ms ago"
        if why is not None:
            self.counters["reads_refused"] += 1
            raise ChmError(errno.EACCES, f"read of block {key.hex()} refused to request {request_id!r}: {why}")

    def _confirm(self, req: _Request) -> None:
        """Resolve the hint's keys at the Master and stage the hits here; drop what the Master did not confirm."""
        state = req.confirmation
        try:
            while True:
                found = self.master.lookup(self._next_batch(state))
                if self._confirmed_batch(req, state, found):
                    break
        except Exception:
            self._cancel(req)  # the Master unreachable (or a bad answer): nothing of this request stays held
            raise

    def _next_batch(self, state: _Confirmation) -> list[bytes]:
        return state.keys[state.next:state.next + self.batch]

    def _confirmed_batch(self, req: _Request, state: _Confirmation, found: list) -> bool:
        """The Master's answer to the request's next batch: stage its hits here; True once the confirmation is
        complete (then what the Master did not confirm is dropped)."""
        found = [loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc) for loc in found]
        asked = len(self._next_batch(state))
        state.confirmed.extend(found)
        state.next += asked
        self._add_hits(req, found)
        self._issue(req)  # the first blocks go to the device before the next batch is resolved
        if len(found) < asked or state.next >= len(state.keys):  # the stored prefix ends here
            req.confirmation = None
            if state.speculated and not self._as_confirmed(req, state.confirmed):
                self._restart(req, state.confirmed)
            self._changed.notify_all()
            return True
        return False

    def _confirm_failed(self, req: _Request, exc: Exception) -> None:
        """The request's Master lookup failed: cancel it (its blocks answer ENOENT, the worker recomputes)."""
        self.counters["confirm_errors"] += 1
        self.log(f"request {req.request_id}: its hint's Master lookup failed ({type(exc).__name__}: "
                 f"{exc}); cancelled, the worker recomputes")
        self._cancel(req)

    def confirm_in_background(self, master_endpoint: str, timeout_s: float = 10.0, curve_keys: str | None = None) -> None:
        """Confirm hints answered before their Master lookup (``hint(confirm_later=True)``) on a thread of their
        own, every request's lookups in flight at once to ``master_endpoint``, each failing alone after
        ``timeout_s``: a Master that is slow or gone then holds up no call here, and a restarted one answers
        the new requests at once (the served Manager does this)."""
        with self._lock:
            if self._confirmer is None:
                self._confirmer = _Confirmer(self, master_endpoint, _check_seconds("timeout_s", timeout_s, False),
                                             curve_keys)

    def _confirm_pending(self) -> None:
        """Confirm every hint that was answered before its Master lookup (``hint(confirm_later=True)``)."""
        if self._confirmer is not None:
            return  # its thread does
        for req in [r for r in self.requests.values() if r.confirmation is not None]:
            try:
                self._confirm(req)
            except Exception as exc:
                self._confirm_failed(req, exc)

    def _check_hint_locs(self, keys: list[bytes], locs) -> list[BlockLoc]:
        if locs is None:
            return []
        try:
            locs = [loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc) for loc in locs]
        except (TypeError, ValueError, msgspec.ValidationError) as exc:
            raise ChmError(errno.EINVAL, f"locs must be a list of block descriptors (BlockLoc): {exc}") from None
        if len(locs) > len(keys):
            raise ChmError(errno.EINVAL, f"locs has {len(locs)} descriptors for {len(keys)} keys")
        for i, loc in enumerate(locs):
            if loc.key != keys[i]:
                raise ChmError(errno.EINVAL, f"locs[{i}] describes key {loc.key.hex()}, not keys[{i}] "
                                             f"{keys[i].hex()}")
            if min(loc.node, loc.device, loc.offset, loc.length - 1, loc.checksum, loc.version) < 0:  # the rare case
                for field, low in (("node", 0), ("device", 0), ("offset", 0), ("length", 1), ("checksum", 0),
                                   ("version", 0)):
                    check.int(f"locs[{i}].{field}", getattr(loc, field), low, MAX_U64)
        return locs

    def _speculate(self, req: _Request, locs: list[BlockLoc]) -> None:
        """Stage the hint's own descriptors of this node's blocks now, unconfirmed (see ``hint``)."""
        for loc in locs:
            if not self._here(loc) or loc.key in req.by_key:
                continue
            if loc.offset < 0 or loc.length <= 0 or loc.offset + loc.length > self.infos[loc.device].capacity_bytes:
                continue  # no place on that device: only the Master's answer counts
            self._append(req, loc, confirmed=False)
            self.counters["hint_locs_used"] += 1
        self._issue(req)

    def _here(self, loc: BlockLoc) -> bool:
        """The block is on one of this node's devices."""
        return loc.node == self.node and 0 <= loc.device < len(self.handles)

    def _append(self, req: _Request, loc: BlockLoc, confirmed: bool = True) -> None:
        """``loc``'s block is the request's next to stage."""
        if not req.blocks:  # the window in blocks follows the request's block size
            req.window = window_blocks(self.window_bytes, loc.length)
        block = _Block(loc, self.infos[loc.device].epoch, confirmed)
        req.blocks.append(block)
        req.by_key[loc.key] = block

    def _as_confirmed(self, req: _Request, confirmed: list[BlockLoc]) -> bool:
        """``req``'s blocks are exactly this node's part of the Master's answer, in its order, each confirmed."""
        local, seen = [], set()
        for loc in confirmed:
            if self._here(loc) and loc.key not in seen:
                seen.add(loc.key)
                local.append(loc)
        return all(block.confirmed for block in req.blocks) and [block.loc for block in req.blocks] == local

    def _restart(self, req: _Request, confirmed: list[BlockLoc]) -> None:
        """The Master did not confirm every descriptor the hint brought: release each staging of the request
        and stage from the Master's answer alone."""
        self.counters["hint_locs_unconfirmed"] += sum(not block.confirmed for block in req.blocks)
        for block in req.blocks:
            self._drop(req, block)
        req.blocks, req.by_key, req.next_issue, req.held = [], {}, 0, 0
        counted = self.counters["hint_hits"], self.counters["hint_other_node"]
        self._add_hits(req, confirmed)
        self.counters["hint_hits"], self.counters["hint_other_node"] = counted  # counted once, as they came
        self._issue(req)

    def _add_hits(self, req: _Request, found: list) -> None:
        for loc in found:
            loc = loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc)
            self.counters["hint_hits"] += 1
            if not self._here(loc):
                self.counters["hint_other_node"] += 1  # another node's Manager stages it (Lookup hints it too)
                continue
            known = req.by_key.get(loc.key)
            if known is not None:
                if not known.confirmed and known.loc == loc and known.epoch == self.infos[loc.device].epoch:
                    known.confirmed = True  # the hint's descriptor is the Master's: its staging stands
                continue  # (one the Master does not confirm stays unconfirmed: hint() starts over)
            self._append(req, loc)

