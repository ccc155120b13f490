"""Modelled decode time on the paper's platforms (TOML profiles, every number sourced).

Per layer and decode step, each method's time is built from three resources —
the GPU (weights + attention over tokens it holds), the CPU (logits or full
attention over host-resident K/V), and the links (PCIe to the GPU, the CXL
tier's host link) — overlapped the way the method overlaps them. KV rows are
fp16 (2 bytes per element), as on the paper's systems.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .scheduler import POST, FeedbackScheduler

HERE = Path(__file__).parent
KV_BYTES = 2      # fp16 K/V elements on the modelled systems
WEIGHT_BYTES = 2  # fp16 weights
LOGIT_BYTES = 4   # fp32 logits sent CPU -> GPU
INFINIGEN_CHANNEL_FRACTION = 0.25  # partial key channels InfiniGen keeps on the GPU (its default skew ratio ~0.3)


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_row_bytes(self) -> int:
        """K (or V) bytes of one token in one layer."""
        return self.kv_heads * self.head_dim * KV_BYTES

    @property
    def layer_weight_bytes(self) -> int:
        attn = self.hidden * self.hidden * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return (attn + mlp) * WEIGHT_BYTES


@dataclass(frozen=True)
class Platform:
    name: str
    gpu_bw: float        # bytes/s
    gpu_flops: float     # flop/s for decode attention
    gpu_overhead: float  # s per layer
    cpu_bw: float        # bytes/s effective
    cpu_flops: float
    cpu_overhead: float
    pcie_bw: float
    pcie_lat: float
    cxl_bw: float
    cxl_lat: float
    gpu_kv_fraction: float
    v_dram_fraction: float


def list_platforms() -> list[str]:
    return sorted(p.stem for p in (HERE / "platforms").glob("*.toml"))


def load_platform(name: str) -> Platform:
    path = HERE / "platforms" / f"{name}.toml"
    if not path.exists():
        path = Path(name)
    if not path.exists():
        raise ValueError(f"platform {name!r} must be one of {list_platforms()} or a TOML path")
    t = tomllib.loads(path.read_text())
    g, c, link, x, s = t["gpu"], t["cpu"], t["link"], t["cxl"], t["scenario"]
    return Platform(
        name=t["name"],
        gpu_bw=g["memory_bandwidth_gbps"] * 1e9, gpu_flops=g["attention_tflops"] * 1e12,
        gpu_overhead=g["launch_overhead_us"] * 1e-6,
        cpu_bw=c["memory_bandwidth_gbps"] * 1e9 * c["bandwidth_efficiency"], cpu_flops=c["attention_gflops"] * 1e9,
        cpu_overhead=c["task_overhead_us"] * 1e-6,
        pcie_bw=link["bandwidth_gbps"] * 1e9, pcie_lat=link["latency_us"] * 1e-6,
        cxl_bw=x["bandwidth_gbps"] * 1e9, cxl_lat=x["latency_us"] * 1e-6,
        gpu_kv_fraction=s["gpu_kv_fraction"], v_dram_fraction=s["v_dram_fraction"],
    )


def load_models() -> dict[str, ModelShape]:
    t = tomllib.loads((HERE / "models.toml").read_text())
    return {name: ModelShape(name=name, **v) for name, v in t.items()}


PAPER_MODELS = ["opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "llama-3.2-1b", "llama-3.2-3b",
                "llama-3.1-8b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b"]


# ---- resource times (seconds, one layer, one decode step) ------------------------
def gpu_time(m: ModelShape, p: Platform, batch: int, tokens: float, score_only_tokens: float = 0.0) -> float:
    """Weights pass plus attention over ``tokens`` (K and V) and logits over ``score_only_tokens`` (K only)."""
    weights = m.layer_weight_bytes / p.gpu_bw
    kv_bytes = batch * (2 * tokens + score_only_tokens) * m.kv_row_bytes
    flops = batch * m.heads * m.head_dim * (4 * tokens + 2 * score_only_tokens)
    return p.gpu_overhead + weights + max(kv_bytes / p.gpu_bw, flops / p.gpu_flops)


def cpu_scan_time(m: ModelShape, p: Platform, batch: int, k_tokens: float, v_tokens: float = 0.0,
                  k_cxl_share: float = 0.0) -> float:
    """CPU reading ``k_tokens`` K rows (logits) and ``v_tokens`` V rows (full attention on the CPU).

    ``k_cxl_share`` of the K rows live in the CXL tier (interleaved mapping) and stream at its bandwidth.
    """
    k_bytes = batch * k_tokens * m.kv_row_bytes
    mem = k_bytes * (1 - k_cxl_share) / p.cpu_bw + k_bytes * k_cxl_share / p.cxl_bw
    mem += batch * v_tokens * m.kv_row_bytes / p.cpu_bw
    flops = batch * m.heads * m.head_dim * 2 * (k_tokens + v_tokens)
    return p.cpu_overhead + max(mem, flops / p.cpu_flops)


def transfer_time(p: Platform, pcie_bytes: float, cxl_bytes: float = 0.0) -> float:
    """Host -> GPU over PCIe; rows from the CXL tier cross its host link first."""
    t = p.pcie_lat + pcie_bytes / p.pcie_bw
    if cxl_bytes:
        t += p.cxl_lat + cxl_bytes / p.cxl_bw
    return t


@dataclass(frozen=True)
class Split:
    """Tokens per place for one layer: resident on the GPU, offloaded to the host."""
    resident: int
    offloaded: int

    @classmethod
    def of(cls, seq_len: int, gpu_kv_fraction: float) -> "Split":
        r = int(seq_len * gpu_kv_fraction)
        return cls(r, seq_len - r)


def hybrid_times(m: ModelShape, p: Platform, batch: int, split: Split, k: int, strategy: str,
                 mapping: str = "semantic") -> tuple[float, float, float]:
    """(T_cpu, T_tx, T_gpu) of HybridGen for one layer: the inputs of Algorithm 1."""
    k = min(k, split.offloaded)
    k_cxl_share = 0.5 if mapping == "interleaved" else 0.0
    scanned = split.offloaded if strategy == POST else k
    t_cpu = cpu_scan_time(m, p, batch, scanned, k_cxl_share=k_cxl_share)
    v_bytes = batch * k * m.kv_row_bytes
    v_cxl_share = 0.5 if mapping == "interleaved" else max(0.0, 1 - p.v_dram_fraction)
    logits = batch * k * m.heads * LOGIT_BYTES
    t_tx = transfer_time(p, v_bytes + logits, v_bytes * v_cxl_share)
    t_gpu = gpu_time(m, p, batch, split.resident + k)
    return t_cpu, t_tx, t_gpu


def settle_scheduler(m, p, batch, split, k_min, k_max, mapping="semantic", steps: int = 200) -> FeedbackScheduler:
    """Run Algorithm 1 on modelled times until it settles (decode steps at a fixed length)."""
    sched = FeedbackScheduler(k_min=k_min, k_max=k_max, k_step=max(1, (k_max - k_min) // 32))
    for _ in range(steps):
        sched.update(*hybrid_times(m, p, batch, split, sched.k, sched.strategy, mapping))
    return sched


METHODS = ("flexgen", "moe-lightning", "h2o", "keyformer", "infinigen", "hybridgen", "hybridgen-fixed")


def layer_time(method: str, m: ModelShape, p: Platform, seq_len: int, batch: int = 1,
               kv_ratio: float = 0.1, mapping: str = "semantic") -> float:
    """Modelled seconds of one layer's decode step for ``method``.

    ``kv_ratio``: retained share of the offloaded tokens for selective methods (K_min for HybridGen).
    """
    split = Split.of(seq_len, p.gpu_kv_fraction)
    k = max(1, int(kv_ratio * split.offloaded))
    kv_pcie = batch * m.kv_row_bytes
    if method == "flexgen":  # stream all offloaded K and V to the GPU; overlapped with compute
        return max(gpu_time(m, p, batch, seq_len), transfer_time(p, 2 * split.offloaded * kv_pcie))
    if method == "moe-lightning":  # attention of offloaded tokens on the CPU, next to K and V
        t_cpu = cpu_scan_time(m, p, batch, split.offloaded, split.offloaded)
        return max(gpu_time(m, p, batch, split.resident), t_cpu + transfer_time(p, batch * m.hidden * 4))
    if method in ("h2o", "keyformer"):  # scores need all K on the GPU; only kept V moves
        extra = 2 if method == "keyformer" else 1  # Keyformer's Gumbel pass reads the logits again
        t_gpu = gpu_time(m, p, batch, split.resident + k, extra * split.offloaded)
        return max(t_gpu, transfer_time(p, (split.offloaded + k) * kv_pcie))
    if method == "infinigen":  # speculate on partial K held by the GPU, prefetch selected K and V
        t_gpu = gpu_time(m, p, batch, split.resident + k, INFINIGEN_CHANNEL_FRACTION * split.offloaded)
        return max(t_gpu, transfer_time(p, 2 * k * kv_pcie))
    if method == "hybridgen-fixed":  # K held at K_min, post-QKᵀ: isolates the cost of the KV mapping
        t_cpu, t_tx, t_gpu = hybrid_times(m, p, batch, split, k, POST, mapping)
        return max(t_gpu, t_cpu + t_tx)
    if method == "hybridgen":
        sched = settle_scheduler(m, p, batch, split, k, max(k, split.offloaded // 2), mapping)
        t_cpu, t_tx, t_gpu = hybrid_times(m, p, batch, split, sched.k, sched.strategy, mapping)
        return max(t_gpu, t_cpu + t_tx)  # the CPU runs one layer ahead, overlapped with the GPU
    raise ValueError(f"method {method!r} must be one of {METHODS}")


def decode_latency(method, m, p, seq_len, batch=1, kv_ratio=0.1, mapping="semantic") -> float:
    """Seconds per decode step (all layers, plus the LM head's weight read)."""
    head = m.vocab * m.hidden * WEIGHT_BYTES / p.gpu_bw
    return m.layers * layer_time(method, m, p, seq_len, batch, kv_ratio, mapping) + head


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def scheduler_trace(m: ModelShape, p: Platform, resident: int = 1024, start: int = 256, growth: int = 64,
                    steps: int = 120, k_min: int = 64, k_max: int = 2048, k_step: int = 32, batch: int = 1):
    """Algorithm 1 on a sequence whose offloaded part grows by ``growth`` tokens per step.

    Returns [(offloaded tokens, Decision)] — K rises while the CPU is hidden,
    falls to K_min once scanning every offloaded K outgrows the GPU's time,
    then selection switches to pre-QKᵀ.
    """
    sched = FeedbackScheduler(k_min=k_min, k_max=k_max, k_step=k_step)
    trace = []
    for step in range(steps):
        split = Split(resident=resident, offloaded=start + growth * step)
        trace.append((split.offloaded, sched.update(*hybrid_times(m, p, batch, split, sched.k, sched.strategy))))
    return trace
