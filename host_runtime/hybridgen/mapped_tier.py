"""HybridGen's CXL-resident V rows as memory: a tensor over a mapping of a real out-of-process device.

``HostKV`` reads V rows from the CXL tier with explicit requests (``read``: one per run of slots). Here,
as the paper runs it, the V region of the tier is mapped into this process (``libchm.Device.mmap``) and
wrapped with no copy (``torch.frombuffer``) as ``v_cxl`` [layers, batch, capacity, Hkv*d]:

* spilling V rows to the tier is plain stores into ``v_cxl`` (each page's first store faults, and the
  device admits it as a one-page write before the store completes);
* attention's V rows are ``index_select`` loads from ``v_cxl`` (a page's first touch faults and is served
  by the device as a read of that page would be: DRAM hit, or staged from its SSDs; the fault is served in
  the loading thread, ``CHM_MAP_INLINE``, where the kernel allows it, else by the mapping's handler thread);
* layer i+1's rows are staged on the device while layer i runs by pointer (``prefetch_ptr`` of the
  mapped address), waited and released as ``HostKV``'s explicit prefetch is.

K rows that spill too (host DRAM smaller than all of K) stay on explicit requests, at ``HostKV``'s
addresses; the V region starts at the first page boundary after them (a mapping is page-aligned).

The device must be a ``libchm.Device`` of a ``chm serve`` that ``mmap`` can map (``--policy lru``, as the
test and the bench run it); one it cannot is refused with EOPNOTSUPP, which names why. ``close`` drops the
tensor before withdrawing the mapping (an access after ``munmap`` is SIGBUS); the device outlives both.
"""

from __future__ import annotations

import errno
import math

import numpy as np
import torch

from .tiers import ROW_DTYPE, HostKV, coalesce


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class MappedHostKV(HostKV):
    """``HostKV`` whose CXL-resident V rows are loads and stores through a mapping of ``cxl``."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, cxl=None,
                 mapping: str = "semantic", dram_bytes: float = math.inf, page_tokens: int = 16, batch: int = 1):
        if cxl is None or not callable(getattr(cxl, "mmap", None)) or not callable(getattr(cxl, "prefetch_ptr", None)):
            raise ValueError(f"cxl={cxl!r} is invalid for mapped V rows: allowed a libchm.Device of a `chm serve` "
                             "(one with mmap and prefetch_ptr)")
        super().__init__(n_layers, n_kv_heads, head_dim, capacity, cxl, mapping, dram_bytes, page_tokens, batch)
        info = cxl.info()
        page = info["page_size"]
        region = n_layers * batch * capacity * self.row_bytes  # one kind's rows, all layers and sequences
        self.v_base = round_up(region, page)
        self.v_length = round_up(region, page)
        if self.v_base + self.v_length > info["capacity_bytes"]:
            raise ValueError(f"capacity {capacity} tokens x batch {batch} needs {self.v_base + self.v_length} bytes "
                             f"of CXL space (V page-aligned); the device has {info['capacity_bytes']}")
        try:  # faults served in the thread that loads or stores (CHM_MAP_INLINE): no hand-off per fault
            self._view = cxl.mmap(self.v_base, self.v_length, inline=True)
        except Exception as exc:  # driver.errors.ChmError; not x86-64, or a kernel without UFFD_FEATURE_SIGBUS
            if getattr(exc, "errno", None) != errno.EOPNOTSUPP:
                raise
            self._view = cxl.mmap(self.v_base, self.v_length)
        rows = n_layers * batch * capacity
        self.v_cxl = torch.frombuffer(self._view, dtype=ROW_DTYPE, count=rows * n_kv_heads * head_dim).view(
            n_layers, batch, capacity, n_kv_heads * head_dim)

    # ---- placement: V at the mapped region ------------------------------------------------
    def _addr(self, kind: str, layer: int, seq: int, slot: int) -> int:
        if kind == "k":
            return super()._addr(kind, layer, seq, slot)
        return self.v_base + ((layer * self.batch + seq) * self.capacity + slot) * self.row_bytes

    # ---- CXL I/O: V by loads and stores ------------------------------------------------------
    def _write_rows(self, kind: str, layer: int, seq: int, slots: np.ndarray, rows: np.ndarray) -> None:
        if kind == "k":
            return super()._write_rows(kind, layer, seq, slots, rows)
        target, j = self.v_cxl[layer, seq], 0
        for s, m in coalesce(slots):
            target[s:s + m] = torch.from_numpy(rows[j:j + m])  # stores: the device admits each page's first
            j += m
        self.counters.bytes["cxl_write"] += len(slots) * self.row_bytes

    def _cxl_read_rows(self, kind: str, layer: int, seq: int, slots: np.ndarray) -> np.ndarray:
        if kind == "k":
            return super()._cxl_read_rows(kind, layer, seq, slots)
        with self._cxl_lock:  # the handle is shared with the CPU worker's prefetches
            self._wait_staged(kind, layer, seq)
        # loads through the mapping: the mapping serializes its own faults (its queue pair), no lock needed
        out = self.v_cxl[layer, seq].index_select(0, torch.from_numpy(slots)).numpy()
        self.counters.bytes["cxl_read"] += len(slots) * self.row_bytes
        return out

    def _stage_values(self, layer: int, seq: int, lo: int, hi: int) -> int:
        start = self.v_cxl[layer, seq, lo]
        return self.cxl.prefetch_ptr(start.data_ptr(), (hi - lo) * self.row_bytes)

    def close(self) -> None:
        """Drop the tensor, then withdraw the mapping (an access after that would be SIGBUS)."""
        view, self._view, self.v_cxl = self._view, None, None
        if view is not None:
            try:
                self.cxl.munmap(view)
            except Exception as exc:  # driver.errors.ChmError
                # the device closed first: its close withdrew the mapping and forgot it (EINVAL, ENODEV)
                if getattr(exc, "errno", None) not in (errno.EINVAL, errno.ENODEV):
                    raise
