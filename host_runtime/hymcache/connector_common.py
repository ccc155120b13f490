"""What both sides of the HyMCache KV connector share: its settings (``HyMCacheConfig``, vLLM's
``kv_connector_extra_config``), the metadata the scheduler side hands the worker side each step, the
counters, and ``ConnectorSide``: the clients of the Master and the Managers that both sides call.
The sides themselves are ``connector_scheduler.py`` and ``connector_worker.py``; ``connector.py`` is
the entry that makes them."""

from __future__ import annotations

import contextvars
import errno
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Callable, Literal

import msgspec
from msgspec import Meta

from common.checks import Checks, outside
from driver.errors import ChmError

from . import auth
from .clock import Clock, WallClock
from .keys import ModelFingerprint
from .messages import BlockLoc, DeviceInfo, to

GB = 10**9
KV_LAYOUT = "layer,kv,token,head,dim"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
STAGING_BYTES_MAX = 1 << 30  # libchm's CHM_MAX_STAGING_BYTES: the most one device handle stages
TRANSFERS = ("local", "remote")
FIGURES_KEPT = 4096          # per-request figures kept for callers (chat rows), oldest dropped first

CHECK = Checks(lambda message: ChmError(errno.EINVAL, message))
_CONVERTING = contextvars.ContextVar("hymcache_config_converting", default=False)  # inside CHECK.convert


class KVConnectorRole(Enum):
    """vLLM's roles: one connector instance in the scheduler, one in each worker."""

    SCHEDULER = 0
    WORKER = 1


Seconds = Annotated[float, Meta(gt=0, le=3600)]


class HyMCacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``kv_connector_extra_config`` of vLLM's KVTransferConfig, names as LMCache users know them. Build it
    with ``from_dict``, which checks every range declared here."""

    chunk_size: Annotated[int, Meta(ge=1, le=4096)] = 16          # tokens per block
    blocking_timeout_secs: Seconds = 10.0                          # a load not staged by then is recomputed
    lookup_timeout_ms: Annotated[float, Meta(gt=0, le=3_600_000)] = 3000.0  # unanswered by then: no hit
    lookup_batch: Annotated[int, Meta(ge=1, le=32)] = 32           # keys per Master lookup
    # the only policy: a failed block and the rest are computed
    kv_load_failure_policy: Literal["recompute"] = "recompute"
    # GB of host transfer space (libchm staging, per device <= 1 GiB)
    staging_buffer_size: Annotated[float, Meta(gt=0, le=1024)] = 5.0
    master_endpoint: str = ""             # tcp://host:port of the Master ("" when one is passed in)
    curve_keys: str | None = None         # CurveZMQ: a key directory (its client key) or a NAME.key_secret file
    key_dir: Annotated[str, Meta(min_length=1)] | None = None  # CurveZMQ: the directory with server.key and ...
    key_name: str = "worker"              # ... NAME.key_secret (chm hymcache keys add --role worker NAME)
    rpc_timeout_s: Seconds = 5.0          # one call to the Master or a Manager (a dead one costs this much)
    model_name: Annotated[str, Meta(min_length=1)] = MODEL_NAME
    kv_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    verify_checksum: bool = True
    transfer: Literal["local", "remote"] = "local"  # local: libchm on this machine; remote: the node's KV Manager

    def __post_init__(self):
        if not _CONVERTING.get():  # built in code, not by from_dict: the declared ranges hold here too
            _converted(self.as_dict())
        # what the field types cannot say
        if self.key_dir and self.curve_keys:
            raise ChmError(errno.EINVAL, outside("key_dir", self.key_dir, "unset when curve_keys is set (one names "
                                                 "the key: key_dir with key_name, or curve_keys)"))
        if not isinstance(self.key_name, str) or not auth.NAME_RE.fullmatch(self.key_name):
            raise ChmError(errno.EINVAL, outside("key_name", self.key_name,
                                                 f"a key name matching {auth.NAME_RE.pattern}"))

    @classmethod
    def from_dict(cls, values: dict | None) -> "HyMCacheConfig":
        """From vLLM's ``kv_connector_extra_config`` (unknown names are an error, not ignored)."""
        values = dict(values or {})
        known = cls.__struct_fields__
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ChmError(errno.EINVAL, f"unknown HyMCache setting {unknown[0]!r}; the settings are: "
                                         f"{', '.join(sorted(known))}")
        return _converted(values)

    def as_dict(self) -> dict:
        return msgspec.structs.asdict(self)

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


def _converted(values: dict) -> HyMCacheConfig:
    token = _CONVERTING.set(True)
    try:
        return CHECK.convert(values, HyMCacheConfig)
    finally:
        _CONVERTING.reset(token)


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


class ConnectorSide:
    """What both sides hold: the config, the Master, the Managers by node, the counters. ``master``: a Master or
    MasterClient (else one at ``config.master_endpoint``); ``manager_for_node(node)``: a Manager or
    ManagerClient (else a ManagerClient at the endpoint the Master lists).

    An engine with other KV tensors than ``PagedEngine``'s (vLLM: ``connector_vllm.py``) subclasses a side and
    overrides its engine hooks; ``kv_layout`` (part of the fingerprint) and ``metadata_class`` are both sides'."""

    kv_layout = KV_LAYOUT
    metadata_class = HyMCacheConnectorMetadata

    def __init__(self, config: HyMCacheConfig | dict | None, *, master=None,
                 manager_for_node: Callable[[int], object] | None = None, clock: Clock | None = None,
                 log: Callable[[str], None] | None = None):
        self.config = config if isinstance(config, HyMCacheConfig) else HyMCacheConfig.from_dict(config)
        self.clock, self.log = clock or WallClock(), log or (lambda msg: None)
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

    def _finish_on(self, request_id: str, nodes) -> None:
        """Let the Managers of ``nodes`` drop what they still stage for the request."""
        for node in nodes:
            try:
                self.manager_for_node(node).finish_later(request_id)
            except ChmError as exc:
                self.log(f"finish of request {request_id} on node {node}: {exc}")

    def stats(self) -> dict:
        return dict(self.counters)

    def shutdown(self) -> None:
        for obj in reversed(self._own):
            try:
                obj.close()
            except Exception as exc:  # shutting down: report, go on closing the rest
                self.log(f"closing {type(obj).__name__}: {exc}")
        self._own = []
