"""Where KV rows live: the accelerator, host DRAM, and the CXL tier.

* ``ResidentKV``: per-layer K/V of the tokens kept on the accelerator.
* ``HostKV``: per-layer K/V of offloaded tokens, under a mapping:
  - ``semantic`` (HybridGen): K always in host DRAM (the CPU scans it for
    logits); V in host DRAM up to ``v_dram_tokens`` per layer, later V rows in
    the CXL tier; only selected V rows are read back.
  - ``interleaved`` (baseline): pages of ``page_tokens`` tokens alternate
    between DRAM and the CXL tier for K and V alike, so the CPU's K scan
    reads half its pages from the CXL tier.
* ``EvictionEngine``: moves the oldest resident tokens (least recently
  generated) to host memory when the accelerator budget is exceeded.

The CXL tier is any object with the device API (``write(addr, bytes)``,
``read(addr, length) -> bytes``, ``flush()``, ``stats()``, ``last_latency_ns``):
``emulator.Device`` in process, or ``libchm.Device`` — one line in
``open_cxl_tier`` swaps it. Offloaded tokens are always a prefix of the
context (eviction is oldest first), so slot == position.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from .names import MAPPINGS

ROW_DTYPE = torch.float32


def open_cxl_tier(media_dir=None, profile: str = "small", policy: str = "hymcache"):
    """The CXL tier. Swap for ``libchm.Device.open(...)`` once the driver has landed."""
    from emulator import Device

    return Device.open(profile=profile, media_dir=media_dir, policy=policy)


def coalesce(indices: np.ndarray) -> list[tuple[int, int]]:
    """Ascending slot indices [k] -> [(start, length)] runs of consecutive slots."""
    if len(indices) == 0:
        return []
    breaks = np.nonzero(np.diff(indices) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(indices)]])
    return [(int(indices[s]), int(e - s)) for s, e in zip(starts, ends)]


@dataclass
class TierCounters:
    """Bytes moved per tier and modelled CXL time, reset per step by the engine."""
    bytes: Counter = field(default_factory=Counter)
    cxl_ns: float = 0.0
    cxl_calls: int = 0
    refused_writes: int = 0

    def reset(self):
        self.bytes.clear()
        self.cxl_ns = 0.0
        self.cxl_calls = 0
        self.refused_writes = 0


class ResidentKV:
    """Accelerator-resident K/V of one layer. k, v: [Hkv, R, d]; pos: [R]."""

    def __init__(self, n_kv_heads: int, head_dim: int, device):
        self.k = torch.empty(n_kv_heads, 0, head_dim, device=device)
        self.v = torch.empty(n_kv_heads, 0, head_dim, device=device)
        self.pos = torch.empty(0, dtype=torch.long)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        self.k = torch.cat([self.k, k], 1)
        self.v = torch.cat([self.v, v], 1)
        self.pos = torch.cat([self.pos, pos])

    def pop_oldest(self, n: int):
        """Remove and return the n oldest rows: (k [Hkv, n, d], v [Hkv, n, d], pos [n])."""
        out = self.k[:, :n], self.v[:, :n], self.pos[:n]
        self.k, self.v, self.pos = self.k[:, n:], self.v[:, n:], self.pos[n:]
        return out

    def __len__(self):
        return len(self.pos)


class HostKV:
    """Offloaded K/V of all layers in host DRAM and the CXL tier."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, cxl=None,
                 mapping: str = "semantic", v_dram_tokens: int = 256, page_tokens: int = 16):
        if mapping not in MAPPINGS:
            raise ValueError(f"mapping {mapping!r} must be one of {MAPPINGS}")
        if v_dram_tokens < 0:
            raise ValueError(f"v_dram_tokens {v_dram_tokens} must be >= 0")
        if page_tokens < 1:
            raise ValueError(f"page_tokens {page_tokens} must be >= 1")
        self.n_layers, self.hkv, self.d, self.capacity = n_layers, n_kv_heads, head_dim, capacity
        self.mapping, self.v_dram_tokens, self.page_tokens = mapping, v_dram_tokens, page_tokens
        self.cxl = cxl
        self.row_bytes = n_kv_heads * head_dim * torch.finfo(ROW_DTYPE).bits // 8
        # DRAM arrays are token-major rows [L, cap, Hkv*d]: one row = one token's K (or V) of a layer.
        self.k_dram = torch.zeros(n_layers, capacity, n_kv_heads * head_dim, dtype=ROW_DTYPE)
        self.v_dram = torch.zeros(n_layers, capacity, n_kv_heads * head_dim, dtype=ROW_DTYPE)
        self.count = [0] * n_layers
        self.counters = TierCounters()
        self._cxl_lock = threading.Lock()  # the CPU worker and the accelerator side share one device handle
        needs_cxl = mapping == "interleaved" or v_dram_tokens < capacity
        if needs_cxl and cxl is None:
            raise ValueError("a CXL tier is needed: mapping is interleaved or V overflows v_dram_tokens")
        if cxl is not None:
            info = cxl.info()
            need = 2 * n_layers * capacity * self.row_bytes
            have = info["capacity_bytes"]
            wb_pages = info.get("write_buffer_bytes", 0) // info["page_size"]
            self._write_chunk = info["page_size"] * max(1, min(16, wb_pages // 2))
            if need > have:
                raise ValueError(f"capacity {capacity} tokens needs {need} bytes of CXL space; the device has {have}")

    # ---- placement ---------------------------------------------------------------
    def in_cxl(self, kind: str, slots: np.ndarray) -> np.ndarray:
        """Boolean [n]: does row ``slot`` of ``kind`` ('k' or 'v') live in the CXL tier?"""
        if self.mapping == "semantic":
            return np.zeros(len(slots), bool) if kind == "k" else slots >= self.v_dram_tokens
        page_odd = (slots // self.page_tokens) % 2 == 1
        return page_odd if kind == "k" else ~page_odd

    def _addr(self, kind: str, layer: int, slot: int) -> int:
        region = (0 if kind == "k" else 1) * self.n_layers + layer
        return (region * self.capacity + slot) * self.row_bytes

    # ---- CXL I/O -------------------------------------------------------------------
    def _cxl_write(self, addr: int, data: bytes) -> None:
        """Write in page-aligned chunks no larger than half the device's write buffer (a bigger write is EINVAL)."""
        end = addr + len(data)
        with self._cxl_lock:
            while addr < end:
                stop = min(end, (addr // self._write_chunk + 1) * self._write_chunk)
                self._cxl_write_locked(addr, data[addr - end + len(data):stop - end + len(data)])
                addr = stop

    def _cxl_write_locked(self, addr: int, data: bytes) -> None:
        for attempt in range(2):
            try:
                self.cxl.write(addr, data)
                break
            except Exception as exc:
                # EAGAIN (emulator.WriteBufferFull, or libchm's -EAGAIN): hymcache refuses writes while
                # its write buffer is full. Drain it with flush(), then retry once.
                if getattr(exc, "errno", None) != errno.EAGAIN or attempt:
                    raise
                self.counters.refused_writes += 1
                self.cxl.flush()
                self.counters.cxl_ns += self.cxl.last_latency_ns
        self.counters.cxl_ns += self.cxl.last_latency_ns
        self.counters.cxl_calls += 1
        self.counters.bytes["cxl_write"] += len(data)

    def _cxl_read_rows(self, kind: str, layer: int, slots: np.ndarray) -> np.ndarray:
        """Ascending slots [n] -> rows [n, Hkv*d] read from the CXL tier in coalesced runs."""
        out = np.empty((len(slots), self.hkv * self.d), dtype=np.float32)
        i = 0
        for start, n in coalesce(slots):
            with self._cxl_lock:
                raw = self.cxl.read(self._addr(kind, layer, start), n * self.row_bytes)
                self.counters.cxl_ns += self.cxl.last_latency_ns
            self.counters.cxl_calls += 1
            out[i:i + n] = np.frombuffer(raw, dtype=np.float32).reshape(n, -1)
            i += n
        self.counters.bytes["cxl_read"] += len(slots) * self.row_bytes
        return out

    # ---- API ----------------------------------------------------------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store evicted tokens of ``layer`` after the existing ones. k, v: [Hkv, n, d]."""
        n = k.shape[1]
        start = self.count[layer]
        if start + n > self.capacity:
            raise ValueError(f"host KV capacity {self.capacity} tokens exceeded at layer {layer}")
        slots = np.arange(start, start + n)
        for kind, t in (("k", k), ("v", v)):
            rows = t.detach().to("cpu", ROW_DTYPE).transpose(0, 1).reshape(n, -1)
            dram = (self.k_dram if kind == "k" else self.v_dram)[layer]
            cxl_mask = self.in_cxl(kind, slots)
            dram[start:start + n][torch.from_numpy(~cxl_mask)] = rows[torch.from_numpy(~cxl_mask)]
            self.counters.bytes["dram_write"] += int((~cxl_mask).sum()) * self.row_bytes
            if cxl_mask.any():
                arr = rows.numpy()
                j = 0
                for s, m in coalesce(slots[cxl_mask]):
                    self._cxl_write(self._addr(kind, layer, s), arr[s - start:s - start + m].tobytes())
                    j += m
        self.count[layer] = start + n

    def _rows(self, kind: str, layer: int, slots: np.ndarray) -> torch.Tensor:
        """slots [n] ascending -> [Hkv, n, d], from whichever tier holds each row."""
        cxl_mask = self.in_cxl(kind, slots)
        dram = self.k_dram if kind == "k" else self.v_dram
        sel = torch.from_numpy(slots)
        rows = dram[layer].index_select(0, sel)
        self.counters.bytes["dram_read"] += int((~cxl_mask).sum()) * self.row_bytes
        if cxl_mask.any():
            rows[torch.from_numpy(cxl_mask)] = torch.from_numpy(self._cxl_read_rows(kind, layer, slots[cxl_mask]))
        return rows.view(len(slots), self.hkv, self.d).transpose(0, 1)

    def keys(self, layer: int) -> torch.Tensor:
        """All offloaded K of ``layer`` for the CPU's logits: [Hkv, S, d] (a view when all in DRAM)."""
        s = self.count[layer]
        if self.mapping == "semantic":
            self.counters.bytes["dram_read"] += s * self.row_bytes
            return self.k_dram[layer, :s].view(s, self.hkv, self.d).transpose(0, 1)
        return self._rows("k", layer, np.arange(s))

    def key_rows(self, layer: int) -> torch.Tensor:
        """All offloaded K of ``layer`` as token-major rows [S, Hkv*d] (a view of DRAM under semantic mapping)."""
        s = self.count[layer]
        if self.mapping == "semantic":
            self.counters.bytes["dram_read"] += s * self.row_bytes
            return self.k_dram[layer, :s]
        return self._rows("k", layer, np.arange(s)).transpose(0, 1).reshape(s, -1)

    def keys_at(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """K rows of chosen offloaded tokens: idx [k] ascending -> [Hkv, k, d]."""
        return self._rows("k", layer, idx.numpy().astype(np.int64))

    def values(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """V rows of the selected offloaded tokens: idx [k] ascending -> [Hkv, k, d]."""
        return self._rows("v", layer, idx.numpy().astype(np.int64))

    def positions(self, layer: int) -> torch.Tensor:
        return torch.arange(self.count[layer])


class EvictionEngine:
    """Keeps at most ``budget`` tokens per layer on the accelerator; the oldest go to host memory first."""

    def __init__(self, budget: int | None):
        if budget is not None and budget < 0:
            raise ValueError(f"resident budget {budget} must be >= 0 or None (unbounded)")
        self.budget = budget
        self.evicted_tokens = 0
        self.seconds = 0.0

    def enforce(self, resident: list[ResidentKV], host: HostKV, incoming: int = 0) -> int:
        """Evict so that each layer has room for ``incoming`` new tokens; returns tokens evicted per layer."""
        if self.budget is None:
            return 0
        t0 = time.perf_counter()
        n = min(len(resident[0]), max(0, len(resident[0]) + incoming - self.budget))
        if n:
            for layer, r in enumerate(resident):
                k, v, _ = r.pop_oldest(n)
                host.append(layer, k, v)
                host.counters.bytes["pcie_to_host"] += 2 * n * host.row_bytes
            self.evicted_tokens += n
        self.seconds += time.perf_counter() - t0
        return n
