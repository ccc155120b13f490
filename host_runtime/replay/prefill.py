"""Modelled GPU time to recompute (prefill) KV blocks the device did not serve.

A request whose stored prefix stops short (a refused write, a block the host
index forgot, a broken chain) must recompute those blocks' KV on the GPU
before it can go on; driver.py counts them (``recomputed_blocks``) and this
module turns them into seconds (``recompute_s``).

FLOPs. A forward pass costs, per token, ``2 N`` for the weight multiplies (N =
``KvModel.matmul_params``: attention projections and MLP, no embeddings, no
LM head -- recomputing KV samples nothing) plus ``4 L d`` per earlier position
the token attends to (QK^T and the attention-weighted V, 2 FLOPs per
multiply-add, d = heads x head_dim, L layers). That is the forward third of
PaLM's ``6 N + 12 L H Q T`` per token (Chowdhery et al., "PaLM", 2022,
Appendix B), with the causal mask counted exactly: token t (0-based) of a
context attends to t + 1 positions. A block at position p of a context of
T-token blocks holds tokens pT .. pT + T - 1, so it costs

    2 N T + 4 L d (T * pT + T (T + 1) / 2)

FLOPs -- later blocks cost more, as their tokens attend to a longer prefix
(the prefix's KV is there: read from the device or recomputed first).

Time = FLOPs / (peak FLOP/s x MFU x GPUs), from a GPU profile in TOML
(``gpus/a100-80gb.toml``, every number tagged with its source). Prefill is
compute-bound at these lengths (thousands of tokens per request), so the
weights' memory traffic is not modelled; FLOPs at a measured utilization are
a lower bound on the time, i.e. generous to recomputation.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .models import DEFAULT_TOKENS_PER_BLOCK, MODELS, KvModel, get_model

GPU_DIR = Path(__file__).with_name("gpus")
DEFAULT_GPU = "a100-80gb"
FALLBACK_MODEL = "llama-3.1-8b"  # a block size no model's 128-token block has: read as this model's tokens


@dataclass(frozen=True)
class GpuProfile:
    name: str
    peak_flops: float  # dense FLOP/s of one GPU at the model's precision
    mfu: float  # share of the peak prefill sustains
    count: int  # GPUs sharing the recomputation
    source: str  # the TOML it came from

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.mfu * self.count


def read_toml(path: Path) -> dict:
    """A TOML file's table; a file that is not TOML is a ValueError naming it (profiles, presets)."""
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text
        raise ValueError(f"{path}: not TOML: byte {exc.start} is not UTF-8 ({exc.reason})") from None


def gpu_names() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.toml"))


def load_gpu(name_or_path: str = DEFAULT_GPU) -> GpuProfile:
    """A GPU profile by name (``gpus/NAME.toml``) or TOML path; a bad field is a ValueError naming it."""
    path = Path(name_or_path)
    if not path.suffix == ".toml":
        path = GPU_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(f"gpu = {name_or_path!r} is neither a TOML file nor one of {', '.join(gpu_names())}")
    table = read_toml(path)

    def field(key, kind, ok, rule):
        if key not in table:
            raise ValueError(f"{path}: {key} is missing")
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
            raise ValueError(f"{path}: {key} = {value!r} must be {rule}")
        return value

    return GpuProfile(
        name=field("name", str, bool, "a non-empty string"),
        peak_flops=float(field("peak_flops", (int, float), lambda v: math.isfinite(v) and v > 0, "a number > 0")),
        mfu=float(field("mfu", (int, float), lambda v: 0 < v <= 1, "in (0, 1]")),
        count=field("count", int, lambda v: v >= 1, "an integer >= 1"),
        source=str(path))


@dataclass(frozen=True)
class PrefillModel:
    """Prefill FLOPs and time of KV blocks of ``tokens_per_block`` tokens of ``model`` on ``gpu``."""

    model: KvModel
    tokens_per_block: int
    gpu: GpuProfile

    def flops_terms(self) -> tuple[float, int]:
        """``(per_block, per_position)``: ``flops(b, s) = b * per_block + per_position * s``, the second term an
        exact integer (the native replay loop computes it so, too)."""
        m, t = self.model, self.tokens_per_block
        attn = 4 * m.layers * m.heads * m.head_dim
        return 2 * m.matmul_params * t + attn * t * (t + 1) / 2, attn * t * t

    def flops(self, blocks: int, position_sum: int) -> float:
        """FLOPs to prefill ``blocks`` blocks whose context positions (0-based) add up to ``position_sum``."""
        per_block, per_position = self.flops_terms()
        return blocks * per_block + per_position * position_sum

    def block_flops(self, position: int) -> float:
        return self.flops(1, position)

    def seconds(self, flops: float) -> float:
        return flops / self.gpu.flops_per_s

    def describe(self) -> dict:
        g = self.gpu
        return {"model": self.model.name, "tokens_per_block": self.tokens_per_block,
                "matmul_params": self.model.matmul_params, "gpu": g.name, "gpu_profile": g.source,
                "peak_flops": g.peak_flops, "mfu": g.mfu, "gpus": g.count, "flops_per_s": g.flops_per_s}


def prefill_for_block(block_bytes: int, model: str | KvModel | None = None,
                      gpu: str | GpuProfile = DEFAULT_GPU) -> PrefillModel:
    """The prefill model of a KV block of ``block_bytes``: of ``model`` if given (the block holds
    ``block_bytes // bytes per token`` of its tokens), else of the model whose 128-token block is that size
    (16 MiB: Llama-3.1-8B, 64 MiB: Llama-2-7B, 168 MiB: OPT-30B, ...), else of Llama-3.1-8B."""
    if model is None:
        same = [m for m in MODELS.values() if m.block_bytes(DEFAULT_TOKENS_PER_BLOCK) == block_bytes]
        model = same[0] if same else MODELS[FALLBACK_MODEL]
    elif isinstance(model, str):
        model = get_model(model)
    if isinstance(gpu, str):
        gpu = load_gpu(gpu)
    return PrefillModel(model, max(1, block_bytes // model.bytes_per_token), gpu)
