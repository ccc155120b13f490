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

    Streams each K row exactly once: the compiled kernel (``kernel_build``)
    when it is available, else one GEMM against a block-diagonal query.
    """
    hq, d = q.shape
    kernel = _native_kernel()
    if kernel is not None and k_rows.dtype == torch.float32 and k_rows.device.type == "cpu":
        k_rows = k_rows.contiguous()
        qs = (q.to(torch.float32) / math.sqrt(d)).contiguous()
        out = torch.empty(k_rows.shape[0], hq)
        ffi = kernel.ffi
        kernel.lib.hg_logits_rows(ffi.cast("float *", k_rows.data_ptr()), k_rows.shape[0], k_rows.shape[1] // d, d,
                                  ffi.cast("float *", qs.data_ptr()), hq, ffi.cast("float *", out.data_ptr()))
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


def monolithic_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference attention of one new query over all tokens. q: [B, Hq, d], k, v: [B, Hkv, T, d] -> [B, Hq, d]."""
    return weighted_values(torch.softmax(attention_logits(q, k), -1), v)


@dataclass(frozen=True)
class TokenMap:
    """The token mapper's answer: which original positions live on which side.

    resident: [R] positions on the accelerator; offloaded: [S] positions in host
    memory; both ascending, disjoint, together 0..T-1.
    """
    resident: torch.Tensor
    offloaded: torch.Tensor


def map_tokens(n_tokens: int, n_resident: int) -> TokenMap:
    """The most recent ``n_resident`` tokens stay on the accelerator (eviction is oldest first)."""
    if not 0 <= n_resident:
        raise ValueError(f"n_resident {n_resident} must be >= 0")
    split = max(0, n_tokens - n_resident)
    return TokenMap(resident=torch.arange(split, n_tokens), offloaded=torch.arange(0, split))


def concatenate_in_order(resident_pos: torch.Tensor, resident: torch.Tensor,
                         offloaded_pos: torch.Tensor, offloaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token concatenator: merge two position-tagged sets along their last token axis in position order.

    resident_pos: [R], resident: [..., R, *]; offloaded_pos: [S], offloaded: [..., S, *]
    with the token axis at ``-1`` for logits ([B, Hq, T]) and ``-2`` for rows ([B, Hkv, T, d])
    (chosen by rank: 3 -> logits, 4 -> rows). Returns (positions [R+S], merged).
    """
    pos = torch.cat([offloaded_pos, resident_pos])
    order = torch.argsort(pos, stable=True)
    axis = -1 if resident.dim() == 3 else -2
    merged = torch.cat([offloaded, resident], dim=axis).index_select(axis % resident.dim(), order.to(resident.device))
    return pos[order], merged


def hybrid_attention(q: torch.Tensor, resident_k: torch.Tensor, resident_v: torch.Tensor, resident_pos: torch.Tensor,
                     offloaded_logits: torch.Tensor, offloaded_v: torch.Tensor, offloaded_pos: torch.Tensor,
                     return_probs: bool = False):
    """Accelerator side of HybridGen for one decode query.

    q: [B, Hq, d]; resident_k/v: [B, Hkv, R, d]; resident_pos: [R];
    offloaded_logits: [B, Hq, S] computed by the CPU for the *selected* offloaded
    tokens; offloaded_v: [B, Hkv, S, d] their V rows fetched from host tiers;
    offloaded_pos: [S]. Returns [B, Hq, d]; with ``return_probs`` also
    (positions [R+S], probs [B, Hq, R+S]) for accumulating selectors.
    """
    res_logits = attention_logits(q, resident_k)
    pos, logits = concatenate_in_order(resident_pos, res_logits, offloaded_pos, offloaded_logits.to(q.device))
    _, v = concatenate_in_order(resident_pos, resident_v, offloaded_pos, offloaded_v.to(q.device))
    probs = torch.softmax(logits, -1)
    out = weighted_values(probs, v)
    return (out, pos, probs) if return_probs else out


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """MoE-Lightning-style: the whole attention on the CPU. Same shapes as ``monolithic_attention``."""
    return monolithic_attention(q.cpu(), k.cpu(), v.cpu())
