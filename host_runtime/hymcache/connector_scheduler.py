"""The scheduler side of the HyMCache KV connector (vLLM's scheduler process): which prompt blocks the
Master holds, how many tokens load now, and each step's metadata for the worker side.

``get_num_new_matched_tokens`` looks up a request's full blocks against the Master in batches of
``lookup_batch`` (``None`` while in flight; only the contiguous prefix loadable now counts, and never the
prompt's last token); ``update_state_after_alloc`` plans the load into the blocks the engine allocated;
``build_connector_meta`` makes a fresh metadata object per step (loads of newly scheduled requests, the
prompt's full blocks to save in the step that completes its prefill); ``request_finished``.

Engine hooks a subclass overrides (vLLM: ``connector_vllm.py``): ``_scheduled``, ``_computed_before``,
``_engine_blocks`` (what the scheduler says; an engine block id is whatever the worker side's copies take)."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from driver.errors import ChmError

from .clock import Clock
from .connector_common import ConnectorSide, HyMCacheConfig, HyMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from .keys import block_keys
from .messages import BlockLoc, to


@dataclass
class _SchedState:
    keys: list[bytes]             # lookup candidates: full blocks, never the block holding the last token
    all_keys: list[bytes]         # every full block of the prompt (what is offered to store)
    started: float
    result: list[BlockLoc] | None = None
    matched_blocks: int = 0
    load: LoadSpec | None = None


class HyMCacheConnectorScheduler(ConnectorSide):
    """The scheduler side. ``lookup``: a Lookup (else one is made: over ZeroMQ when the Master is an endpoint);
    the other arguments are ``ConnectorSide``'s."""

    def __init__(self, config: HyMCacheConfig | dict | None, *, master=None, manager_for_node=None, lookup=None,
                 clock: Clock | None = None, log=None):
        super().__init__(config, master=master, manager_for_node=manager_for_node, clock=clock, log=log)
        self._sched: dict[str, _SchedState] = {}
        if lookup is None:
            from .lookup import Lookup

            # over ZeroMQ the Lookup's thread opens its own clients (an RpcClient is one thread's)
            remote = bool(self.config.master_endpoint) and manager_for_node is None
            lookup = Lookup(self.config.master_endpoint if remote else self.master,
                            manager_for_node, self.clock, batch=self.config.lookup_batch,
                            timeout_s=self.config.lookup_timeout_ms / 1000, rpc_timeout_s=self.config.rpc_timeout_s,
                            curve_keys=self.config.client_keys, log=self.log)
            self._own.append(lookup)
        self.lookup = lookup

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable now; ``(None, False)`` while the lookup is in flight."""
        rid, bs = request.request_id, self.block_size
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int) \
                or not 0 <= num_computed_tokens <= len(request.prompt_token_ids):
            raise ChmError(errno.EINVAL, f"num_computed_tokens {num_computed_tokens!r} is outside the allowed range "
                                         f"[0, {len(request.prompt_token_ids)}]")
        st = self._sched.get(rid)
        if st is None:
            prompt = request.prompt_token_ids
            all_keys = block_keys(prompt, bs, self.fingerprint)
            keys = all_keys[:(len(prompt) - 1) // bs]  # the last token is always computed (it gives the logits)
            st = self._sched[rid] = _SchedState(keys, all_keys, self.clock.now())
            self.counters["num_lookup_requests"] += 1
            self.counters["num_lookup_tokens"] += len(keys) * bs
            if not keys:
                st.result = []
            else:
                try:
                    self.lookup.start(rid, keys)
                except ChmError as exc:
                    self._lookup_failed(rid, st, exc)
        if st.result is None:
            try:
                result = self.lookup.poll(rid)
            except ChmError as exc:
                result = self._lookup_failed(rid, st, exc)
            if result is None:
                if self.clock.now() - st.started < self.config.lookup_timeout_ms / 1000:
                    return None, False
                result = self._lookup_failed(rid, st, ChmError(errno.ETIMEDOUT, "lookup_timeout_ms passed"))
            st.result = list(result)
            st.matched_blocks = self._loadable(st.keys, st.result)
            self.counters["num_lookup_hits"] += st.matched_blocks * bs
        tokens = max(0, st.matched_blocks * bs - num_computed_tokens)
        return tokens, False  # loads finish inside the forward pass (start_load_kv): never asynchronous

    def _lookup_failed(self, rid: str, st: _SchedState, exc: ChmError) -> list:
        self.counters["num_lookup_errors"] += 1
        self.log(f"lookup of request {rid}: {exc} (recomputing)")
        st.result = []
        return []

    def _loadable(self, keys: list[bytes], locs: list[BlockLoc]) -> int:
        """Length of the prefix of ``locs`` that matches ``keys`` in order and sits on a device this worker
        reaches now (its node is registered and its device node exists on this machine)."""
        n = 0
        for key, loc in zip(keys, locs):
            loc = loc if isinstance(loc, BlockLoc) else to(BlockLoc, loc)
            if loc.key != key:
                break
            try:
                info = self._device_info(loc.node, loc.device)
            except ChmError as exc:  # the Master went away after answering: recompute, never fail the request
                self.log(f"nodes() from the Master: {exc}")
                break
            if info is None or (self.config.transfer == "local" and not os.path.exists(info.node_path)):
                break
            n += 1
        return n

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._sched.get(request.request_id)
        if st is None:
            return
        bs = self.block_size
        computed = self._computed_before(request)
        n = num_external_tokens // bs if isinstance(num_external_tokens, int) else -1
        if n < 0 or n * bs != num_external_tokens or computed % bs or computed // bs + n > st.matched_blocks:
            raise ChmError(errno.EINVAL, f"num_external_tokens {num_external_tokens!r} for request "
                                         f"{request.request_id!r} is outside the allowed range: a multiple of {bs} "
                                         f"in [0, {st.matched_blocks * bs - computed}]")
        if n == 0:
            if st.result:  # hinted but not loaded: let the Managers drop its prefetches
                try:
                    self._finish_on(request.request_id, self.lookup.hinted_nodes(request.request_id))
                except ChmError as exc:
                    self.log(f"request {request.request_id}: {exc}")
            return
        first = computed // bs
        block_ids = self._engine_blocks(blocks)[first:first + n]
        if len(block_ids) != n:
            raise ChmError(errno.EINVAL, f"blocks hold {len(block_ids)} blocks from block {first} for request "
                                         f"{request.request_id!r}; {n} are needed for its external tokens")
        st.load = LoadSpec(st.keys[first:first + n], st.result[first:first + n], list(block_ids))

    def _computed_before(self, request) -> int:
        """Tokens of ``request`` computed before its external ones (PagedEngine: its num_computed_tokens)."""
        return request.num_computed_tokens

    def _engine_blocks(self, blocks) -> list:
        """The engine block ids of a request, one per chunk, from its KVCacheBlocks."""
        return blocks.get_block_ids()[0]

    def _scheduled(self, scheduler_output) -> list:
        """The step's requests: objects with request_id, prompt_token_ids, block_ids (engine block ids, one
        per chunk), num_computed_tokens (before the step) and num_scheduled_tokens (step.ScheduledRequest)."""
        return scheduler_output.scheduled

    def build_connector_meta(self, scheduler_output) -> HyMCacheConnectorMetadata:
        """What the worker does this step: loads of newly scheduled requests, saves of prefills that complete."""
        meta = self.metadata_class()
        for s in self._scheduled(scheduler_output):
            st = self._sched.get(s.request_id)
            if st is None:
                continue
            rm = ReqMeta(s.request_id)
            if st.load is not None:
                rm.load, st.load = st.load, None  # loaded once; after a load error the engine recomputes
            prompt = len(s.prompt_token_ids)
            if s.num_computed_tokens < prompt <= s.num_computed_tokens + s.num_scheduled_tokens and st.all_keys:
                n = len(st.all_keys)
                rm.save = SaveSpec(list(st.all_keys), list(s.block_ids[:n]))
            if rm.load or rm.save:
                meta.requests.append(rm)
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """Saves finish inside the step that completes the prefill, so the engine may free the blocks now."""
        if self._sched.pop(request.request_id, None) is not None:
            try:
                self.lookup.forget(request.request_id)
            except ChmError as exc:
                self.log(f"lookup forget of {request.request_id}: {exc}")
        return False, None
