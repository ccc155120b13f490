"""Where KV rows live, for a batch of sequences: the accelerator, host DRAM, and the CXL tier.

* ``ResidentKV``: per-layer K/V of the tokens kept on the accelerator, [B, Hkv, R, d]
  padded to the longest sequence, with a mask.
* ``HostKV``: per-layer K/V of offloaded tokens, under a mapping:
  - ``semantic`` (HybridGen, as in the paper): K and V in host DRAM while the
    offloaded KV fits the host-DRAM budget; beyond it the oldest V rows move to
    the CXL tier, and once every V row is there the oldest K rows follow (least
    recently generated first). Nothing is refused: the budget only moves rows.
  - ``interleaved`` (baseline): pages of ``page_tokens`` tokens alternate
    between DRAM and the CXL tier for K and V alike, so the CPU's K scan
    reads half its pages from the CXL tier.
  The CXL-resident V rows of layer i+1 can be prefetched on the device
  (``prefetch``/``wait``/``release``) while layer i runs; a device that answers
  EBUSY (window or handles full) is read on demand instead.
* ``EvictionEngine``: moves the oldest resident tokens (least recently
  generated) of each sequence to host memory when the accelerator budget is exceeded.

The CXL tier is any object with the device API (``write(addr, bytes)``,
``read(addr, length) -> bytes``, ``prefetch``, ``wait``, ``release``, ``flush()``,
``info()``, ``last_latency_ns``): ``emulator.Device`` in process, or
``libchm.Device`` of a ``chm serve`` (``open_cxl_tier(node=...)``). ``mapped_tier.MappedHostKV`` keeps the
V rows of that tier in a mapping of the device instead (loads and stores, no reads). Offloaded tokens are
always a prefix of each sequence (eviction is oldest first), so slot == position,
and rows in the CXL tier are a prefix of the slots too (spilling is oldest first).
"""

from __future__ import annotations

import errno
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from .names import MAPPINGS

ROW_DTYPE = torch.float32
KINDS = ("k", "v")


def open_cxl_tier(media_dir=None, profile: str = "small", policy: str = "hymcache", node: str | None = None):
    """The CXL tier: ``libchm.Device`` of the ``chm serve`` at ``node`` (its own profile and policy), or with
    ``node`` None an ``emulator.Device`` in this process."""
    if node is not None:
        from libchm import Device as Served

        return Served(node)
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


def pad_stack(tensors: list[torch.Tensor], axis: int, value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack tensors that differ only in ``axis`` into [B, ...] padded with ``value``; also the mask [B, T_max]
    (True for real entries)."""
    longest = max((t.shape[axis] for t in tensors), default=0)
    out, mask = [], torch.zeros(len(tensors), longest, dtype=torch.bool)
    for b, t in enumerate(tensors):
        n = t.shape[axis]
        mask[b, :n] = True
        pad = [0, 0] * (t.dim() - 1 - axis % t.dim()) + [0, longest - n]
        out.append(torch.nn.functional.pad(t, pad, value=value))
    return torch.stack(out), mask


@dataclass
class TierCounters:
    """Bytes moved per tier and modelled CXL time, reset per step by the engine."""
    bytes: Counter = field(default_factory=Counter)
    cxl_ns: float = 0.0
    cxl_calls: int = 0
    cxl_reads: int = 0        # read requests alone (the transfer's share of cxl_calls)
    refused_writes: int = 0
    prefetches: int = 0       # V regions staged ahead on the device
    prefetch_busy: int = 0    # prefetches the device refused (EBUSY): read on demand
    k_spilled_rows: int = 0   # K rows moved to the CXL tier this step (host DRAM full)

    def reset(self):
        self.bytes.clear()
        self.cxl_ns = 0.0
        self.cxl_calls = self.cxl_reads = self.refused_writes = 0
        self.prefetches = self.prefetch_busy = self.k_spilled_rows = 0


class ResidentKV:
    """Accelerator-resident K/V of one layer for B sequences: k, v [B, Hkv, cap, d]; pos [B, cap]; count [B]."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, capacity: int, device):
        self.k = torch.zeros(batch, n_kv_heads, capacity, head_dim, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(batch, capacity, dtype=torch.long)
        self.count = [0] * batch

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Add n tokens to sequence ``seq``. k, v: [Hkv, n, d]; pos: [n]."""
        c, n = self.count[seq], k.shape[1]
        if c + n > self.k.shape[2]:
            raise ValueError(f"resident tokens {c + n} exceed the resident capacity {self.k.shape[2]}")
        self.k[seq, :, c:c + n] = k
        self.v[seq, :, c:c + n] = v
        self.pos[seq, c:c + n] = pos
        self.count[seq] = c + n

    def append_step(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """One new token for every sequence. k, v: [B, Hkv, d]; pos: [B]."""
        for b in range(len(self.count)):
            self.append(b, k[b][:, None], v[b][:, None], pos[b:b + 1])

    def pop_oldest(self, seq: int, n: int):
        """Remove and return the n oldest rows of ``seq``: (k [Hkv, n, d], v [Hkv, n, d], pos [n])."""
        c = self.count[seq]
        out = self.k[seq, :, :n].clone(), self.v[seq, :, :n].clone(), self.pos[seq, :n].clone()
        self.k[seq, :, :c - n] = self.k[seq, :, n:c].clone()
        self.v[seq, :, :c - n] = self.v[seq, :, n:c].clone()
        self.pos[seq, :c - n] = self.pos[seq, n:c].clone()
        self.count[seq] = c - n
        return out

    def view(self):
        """(k, v [B, Hkv, R, d], pos [B, R], mask [B, R]) with R the longest sequence's count."""
        r = max(self.count)
        mask = torch.arange(r)[None, :] < torch.tensor(self.count)[:, None]
        return self.k[:, :, :r], self.v[:, :, :r], self.pos[:, :r], mask

    def rows(self, seq: int):
        """(k, v [Hkv, n, d], pos [n]) of one sequence."""
        c = self.count[seq]
        return self.k[seq, :, :c], self.v[seq, :, :c], self.pos[seq, :c]


class HostKV:
    """Offloaded K/V of all layers and B sequences in host DRAM and the CXL tier.

    ``dram_bytes``: the host-DRAM budget for offloaded KV (all layers, all sequences; inf: no limit).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, cxl=None,
                 mapping: str = "semantic", dram_bytes: float = math.inf, page_tokens: int = 16, batch: int = 1):
        if mapping not in MAPPINGS:
            raise ValueError(f"mapping={mapping!r} is invalid: allowed {MAPPINGS}")
        if not dram_bytes >= 0:
            raise ValueError(f"dram_bytes={dram_bytes!r} is invalid: allowed >= 0")
        if page_tokens < 1:
            raise ValueError(f"page_tokens={page_tokens} is invalid: allowed >= 1")
        if batch < 1:
            raise ValueError(f"batch={batch} is invalid: allowed >= 1")
        self.n_layers, self.hkv, self.d, self.capacity, self.batch = n_layers, n_kv_heads, head_dim, capacity, batch
        self.mapping, self.dram_bytes, self.page_tokens = mapping, dram_bytes, page_tokens
        self.cxl = cxl
        self.row_bytes = n_kv_heads * head_dim * torch.finfo(ROW_DTYPE).bits // 8
        # token-major rows [L, B, cap, Hkv*d]; a slot whose row moved to the CXL tier keeps a stale copy here
        self.k_dram = torch.zeros(n_layers, batch, capacity, n_kv_heads * head_dim, dtype=ROW_DTYPE)
        self.v_dram = torch.zeros_like(self.k_dram)
        self.count = np.zeros((n_layers, batch), dtype=np.int64)
        self.cxl_watermark = {kind: np.zeros(batch, dtype=np.int64) for kind in KINDS}  # rows [0, w) in CXL
        self.counters = TierCounters()
        self._prefetched: dict[tuple[int, int], list] = {}   # (layer, seq) -> [device handle, waited]
        self._cxl_lock = threading.Lock()  # the CPU worker and the accelerator side share one device handle
        self._write_chunk = 0
        if cxl is not None:
            info = cxl.info()
            need = 2 * n_layers * batch * capacity * self.row_bytes
            if need > info["capacity_bytes"]:
                raise ValueError(f"capacity {capacity} tokens x batch {batch} needs {need} bytes of CXL space; "
                                 f"the device has {info['capacity_bytes']}")
            wb_pages = info.get("write_buffer_bytes", 0) // info["page_size"]
            self._write_chunk = info["page_size"] * max(1, min(16, wb_pages // 2))
        elif mapping == "interleaved" or dram_bytes < 2 * n_layers * batch * capacity * self.row_bytes:
            raise ValueError("a CXL tier is needed: mapping is interleaved or the KV can outgrow dram_bytes")

    # ---- placement ---------------------------------------------------------------
    def in_cxl(self, kind: str, seq: int, slots: np.ndarray) -> np.ndarray:
        """Boolean [n]: does row ``slot`` of ``kind`` ('k' or 'v') of sequence ``seq`` live in the CXL tier?"""
        if self.mapping == "semantic":
            return slots < self.cxl_watermark[kind][seq]
        page_odd = (slots // self.page_tokens) % 2 == 1
        return page_odd if kind == "k" else ~page_odd

    def dram_rows(self) -> int:
        """Semantic mapping: rows (K and V, all layers and sequences) held in host DRAM."""
        return int(sum(self.count[:, b].sum() - self.n_layers * self.cxl_watermark[kind][b]
                       for kind in KINDS for b in range(self.batch)))

    def _addr(self, kind: str, layer: int, seq: int, slot: int) -> int:
        region = ((0 if kind == "k" else 1) * self.n_layers + layer) * self.batch + seq
        return (region * self.capacity + slot) * self.row_bytes

    def placement(self):
        """perfmodel.Placement: shares of the offloaded K and V rows in the CXL tier (all layers and sequences)."""
        from .perfmodel import Placement

        total = int(self.count[0].sum())
        if total == 0:
            return Placement()
        share = [sum(int(self.in_cxl(kind, b, np.arange(self.count[0, b])).sum()) for b in range(self.batch)) / total
                 for kind in KINDS]
        return Placement(*share)

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

    def _write_rows(self, kind: str, layer: int, seq: int, slots: np.ndarray, rows: np.ndarray) -> None:
        """rows [n, Hkv*d] of ascending ``slots`` into the CXL tier, one write per run of consecutive slots."""
        j = 0
        for s, m in coalesce(slots):
            self._cxl_write(self._addr(kind, layer, seq, s), rows[j:j + m].tobytes())
            j += m

    def _cxl_read_rows(self, kind: str, layer: int, seq: int, slots: np.ndarray) -> np.ndarray:
        """Ascending slots [n] -> rows [n, Hkv*d] read from the CXL tier in coalesced runs."""
        out = np.empty((len(slots), self.hkv * self.d), dtype=np.float32)
        i = 0
        with self._cxl_lock:
            self._wait_staged(kind, layer, seq)
            for start, n in coalesce(slots):
                raw = self.cxl.read(self._addr(kind, layer, seq, start), n * self.row_bytes)
                self.counters.cxl_ns += self.cxl.last_latency_ns
                self.counters.cxl_calls += 1
                self.counters.cxl_reads += 1
                out[i:i + n] = np.frombuffer(raw, dtype=np.float32).reshape(n, -1)
                i += n
        self.counters.bytes["cxl_read"] += len(slots) * self.row_bytes
        return out

    def _wait_staged(self, kind: str, layer: int, seq: int) -> None:
        """Before the first read of V rows staged on the device since the previous layer: wait once (lock held)."""
        staged = self._prefetched.get((layer, seq)) if kind == "v" else None
        if staged is not None and not staged[1]:
            self.cxl.wait(staged[0])
            self.counters.cxl_ns += self.cxl.last_latency_ns
            staged[1] = True

    def _stage_values(self, layer: int, seq: int, lo: int, hi: int) -> int:
        """Ask the device to stage V slots [lo, hi) of ``layer`` and ``seq``: its prefetch handle (lock held)."""
        return self.cxl.prefetch(self._addr("v", layer, seq, lo), (hi - lo) * self.row_bytes)

    def prefetch_values(self, layer: int) -> None:
        """Stage the CXL-resident V rows of ``layer`` on the device (all sequences); EBUSY: read them on demand."""
        if self.cxl is None:
            return
        for b in range(self.batch):
            n = self.count[layer, b]
            slots = np.nonzero(self.in_cxl("v", b, np.arange(n)))[0]
            if not len(slots) or (layer, b) in self._prefetched:
                continue
            lo, hi = int(slots[0]), int(slots[-1]) + 1
            with self._cxl_lock:
                try:
                    handle = self._stage_values(layer, b, lo, hi)
                    self._prefetched[(layer, b)] = [handle, False]
                    self.counters.prefetches += 1
                except Exception as exc:
                    if getattr(exc, "errno", None) != errno.EBUSY:
                        raise
                    self.counters.prefetch_busy += 1
                    continue
                self.counters.cxl_ns += self.cxl.last_latency_ns

    def release_values(self, layer: int) -> None:
        """Let the device drop the V rows of ``layer`` staged by ``prefetch_values``."""
        for b in range(self.batch):
            staged = self._prefetched.pop((layer, b), None)
            if staged is None:
                continue
            handle, waited = staged
            with self._cxl_lock:
                if not waited:  # staged but never read (nothing selected there): the device wants a wait first
                    self.cxl.wait(handle)
                self.cxl.release(handle)
                self.counters.cxl_ns += self.cxl.last_latency_ns

    def close(self) -> None:
        """Let go of what this object holds on the CXL tier (the tier itself is its owner's to close)."""

    # ---- API ----------------------------------------------------------------------------
    def append(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store evicted tokens of ``seq`` at ``layer`` after the existing ones. k, v: [Hkv, n, d].

        New rows go to host DRAM (or, interleaved, to their page's tier); ``enforce_dram_budget`` then moves
        the oldest rows out once the whole token has been appended to every layer.
        """
        n = k.shape[1]
        start = int(self.count[layer, seq])
        if start + n > self.capacity:
            raise ValueError(f"host KV capacity {self.capacity} tokens exceeded at layer {layer}, sequence {seq}")
        slots = np.arange(start, start + n)
        for kind, t in (("k", k), ("v", v)):
            rows = t.detach().to("cpu", ROW_DTYPE).transpose(0, 1).reshape(n, -1)
            (self.k_dram if kind == "k" else self.v_dram)[layer, seq, start:start + n] = rows
            cxl_mask = self.in_cxl(kind, seq, slots) if self.mapping == "interleaved" else np.zeros(n, bool)
            self.counters.bytes["dram_write"] += int((~cxl_mask).sum()) * self.row_bytes
            if cxl_mask.any():
                self._write_rows(kind, layer, seq, slots[cxl_mask], rows.numpy()[cxl_mask])
        self.count[layer, seq] = start + n

    def enforce_dram_budget(self) -> None:
        """Semantic mapping: while the offloaded KV exceeds ``dram_bytes``, move the oldest V rows of the
        sequence holding the most V in DRAM to the CXL tier; once no V is left in DRAM, the oldest K rows."""
        if self.mapping != "semantic" or self.cxl is None:
            return
        excess_rows = self.dram_rows() - self.dram_bytes / self.row_bytes
        for kind in ("v", "k"):  # V first: K stays in DRAM while it fits
            while excess_rows > 0:
                in_dram = self.count[0] - self.cxl_watermark[kind]
                seq = int(np.argmax(in_dram))
                if in_dram[seq] <= 0:
                    break
                tokens = int(min(in_dram[seq], math.ceil(excess_rows / self.n_layers)))
                self._spill(kind, seq, tokens)
                excess_rows -= tokens * self.n_layers

    def _spill(self, kind: str, seq: int, tokens: int) -> None:
        lo = int(self.cxl_watermark[kind][seq])
        slots = np.arange(lo, lo + tokens)
        dram = self.k_dram if kind == "k" else self.v_dram
        for layer in range(self.n_layers):
            self._write_rows(kind, layer, seq, slots, dram[layer, seq, lo:lo + tokens].numpy())
        self.cxl_watermark[kind][seq] = lo + tokens
        if kind == "k":
            self.counters.k_spilled_rows += tokens * self.n_layers

    def _rows(self, kind: str, layer: int, seq: int, slots: np.ndarray) -> torch.Tensor:
        """slots [n] ascending -> [Hkv, n, d], from whichever tier holds each row."""
        cxl_mask = self.in_cxl(kind, seq, slots)
        dram = self.k_dram if kind == "k" else self.v_dram
        rows = dram[layer, seq].index_select(0, torch.from_numpy(slots))
        self.counters.bytes["dram_read"] += int((~cxl_mask).sum()) * self.row_bytes
        if cxl_mask.any():
            rows[torch.from_numpy(cxl_mask)] = torch.from_numpy(self._cxl_read_rows(kind, layer, seq, slots[cxl_mask]))
        return rows.view(len(slots), self.hkv, self.d).transpose(0, 1)

    def key_rows(self, layer: int, seq: int = 0) -> torch.Tensor:
        """All offloaded K of ``layer`` as token-major rows [S, Hkv*d] for the CPU's scan (a view of DRAM while
        every K row is there)."""
        s = int(self.count[layer, seq])
        if self.mapping == "semantic" and self.cxl_watermark["k"][seq] == 0:
            self.counters.bytes["dram_read"] += s * self.row_bytes
            return self.k_dram[layer, seq, :s]
        return self._rows("k", layer, seq, np.arange(s)).transpose(0, 1).reshape(s, -1)

    def keys(self, layer: int, seq: int = 0) -> torch.Tensor:
        """All offloaded K of ``layer``: [Hkv, S, d]."""
        s = int(self.count[layer, seq])
        return self.key_rows(layer, seq).view(s, self.hkv, self.d).transpose(0, 1)

    def keys_at(self, layer: int, idx: torch.Tensor, seq: int = 0) -> torch.Tensor:
        """K rows of chosen offloaded tokens: idx [k] ascending -> [Hkv, k, d]."""
        return self._rows("k", layer, seq, idx.numpy().astype(np.int64))

    def values(self, layer: int, idx: torch.Tensor, seq: int = 0) -> torch.Tensor:
        """V rows of the selected offloaded tokens: idx [k] ascending -> [Hkv, k, d]."""
        return self._rows("v", layer, seq, idx.numpy().astype(np.int64))

    def positions(self, layer: int, seq: int = 0) -> torch.Tensor:
        return torch.arange(int(self.count[layer, seq]))


class EvictionEngine:
    """Keeps at most ``budget`` tokens per layer and sequence on the accelerator; the oldest go to host memory."""

    def __init__(self, budget: int | None):
        if budget is not None and budget < 0:
            raise ValueError(f"resident budget={budget} is invalid: allowed >= 0 or None (unbounded)")
        self.budget = budget
        self.evicted_tokens = 0
        self.seconds = 0.0

    def enforce(self, resident: list[ResidentKV], host: HostKV, incoming: int = 0) -> list[int]:
        """Evict so that each sequence has room for ``incoming`` new tokens; returns tokens evicted per sequence."""
        batch = len(resident[0].count)
        if self.budget is None:
            return [0] * batch
        t0 = time.perf_counter()
        evicted = []
        for b in range(batch):
            c = resident[0].count[b]
            n = min(c, max(0, c + incoming - self.budget))
            if n:
                for layer, r in enumerate(resident):
                    k, v, _ = r.pop_oldest(b, n)
                    host.append(layer, b, k, v)
                host.counters.bytes["pcie_to_host"] += 2 * n * host.n_layers * host.row_bytes
                self.evicted_tokens += n
            evicted.append(n)
        if any(evicted):
            host.enforce_dram_budget()
        self.seconds += time.perf_counter() - t0
        return evicted
