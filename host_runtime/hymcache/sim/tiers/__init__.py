"""Remote KV tiers behind one interface, one tier per module.

The interface and what tiers share: ``base.py`` (``RemoteTier``, ``TIERS``, chunk keys); the host side they
move data through: ``host.py`` (PCIe, the staging buffer, NIC ports). The tiers: ``recompute.py``,
``gpu_prefix.py``, ``lmcache_local.py``, ``mooncake_dram.py``, ``mooncake_nvmeof.py``, ``lmcache_redis.py``
(``lmcache-redis`` and ``lmcache-local+redis``) and ``hymcache.py`` (``hymcache``, ``hymcache-noprefetch``,
``cmm-h``). Every name is re-exported here, so ``from host_runtime.hymcache.sim.tiers import X`` keeps working.
"""

from .base import NS, TIERS, CopiedOffGpu, RemoteTier, blocks_per_chunk, chunk_key
from .gpu_prefix import GpuPrefixTier
from .host import Host, Nic, Staging, rdma
from .hymcache import ControllerDevice, HyMCacheTier, sim_manager
from .lmcache_local import LMCacheLocal
from .lmcache_redis import REDIS_POLICIES, LMCacheRedis, Redis
from .mooncake_dram import MooncakePool, MooncakeTier
from .mooncake_nvmeof import FsPath, MooncakeNvmeofTier
from .recompute import RecomputeTier

__all__ = ["NS", "TIERS", "CopiedOffGpu", "ControllerDevice", "FsPath", "GpuPrefixTier", "Host", "HyMCacheTier",
           "LMCacheLocal", "LMCacheRedis", "MooncakeNvmeofTier", "MooncakePool", "MooncakeTier", "Nic",
           "REDIS_POLICIES", "RecomputeTier", "Redis", "RemoteTier", "Staging", "blocks_per_chunk", "chunk_key",
           "rdma", "sim_manager"]
