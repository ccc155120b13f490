"""``mooncake-nvmeof``: Mooncake's rules over a private file-system volume per prefill node on NVMe-oF SSDs."""

from __future__ import annotations

from emulator.timing import Pipe

from ..events import Env
from .host import Host, Nic, rdma
from .mooncake_dram import MooncakePool, MooncakeTier


class FsPath:
    """One prefill node's file-system path to its private volume (XFS on an LVM volume of the storage node's
    RAID, over NVMe-oF): one pipe, shared by reads and writes, at the file system's sequential ceiling
    ``gb_per_s`` (GB/s); every chunk is one file operation, which occupies the path for ``op_ns`` of software
    time (open / extent lookup / close) on top of its bytes."""

    def __init__(self, name: str, gb_per_s: float, op_ns: float):
        self.pipe = Pipe(name, 0.0, gb_per_s)
        self.op_bytes = int(op_ns * gb_per_s)  # op_ns of occupancy, as bytes at the path's rate (bytes/ns = GB/s)
        self.ops = 0

    def transfer(self, now: float, nbytes: int) -> float:
        self.ops += 1
        return self.pipe.transfer(now, nbytes + self.op_bytes)


class MooncakeNvmeofTier(MooncakeTier):
    """Mooncake over NVMe-oF: Mooncake's chunked objects and its load / insert rules (``MooncakeTier``: transfer
    buffer, load timeout -> the rest recomputed, insert timeout -> dropped), but each prefill node's objects
    live in its own volume (a one-segment ``MooncakePool`` of ``capacity / prefill nodes``: nothing is shared
    between workers), and every read or write crosses the node's ``FsPath`` (the file system's ceiling and
    per-operation cost), the storage node's NIC (``storage_nic``, shared by all nodes) and this node's KV port;
    the slowest decides."""

    name = "mooncake-nvmeof"

    def __init__(self, env: Env, host: Host, block_bytes: int, tokens_per_block: int, chunk_tokens: int,
                 volume: MooncakePool, fs: FsPath, storage_nic: Nic | None, *, timeout_s: float,
                 insert_timeout_s: float, peer: "MooncakeNvmeofTier | None" = None):
        super().__init__(env, host, block_bytes, tokens_per_block, chunk_tokens, volume, [host], timeout_s=timeout_s,
                         insert_timeout_s=insert_timeout_s, peer=peer)
        self.fs, self.storage_nic = fs, storage_nic
        self.nodes = peer.nodes if peer is not None else []
        self.nodes.append(self)

    def _read_arrival(self, seg: int, now: float, nbytes: int) -> float:
        return max(self.fs.transfer(now, nbytes), rdma(self.storage_nic, self.host.kv_nic, now, nbytes))

    def _write_arrival(self, seg: int, now: float, nbytes: int) -> float:
        return max(self.fs.transfer(now, nbytes), rdma(self.host.kv_nic, self.storage_nic, now, nbytes))

    def describe(self) -> dict:
        pools = [t.pool for t in self.nodes]
        counts = {k: sum(p.counters[k] for p in pools) for k in pools[0].counters}
        return {"tier": self.name, "chunk_blocks": self.per_chunk,
                "capacity_chunks": sum(p.capacity_chunks for p in pools), "chunks": sum(len(p.objects) for p in pools),
                "fs_ops": sum(t.fs.ops for t in self.nodes), **counts, **self.counters}
