"""A small paged-KV serving engine for SmolLM2: the worker a KV connector plugs into.

It mirrors vLLM v1 where the KV connector can see it, and nowhere else:

* the KV cache is paged: per layer one tensor ``[num_blocks, 2 (k, v), block_size, kv_heads, head_dim]``
  at the compute dtype (float32), so one block of one layer is contiguous;
* chunked prefill with chunks on absolute block boundaries (``[16 j, 16 j + 16)``): a run that loads
  the first blocks from elsewhere computes every later chunk exactly as a run that computed them all,
  so loaded KV that is bit-identical gives bit-identical logits;
* greedy decode, one token per step;
* a scheduler loop that drives a connector in vLLM's order (scheduler side, then worker side, then
  the scheduler's update), with vLLM's ``recompute`` answer to load errors: the request's computed
  tokens go back to the first failed block and everything from there is computed again.

With no connector it is the reference engine. Where it earns its place: a fast, in-process fixture for
the connector core's unit tests (tests/host_runtime/hymcache/test_connector.py, test_engine.py, the
faults), which need no vLLM engine (about 40 s to build, 5 GiB). Nothing a user runs depends on it: the
real engine is vLLM (``vllm_connector.py``, ``chm hymcache chat``). vLLM is not imported here;
``Request``, ``KVCacheBlocks``, ``SchedulerOutput`` and ``ForwardContext`` are stand-ins with the
fields a connector reads.
"""

from __future__ import annotations

import errno
import math
import time
from dataclasses import dataclass, field

import torch

from driver.errors import ChmError

from .clock import Clock, WallClock

from .step import ScheduledRequest, SchedulerOutput, layer_name


def _positive_int(name: str, value, high: int = 1 << 40) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ChmError(errno.EINVAL, f"{name} {value!r} is outside the allowed range: an integer in [1, {high}]")
    return value


@dataclass
class Request:
    """vLLM's Request, the fields a connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: str = "waiting"        # waiting | running | finished
    # what the engine measured (not vLLM fields)
    reused_tokens: int = 0         # prompt tokens whose KV came from the connector and were kept
    load_error_blocks: int = 0
    arrival: float = 0.0
    first_token_time: float | None = None
    first_token_logits: torch.Tensor | None = None
    steps: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens this engine computed (the rest came from the connector)."""
        return len(self.prompt_token_ids) - self.reused_tokens


class KVCacheBlocks:
    """vLLM's KVCacheBlocks for one KV cache group."""

    def __init__(self, block_ids: list[int]):
        self._ids = list(block_ids)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self._ids),)

    def get_unhashed_block_ids(self) -> list[int]:
        return list(self._ids)


@dataclass
class ForwardContext:
    """What start_load_kv sees: the layers' KV caches (vLLM's forward_context.no_compile_layers)."""

    kv_caches: dict[str, torch.Tensor]


@dataclass
class AttentionMetadata:
    """Per step: which slots each request writes (vLLM's slot_mapping, per request here)."""

    slots: dict[str, tuple[int, int]]   # request_id -> [first position, end position) computed this step


class PagedEngine:
    """SmolLM2 with a block-paged KV cache, chunked prefill and greedy decode.

    ``connector``: a (scheduler side, worker side) pair of KV connectors, or None (the reference).
    """

    def __init__(self, model, *, chunk_size: int = 16, num_blocks: int = 256, max_num_seqs: int = 8,
                 connector: tuple | None = None, clock: Clock | None = None):
        self.model = model
        cfg = model.cfg
        self.block_size = _positive_int("chunk_size", chunk_size, 4096)
        self.num_blocks = _positive_int("num_blocks", num_blocks, 1 << 20)
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs, 4096)
        self.clock = clock or WallClock()
        self.kv_caches = {layer_name(i): torch.zeros(self.num_blocks, 2, self.block_size, cfg.n_kv_heads, cfg.head_dim,
                                                     dtype=torch.float32, device=model.device)
                          for i in range(cfg.n_layers)}
        self._layers = list(self.kv_caches.values())
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out the lowest first
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._finished_since_step: set[str] = set()
        self._delayed_free: dict[str, list[int]] = {}
        self.steps = 0
        self.scheduler_connector = self.worker_connector = None
        if connector is not None:
            if not (isinstance(connector, tuple) and len(connector) == 2):
                raise ChmError(errno.EINVAL, f"connector {connector!r} must be a (scheduler side, worker side) pair")
            self.scheduler_connector, self.worker_connector = connector
            self.worker_connector.register_kv_caches(self.kv_caches)

    # ---- requests --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, max_tokens: int,
                    eos_token_id: int | None = None) -> Request:
        if not isinstance(request_id, str) or not request_id:
            raise ChmError(errno.EINVAL, f"request_id {request_id!r} must be a non-empty string")
        if request_id in self.requests:
            raise ChmError(errno.EEXIST, f"request_id {request_id!r} is already in this engine")
        ids = [int(t) for t in prompt_token_ids]
        vocab = self.model.cfg.vocab_size
        if not ids:
            raise ChmError(errno.EINVAL, "prompt_token_ids is empty: a request needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ChmError(errno.EINVAL, f"prompt_token_ids holds {bad[0]}, outside the allowed range [0, {vocab - 1}]")
        _positive_int("max_tokens", max_tokens, 1 << 20)
        need = math.ceil((len(ids) + max_tokens) / self.block_size)
        if need > self.num_blocks:
            raise ChmError(errno.ENOSPC, f"prompt of {len(ids)} tokens + max_tokens {max_tokens} needs {need} blocks; "
                                         f"the engine has num_blocks {self.num_blocks}")
        req = Request(request_id, ids, max_tokens, eos_token_id, arrival=self.clock.now())
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, request_id: str, prompt_token_ids, max_tokens: int, eos_token_id: int | None = None,
                 max_steps: int = 100_000, idle_wait_s: float = 0.001) -> Request:
        """Run one request to its end (other requests in the engine run along). A step with nothing to run
        (the connector's lookup still in flight) waits ``idle_wait_s`` and does not count against ``max_steps``."""
        req = self.add_request(request_id, prompt_token_ids, max_tokens, eos_token_id)
        steps = idle = 0
        while req.status != "finished":
            if steps >= max_steps or idle >= max_steps:
                raise ChmError(errno.ETIMEDOUT, f"request {request_id!r} did not finish within max_steps {max_steps} "
                                                f"({steps} steps run, {idle} idle)")
            if self.step().scheduled:
                steps += 1
            else:
                idle += 1
                time.sleep(idle_wait_s)  # a poll interval, not a deadline: the connector's timeouts read its clock
        return req

    # ---- one step: schedule, forward (worker), update -------------------------
    def _allocate(self, req: Request, num_tokens: int) -> bool:
        need = math.ceil(num_tokens / self.block_size) - len(req.block_ids)
        if need > len(self.free_blocks):
            return False
        req.block_ids.extend(self.free_blocks.pop() for _ in range(max(need, 0)))
        return True

    def _chunk(self, req: Request) -> int:
        """Tokens to compute for ``req`` this step: up to the next block boundary in prefill, 1 in decode."""
        prompt = len(req.prompt_token_ids)
        if req.num_computed_tokens < prompt:
            end = min(prompt, (req.num_computed_tokens // self.block_size + 1) * self.block_size)
            return end - req.num_computed_tokens
        return 1

    def _schedule(self) -> SchedulerOutput:
        sc = self.scheduler_connector
        scheduled = []
        for req in self.running:
            n = self._chunk(req)
            if not self._allocate(req, req.num_computed_tokens + n):
                raise ChmError(errno.ENOMEM, f"out of KV blocks for request {req.request_id!r} "
                                             f"(num_blocks {self.num_blocks})")
            scheduled.append(ScheduledRequest(req.request_id, req.prompt_token_ids, list(req.block_ids),
                                              req.num_computed_tokens, n, False))
        for req in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                break
            external = 0
            if sc is not None:
                external, load_async = sc.get_num_new_matched_tokens(req, req.num_computed_tokens)
                if external is None:
                    continue  # the lookup is still in flight: ask again next step
                self._check_external(req, external, load_async)
            start = req.num_computed_tokens + external
            end = min(len(req.prompt_token_ids), (start // self.block_size + 1) * self.block_size)
            if not self._allocate(req, end):
                break
            if sc is not None:
                sc.update_state_after_alloc(req, KVCacheBlocks(req.block_ids), external)
            req.num_computed_tokens = start
            req.reused_tokens = start
            req.status = "running"
            self.waiting.remove(req)
            self.running.append(req)
            scheduled.append(ScheduledRequest(req.request_id, req.prompt_token_ids, list(req.block_ids),
                                              req.num_computed_tokens, end - start, True))
        out = SchedulerOutput(scheduled, self._finished_since_step)
        self._finished_since_step = set()
        return out

    def _check_external(self, req: Request, external, load_async) -> None:
        """The connector's answer: whole blocks, and at least one prompt token left to compute."""
        limit = len(req.prompt_token_ids) - 1 - req.num_computed_tokens
        if isinstance(external, bool) or not isinstance(external, int) or not 0 <= external <= limit \
                or external % self.block_size:
            raise ChmError(errno.EPROTO, f"connector matched {external!r} tokens for request {req.request_id!r}; "
                                         f"allowed: a multiple of {self.block_size} in [0, {limit}]")
        if load_async and external == 0:
            raise ChmError(errno.EPROTO, f"connector says the load of request {req.request_id!r} is asynchronous "
                                         "with 0 tokens to load")
        if load_async:
            raise ChmError(errno.ENOTSUP, "asynchronous loads (WAITING_FOR_REMOTE_KVS) are not modelled; "
                                          "the connector must load within the forward pass")

    def step(self) -> SchedulerOutput:
        sched = self._schedule()
        self.steps += 1
        wc = self.worker_connector
        meta = self.scheduler_connector.build_connector_meta(sched) if self.scheduler_connector else None
        if wc is not None:
            wc.bind_connector_metadata(meta)
            wc.start_load_kv(ForwardContext(self.kv_caches))
        logits = self._forward(sched)
        invalid: set[int] = set()
        if wc is not None:
            wc.wait_for_save()
            done_saving, _done_loading = wc.get_finished(set(sched.finished_req_ids))
            invalid = set(wc.get_block_ids_with_load_errors())  # vLLM asks before clearing the metadata
            wc.clear_connector_metadata()
            for rid in done_saving or ():
                for b in self._delayed_free.pop(rid, []):
                    self.free_blocks.append(b)
        self._update(sched, logits, invalid)
        return sched

    def _forward(self, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """One forward pass over every scheduled request; each request computed on its own (no batching across
        requests), so its numbers never depend on what else ran in the step."""
        model, wc = self.model, self.worker_connector
        states = {}
        for s in sched.scheduled:
            req = self.requests[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            ids = torch.tensor(req.all_token_ids[start:end])
            states[s.request_id] = (model.embed(ids), torch.arange(start, end), s.block_ids)
        meta = AttentionMetadata({s.request_id: (s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens)
                                  for s in sched.scheduled})
        for layer, kv in enumerate(self._layers):
            name = layer_name(layer)
            if wc is not None:
                wc.wait_for_layer_load(name)
            for rid, (x, pos, blocks) in states.items():
                states[rid] = (self._layer(layer, kv, x, pos, blocks), pos, blocks)
            if wc is not None:
                wc.save_kv_layer(name, kv, meta)
        return {rid: model.lm_head(x[-1:])[0] for rid, (x, _, _) in states.items()}

    def _layer(self, layer: int, kv: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
               blocks: list[int]) -> torch.Tensor:
        model, c, bs = self.model, self.model.cfg, self.block_size
        q, k, v = model.qkv(layer, x, pos)              # q [Hq, T, d]; k, v [Hkv, T, d]
        start, end = int(pos[0]), int(pos[-1]) + 1
        p = start
        while p < end:  # write this chunk's k, v into its blocks
            b, off = divmod(p, bs)
            n = min(bs - off, end - p)
            kv[blocks[b], 0, off:off + n] = k[:, p - start:p - start + n].transpose(0, 1)
            kv[blocks[b], 1, off:off + n] = v[:, p - start:p - start + n].transpose(0, 1)
            p += n
        ctx = kv.index_select(0, torch.tensor(blocks[:math.ceil(end / bs)]))  # [n, 2, bs, Hkv, d]
        keys = ctx[:, 0].reshape(-1, c.n_kv_heads, c.head_dim)[:end].transpose(0, 1).repeat_interleave(c.group, dim=0)
        vals = ctx[:, 1].reshape(-1, c.n_kv_heads, c.head_dim)[:end].transpose(0, 1).repeat_interleave(c.group, dim=0)
        mask = torch.full((end - start, end), float("-inf")).triu(start + 1)  # query at p sees keys 0..p
        scores = q @ keys.transpose(1, 2) / math.sqrt(c.head_dim) + mask
        return model.finish(layer, x, torch.softmax(scores, -1) @ vals)

    def _update(self, sched: SchedulerOutput, logits: dict[str, torch.Tensor], invalid: set[int]) -> None:
        now = self.clock.now()
        for s in sched.scheduled:
            req = self.requests[s.request_id]
            req.steps += 1
            failed = [i for i, b in enumerate(req.block_ids) if b in invalid]
            if failed and failed[0] * self.block_size < s.num_computed_tokens + s.num_scheduled_tokens:
                # vLLM's kv_load_failure_policy="recompute": keep the blocks before the first failed one,
                # drop this step's work and compute again from there
                req.load_error_blocks += len([i for i in failed if i * self.block_size < s.num_computed_tokens])
                req.num_computed_tokens = min(req.num_computed_tokens, failed[0] * self.block_size)
                req.reused_tokens = min(req.reused_tokens, req.num_computed_tokens)
                continue
            req.num_computed_tokens += s.num_scheduled_tokens
            if req.num_computed_tokens < len(req.prompt_token_ids):
                continue  # mid-prefill: no token sampled
            token = int(torch.argmax(logits[s.request_id]))
            if req.first_token_time is None:
                req.first_token_time, req.first_token_logits = now, logits[s.request_id].clone()
            req.output_token_ids.append(token)
            if len(req.output_token_ids) >= req.max_tokens or token == req.eos_token_id:
                self._finish(req)

    def _finish(self, req: Request) -> None:
        req.status = "finished"
        self.running.remove(req)
        self.finished.append(req)
        self._finished_since_step.add(req.request_id)
        delay = False
        if self.scheduler_connector is not None:
            delay, _params = self.scheduler_connector.request_finished(req, list(req.block_ids))
        if delay:
            self._delayed_free[req.request_id] = list(req.block_ids)
        else:
            self.free_blocks.extend(req.block_ids)
        req.block_ids = []

    def release(self, request_id: str) -> None:
        """Forget a finished request (its stats too)."""
        req = self.requests.get(request_id)
        if req is None or req.status != "finished":
            raise ChmError(errno.EINVAL, f"request_id {request_id!r} is not a finished request of this engine")
        del self.requests[request_id]
        self.finished.remove(req)

    def shutdown(self) -> None:
        for conn in (self.worker_connector, self.scheduler_connector):
            if conn is not None:
                conn.shutdown()

    def __enter__(self) -> "PagedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
