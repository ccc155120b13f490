"""The remote KV tiers' interface (``RemoteTier``) and what every tier shares: the tier names, chunk keys,
the copy off the GPU of a chunked host-side tier.

A worker's step calls, for each request (``worker.py``; the order of vLLM's KV connector v1):

* ``lookup(req)`` when the scheduler first considers it: how many blocks beyond the GPU prefix
  cache hit (``req.gpu_hit``) the tier can load, as one unbroken run (prefetch hints go out now);
* ``load(req, n)`` in the step that schedules it, before the forward (``start_load_kv``): a
  process that returns how many of the ``n`` blocks it loaded (a prefix: a block that fails or times
  out is recomputed with the rest);
* ``reserve_store(req)`` before the forward of the step that completes its prefill (``_reserve``:
  what will be stored; the device-to-host copies run during the forward, as ``save_kv_layer``);
* ``store(req)`` after that forward (``wait_for_save``): a process; refused blocks are skipped;
* ``finish(req)`` when it leaves the engine.

Each tier counts per request what it moved (``req.read_bytes``, ``req.write_bytes``,
``req.skipped_inserts``, ``req.timeouts``); the report sums them per turn.

Tiers: ``recompute`` (no reuse at all, GPU prefix caching off), ``gpu-prefix`` (vLLM's prefix cache
only), ``lmcache-local`` (per-worker CPU DRAM, LRU, 256-token chunks, a prefix reusable only as an
unbroken chain from the first chunk), ``mooncake-dram`` (a DRAM pool over RDMA, one segment per
prefill node, Mooncake Store's master rules, per-node transfer buffers with insert timeouts),
``mooncake-nvmeof`` (Mooncake's rules over a private file-system volume per prefill node on NVMe-oF SSDs),
``lmcache-redis`` (LMCache's remote backend, one Redis over TCP, stores refused at ``maxmemory``),
``lmcache-local+redis`` (LMCache's local DRAM first, then that Redis),
``hymcache`` (the runtime's Master and KV Manager in process, the emulator's Controller as the
device, in virtual time), ``hymcache-noprefetch`` (the same device policy and Master, no KV Manager
window: demand reads in order, as ``chm replay``'s variant of that name) and ``cmm-h`` (the same Master
over a stock CMM-H: the Controller with policy ``lru``, demand reads, no prefetch window).

In the PD topology (``topology.py``) every prefill node has its own tier object (its host: PCIe,
staging/transfer buffer, its NIC ports) over one shared backend (the Mooncake pool; the HyMCache
Master, KV Manager and device), built with ``peer=`` the first node's tier.
"""

from __future__ import annotations

from ..events import Env
from .host import Host


TIERS = ("recompute", "gpu-prefix", "lmcache-local", "mooncake-dram", "mooncake-nvmeof", "lmcache-redis",
         "lmcache-local+redis", "hymcache", "hymcache-noprefetch", "cmm-h")
NS = 1e9


def blocks_per_chunk(chunk_tokens: int, tokens_per_block: int) -> int:
    """KV blocks in one chunk of a chunked tier (LMCache's, Mooncake's objects)."""
    if chunk_tokens % tokens_per_block:
        raise ValueError(f"lmcache.chunk_tokens = {chunk_tokens} must be a multiple of model.tokens_per_block "
                         f"= {tokens_per_block}")
    return chunk_tokens // tokens_per_block


def chunk_key(req, c: int, per_chunk: int) -> tuple[int, int]:
    """Chunk ``c``'s key in a chunked tier: (-1, c) inside the shared prefix, else (conversation, c); a trace's
    request: (-2, the key of the chunk's first block), which names the chunk's prefix because a chunk lies
    inside one hash block (``config.check_settings``)."""
    if req.keys:
        return -2, req.keys[c * per_chunk]
    return (-1 if (c + 1) * per_chunk <= req.shared_blocks else req.conv), c


class RemoteTier:
    """The interface (module docstring). The base class is the ``gpu-prefix`` tier: nothing remote."""

    name = "gpu-prefix"
    gpu_prefix_caching = True

    def __init__(self, env: Env, host: Host, block_bytes: int):
        self.env, self.host, self.block_bytes = env, host, block_bytes

    def lookup(self, req) -> int:
        return 0

    def load(self, req, n: int):
        return n
        yield  # a process

    def reserve_store(self, req) -> None:
        pass

    def store(self, req):
        return None
        yield

    def finish(self, req) -> None:
        pass

    def describe(self) -> dict:
        return {"tier": self.name}


class CopiedOffGpu:
    """A chunked host-side tier's stores: the chunks a request will store are copied off the GPU during its
    forward (``reserve_store``, as ``save_kv_layer``); ``store`` waits for the last copy to land."""

    def _copy_off_gpu(self, req, new: list) -> None:
        if new:
            arrivals = self.host.d2h.stream([self.env.now] * len(new), [self.chunk_bytes] * len(new))
            self._pending[req.rid] = (new, arrivals[-1])

    def _copied(self, req):
        """Process: the chunks ``req`` reserved, once they are in host memory ([] if none)."""
        pending = self._pending.pop(req.rid, None)
        if pending is None:
            return []
        new, done = pending
        if done > self.env.now:
            yield done
        return new
