"""Logit parallelism as small pure functions (batched, GQA-aware).

Shapes: B batch, Hq query heads, Hkv KV heads (Hq = G * Hkv), d head dim,
T tokens. Softmax and V aggregation always run where the caller says the
accelerator is; these functions only compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def attention_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled logits q·Kᵀ/√d. q: [B, Hq, d], k: [B, Hkv, T, d] -> [B, Hq, T].

    This is the CPU's logits calculator as well as the accelerator's: the same
    formula, so concatenated logits equal monolithic ones bit for bit in fp32
    whenever both sides run it on the same device type.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    return torch.matmul(qg, k.transpose(-1, -2)).reshape(b, hq, -1) / math.sqrt(d)


def block_diagonal_query(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """q: [Hq, d] -> [Hkv*d, Hq], zero outside each KV head's query group, pre-scaled by 1/√d."""
    hq, d = q.shape
    g = hq // n_kv_heads
    out = torch.zeros(n_kv_heads * d, hq, dtype=q.dtype)
    for h in range(n_kv_heads):
        out[h * d:(h + 1) * d, h * g:(h + 1) * g] = q[h * g:(h + 1) * g].T / math.sqrt(d)
    return out


def cpu_logits_rows(q: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
    """The CPU logits kernel on host DRAM's token-major K. q: [Hq, d], k_rows: [S, Hkv*d] -> [Hq, S].

    Streams each K row exactly once: the compiled kernel (``kernel_build``) on
    ``torch.get_num_threads()`` threads when it is available, else one GEMM
    against a block-diagonal query.
    """
    hq, d = q.shape
    kernel = _native_kernel()
    if kernel is not None and k_rows.dtype == torch.float32 and k_rows.device.type == "cpu":
        k_rows = k_rows.contiguous()
        qs = (q.to(torch.float32) / math.sqrt(d)).contiguous()
        out = torch.empty(k_rows.shape[0], hq)
        ffi = kernel.ffi
        kernel.lib.hg_logits_rows(ffi.cast("float *", k_rows.data_ptr()), k_rows.shape[0], k_rows.shape[1] // d, d,
                                  ffi.cast("float *", qs.data_ptr()), hq, ffi.cast("float *", out.data_ptr()),
                                  torch.get_num_threads())
        return out.T
    return (k_rows @ block_diagonal_query(q, k_rows.shape[1] // d)).T


_KERNEL: list = []


def _native_kernel():
    if not _KERNEL:
        from .kernel_build import load

        _KERNEL.append(load())
    return _KERNEL[0]


def weighted_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs: [B, Hq, T], v: [B, Hkv, T, d] -> [B, Hq, d]."""
    b, hq, t = probs.shape
    hkv = v.shape[1]
    return torch.matmul(probs.reshape(b, hkv, hq // hkv, t), v).reshape(b, hq, -1)


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis; ``mask`` [B, T] (True = a real token) drops padding. logits: [B, Hq, T]."""
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, :].to(logits.device), float("-inf"))
    return torch.softmax(logits, -1)


def monolithic_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """Reference attention of one new query over all tokens. q: [B, Hq, d], k, v: [B, Hkv, T, d],
    mask: [B, T] or None -> [B, Hq, d]."""
    return weighted_values(masked_softmax(attention_logits(q, k), mask), v)


@dataclass(frozen=True)
class TokenMap:
    """The token mapper's answer: which original positions live on which side.

    resident: [R] positions on the accelerator; offloaded: [S] positions in host
    memory; both ascending, disjoint, together 0..T-1. ``offloaded_first``: every
    offloaded position precedes every resident one, so the concatenator's token
    order is offloaded then resident, with no sort.
    """
    resident: torch.Tensor
    offloaded: torch.Tensor

    @property
    def offloaded_first(self) -> bool:
        return not len(self.resident) or not len(self.offloaded) or bool(self.offloaded[-1] < self.resident[0])


def map_tokens(n_tokens: int, n_resident: int) -> TokenMap:
    """The most recent ``n_resident`` tokens stay on the accelerator (eviction is oldest first)."""
    if not 0 <= n_resident:
        raise ValueError(f"n_resident={n_resident} is invalid: allowed >= 0")
    split = max(0, n_tokens - n_resident)
    return TokenMap(resident=torch.arange(split, n_tokens), offloaded=torch.arange(0, split))


def concatenate_in_order(resident_pos: torch.Tensor, resident: torch.Tensor,
                         offloaded_pos: torch.Tensor, offloaded: torch.Tensor,
                         offloaded_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token concatenator: merge two position-tagged sets along their last token axis in position order.

    resident_pos: [R] (or [B, R]), resident: [..., R, *]; offloaded_pos: [S] (or [B, S]), offloaded: [..., S, *]
    with the token axis at ``-1`` for logits ([B, Hq, T]) and ``-2`` for rows ([B, Hkv, T, d])
    (chosen by rank: 3 -> logits, 4 -> rows). ``offloaded_first``: the mapper's order (``TokenMap``) says
    every offloaded token precedes every resident one: a plain concatenation; else positions are sorted.
    Returns (positions [R+S] or [B, R+S], merged).
    """
    axis = -1 if resident.dim() == 3 else -2
    pos = torch.cat([offloaded_pos, resident_pos], -1)
    merged = torch.cat([offloaded, resident], dim=axis)
    if offloaded_first:
        return pos, merged
    if pos.dim() != 1:
        raise ValueError("per-sequence positions need offloaded_first (the mapper's order)")
    order = torch.argsort(pos, stable=True)
    return pos[order], merged.index_select(axis % resident.dim(), order.to(resident.device))


def hybrid_attention(q: torch.Tensor, resident_k: torch.Tensor, resident_v: torch.Tensor, resident_pos: torch.Tensor,
                     offloaded_logits: torch.Tensor, offloaded_v: torch.Tensor, offloaded_pos: torch.Tensor,
                     return_probs: bool = False, resident_mask: torch.Tensor | None = None,
                     offloaded_mask: torch.Tensor | None = None, offloaded_first: bool = False):
    """Accelerator side of HybridGen for one decode query per sequence.

    q: [B, Hq, d]; resident_k/v: [B, Hkv, R, d]; resident_pos: [R] or [B, R];
    offloaded_logits: [B, Hq, S] computed by the CPU for the *selected* offloaded
    tokens; offloaded_v: [B, Hkv, S, d] their V rows fetched from host tiers;
    offloaded_pos: [S] or [B, S]. Masks [B, R] / [B, S] (True = a real token) drop
    the padding of ragged batches. Returns [B, Hq, d]; with ``return_probs`` also
    (positions, probs [B, Hq, R+S]) for accumulating selectors.
    """
    res_logits = attention_logits(q, resident_k)
    dev = q.device
    pos, logits = concatenate_in_order(resident_pos, res_logits, offloaded_pos, offloaded_logits.to(dev),
                                       offloaded_first)
    _, v = concatenate_in_order(resident_pos, resident_v, offloaded_pos, offloaded_v.to(dev), offloaded_first)
    mask = None
    if resident_mask is not None or offloaded_mask is not None:
        if not offloaded_first:
            raise ValueError("masks (ragged batches) need offloaded_first (the mapper's order)")
        b = q.shape[0]
        rm = resident_mask if resident_mask is not None else torch.ones(b, resident_k.shape[2], dtype=torch.bool)
        om = offloaded_mask if offloaded_mask is not None else torch.ones(b, offloaded_v.shape[2], dtype=torch.bool)
        mask = torch.cat([om, rm], -1)
    probs = masked_softmax(logits, mask)
    out = weighted_values(probs, v)
    return (out, pos, probs) if return_probs else out


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """MoE-Lightning-style: the whole attention on the CPU. Same shapes as ``monolithic_attention``."""
    return monolithic_attention(q.cpu(), k.cpu(), v.cpu())
