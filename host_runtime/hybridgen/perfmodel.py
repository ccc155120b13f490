"""Modelled decode time on the paper's platforms (TOML profiles, every number tagged with its source).

Each method's decode step is built from three resources — the GPU (weights
plus attention over the tokens it holds), the CPU (logits, or whole attention,
over host-resident K/V) and the links (PCIe to the GPU; the CXL tier where the
platform has one) — and the dependencies between them, mechanism by mechanism:

* CPU logits: ``task overhead + max(FLOPs / CPU FLOP/s, bytes / CPU memory bandwidth)``;
  bytes are the K rows scanned plus the top-K's one read of the logits.
* Transfers: the PCIe leg and the CXL leg pipeline (chunks flow through both),
  so the slower one sets the time, plus the link latency once.
* KV placement (``placement``): semantic-aware keeps K in host DRAM while it
  fits and moves only the V bytes beyond host DRAM to CXL (then K, oldest
  first); interleaved spreads pages of both over DRAM and CXL. No CXL tier, no
  CXL bytes.
* HybridGen's layer-ahead pipeline (``layer_ahead_step``): the CPU job of layer
  j starts once layer j-1's input is known and the CPU is free, the selected
  rows cross the link after it (pre-QKᵀ: beside it, the selection being known
  up front), and the GPU's layer j starts when layer j-1 is done and the rows
  have arrived. Transfers of one layer thus overlap the CPU logits of the next.
* Algorithm 1 runs on the modelled per-layer times; the latency reported is the
  mean over its steady-state oscillation, not the state it happens to stop in.
* InfiniGen (``prefetch_step``): its speculation (partial query projection,
  partial QKᵀ, top-K, one launch each plus the copy of the indices to the host)
  is a serial GPU stage; a host gather of the chosen rows precedes PCIe, and
  the transfer overlaps the GPU's layer.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from .names import MAPPINGS, POST, PRE
from .scheduler import FeedbackScheduler

HERE = Path(__file__).parent
LOGIT_BYTES = 4                  # fp32 logits, CPU -> GPU
INFINIGEN_CHANNEL_FRACTION = 0.25  # partial key channels InfiniGen keeps on the GPU (its default skew ratio ~0.3)
INFINIGEN_LAUNCHES = 4           # InfiniGen's speculation: partial Q projection, partial QKᵀ, top-K, indices to host
STREAMINGLLM_SINKS = 4           # StreamingLLM paper: 4 attention sinks
STREAMINGLLM_WINDOW = 1024       # the HybridGen paper's StreamingLLM budget: 4 sinks + 1024 recent tokens
PAPER_SEQ_LEN = 2048             # the paper's main setting: 2K tokens (batch 1)
EXACT_LAYERS = 1                 # layer 0 has no previous input to speculate from
SETTLE_STEPS = 200               # Algorithm 1 steps before the latency is averaged ...
AVERAGED_STEPS = 64              # ... over this many steps of its steady state

# What the paper reports for HybridGen over each baseline (abstract and evaluation; "up to" for FlexGen and
# MoE-Lightning): printed beside the model's numbers, never used by the model.
PAPER_SPEEDUP = {"infinigen": 1.41, "keyformer": 1.86, "flexgen": 3.2, "moe-lightning": 3.2}


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
    k_min: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_row_bytes(self, element_bytes: int) -> int:
        """K (or V) bytes of one token in one layer."""
        return self.kv_heads * self.head_dim * element_bytes

    def layer_weight_bytes(self, element_bytes: int) -> int:
        attn = self.hidden * self.hidden * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return (attn + mlp) * element_bytes


@dataclass(frozen=True)
class Platform:
    name: str
    gpu_bw: float              # bytes/s
    gpu_flops: float           # flop/s for decode attention
    gpu_layer_overhead: float  # s per decode layer (its kernel launches)
    kernel_launch: float       # s per dependent launch + sync
    cpu_bw: float              # bytes/s
    cpu_flops: float           # flop/s of the logits kernel
    cpu_task_overhead: float   # s per layer's CPU job
    host_dram_bytes: float
    pcie_bw: float
    pcie_lat: float
    cxl_bw: float              # 0: no CXL tier
    cxl_lat: float
    cxl_request_overhead: float  # s per read request the CXL tier serves one after another
    cxl_bytes: float
    gpu_kv_fraction: float
    element_bytes: int
    cxl_stage_bw: float = 0.0  # bytes/s of an explicit prefetch staging a region (0: not modelled; latency only)
    # s per layer the CPU job loses while an in-process (emulated) CXL tier stages and serves V beside it on the
    # same CPUs; 0 for real hardware, where the device does that work
    cpu_cxl_interference: float = 0.0

    @property
    def has_cxl(self) -> bool:
        return self.cxl_bw > 0


def list_platforms() -> list[str]:
    return sorted(p.stem for p in (HERE / "platforms").glob("*.toml"))


def platform_path(name: str) -> Path:
    """A shipped platform's file, or ``name`` as a TOML path."""
    path = HERE / "platforms" / f"{name}.toml"
    if path.exists():
        return path
    if Path(name).is_file():
        return Path(name)
    raise ValueError(f"platform {name!r} must be one of {list_platforms()} or a TOML path")


def read_platform_table(name: str) -> dict:
    return tomllib.loads(platform_path(name).read_text())


def apply_overrides(table: dict, overrides: dict[str, float]) -> dict:
    """``{"cpu.attention_gflops": 150}`` -> a copy of ``table`` with that field replaced (it must exist)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if section not in out or not isinstance(out[section], dict) or field not in out[section]:
            fields = sorted(f"{s}.{f}" for s, v in out.items() if isinstance(v, dict) for f in v)
            raise ValueError(f"override {key!r} names no field of the platform: allowed {', '.join(fields)}")
        out[section][field] = value
    return out


def cpu_cores_x_clock(cpu: dict) -> float:
    return cpu["sockets"] * cpu["cores"] * cpu["base_clock_ghz"]


def cpu_memory_bandwidth(cpu: dict) -> float:
    """bytes/s: measured where the file gives it, else channels x transfer rate x 8 B x sockets (spec sheet)."""
    if "memory_bandwidth_gbps" in cpu:
        return cpu["memory_bandwidth_gbps"] * 1e9
    return cpu["memory_channels"] * cpu["memory_mts"] * 1e6 * 8 * cpu["sockets"]


def cpu_attention_flops(cpu: dict) -> float:
    """flop/s: the file's own figure, or another platform's scaled by sockets x cores x base clock."""
    if "attention_gflops" in cpu:
        return cpu["attention_gflops"] * 1e9
    ref = read_platform_table(cpu["attention_gflops_scaled_from"])["cpu"]
    return ref["attention_gflops"] * 1e9 * cpu_cores_x_clock(cpu) / cpu_cores_x_clock(ref)


def platform_from_table(t: dict) -> Platform:
    g, c, link, s = t["gpu"], t["cpu"], t["link"], t["scenario"]
    x = t.get("cxl", {})
    return Platform(
        name=t["name"],
        gpu_bw=g["memory_bandwidth_gbps"] * 1e9, gpu_flops=g["attention_tflops"] * 1e12,
        gpu_layer_overhead=g["layer_overhead_us"] * 1e-6, kernel_launch=g["kernel_launch_us"] * 1e-6,
        cpu_bw=cpu_memory_bandwidth(c), cpu_flops=cpu_attention_flops(c),
        cpu_task_overhead=c["task_overhead_us"] * 1e-6, host_dram_bytes=c["host_dram_gb"] * 1e9,
        pcie_bw=link["bandwidth_gbps"] * 1e9, pcie_lat=link["latency_us"] * 1e-6,
        cxl_bw=x.get("bandwidth_gbps", 0.0) * 1e9, cxl_lat=x.get("latency_us", 0.0) * 1e-6,
        cxl_request_overhead=x.get("request_overhead_us", 0.0) * 1e-6, cxl_bytes=x.get("capacity_gb", 0.0) * 1e9,
        gpu_kv_fraction=s["gpu_kv_fraction"], element_bytes=int(s["element_bytes"]),
        cxl_stage_bw=x.get("staging_bandwidth_gbps", 0.0) * 1e9,
        cpu_cxl_interference=c.get("cxl_interference_us", 0.0) * 1e-6,
    )


def load_platform(name: str, overrides: dict[str, float] | None = None) -> Platform:
    """A shipped platform (A, B, C) or a TOML path, with optional ``section.field`` overrides."""
    table = read_platform_table(name)
    return platform_from_table(apply_overrides(table, overrides or {}))


def load_models() -> dict[str, ModelShape]:
    t = tomllib.loads((HERE / "models.toml").read_text())
    default_k_min = t.pop("k_min")
    return {name: ModelShape(name=name, **{"k_min": default_k_min, **v}) for name, v in t.items()}


PAPER_MODELS = ["opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "llama-3.2-1b", "llama-3.2-3b",
                "llama-3.1-8b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b"]


# ---- where offloaded KV lives --------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """Tokens per place for one layer: resident on the GPU, offloaded to the host."""
    resident: int
    offloaded: int

    @classmethod
    def of(cls, seq_len: int, gpu_kv_fraction: float) -> "Split":
        r = int(seq_len * gpu_kv_fraction)
        return cls(r, seq_len - r)


@dataclass(frozen=True)
class Placement:
    """Shares of the offloaded K and V bytes that live in the CXL tier."""
    k_cxl: float = 0.0
    v_cxl: float = 0.0


def placement(m: ModelShape, p: Platform, batch: int, offloaded: int, mapping: str = "semantic") -> Placement:
    """Where the offloaded KV of all layers lives, given host DRAM and the CXL tier's capacity."""
    if mapping not in MAPPINGS:
        raise ValueError(f"mapping={mapping!r} is invalid: allowed {MAPPINGS}")
    if not p.has_cxl:
        return Placement()
    per_kind = batch * offloaded * m.layers * m.kv_row_bytes(p.element_bytes)  # all offloaded K (or V) bytes
    if 2 * per_kind > p.host_dram_bytes + p.cxl_bytes:
        raise ValueError(f"{2 * per_kind / 1e9:.0f} GB of offloaded KV exceed host DRAM plus CXL "
                         f"({(p.host_dram_bytes + p.cxl_bytes) / 1e9:.0f} GB) on {p.name}")
    if mapping == "interleaved":  # the OS interleaves pages 1:1 over the DRAM and CXL nodes
        return Placement(0.5, 0.5)
    beyond = max(0.0, 2 * per_kind - p.host_dram_bytes)  # bytes that do not fit host DRAM: V first, then K
    v_cxl = min(beyond, per_kind)
    return Placement(k_cxl=(beyond - v_cxl) / per_kind, v_cxl=v_cxl / per_kind)


# ---- resource times (seconds, one layer, one decode step) ---------------------------------------------
def gpu_time(m: ModelShape, p: Platform, batch: int, tokens: float, score_only_tokens: float = 0.0) -> float:
    """Weights pass plus attention over ``tokens`` (K and V) and logits over ``score_only_tokens`` (K only)."""
    row = m.kv_row_bytes(p.element_bytes)
    weights = m.layer_weight_bytes(p.element_bytes) / p.gpu_bw
    kv_bytes = batch * (2 * tokens + score_only_tokens) * row
    flops = batch * m.heads * m.head_dim * (4 * tokens + 2 * score_only_tokens)
    return p.gpu_layer_overhead + weights + max(kv_bytes / p.gpu_bw, flops / p.gpu_flops)


def host_read_time(p: Platform, dram_bytes: float, cxl_bytes: float) -> float:
    """The CPU reading host memory: DRAM at its bandwidth, CXL-resident bytes at the CXL tier's."""
    return dram_bytes / p.cpu_bw + (cxl_bytes / p.cxl_bw if cxl_bytes else 0.0)


def cpu_logits_time(m: ModelShape, p: Platform, batch: int, tokens: float, k_cxl: float = 0.0) -> float:
    """The CPU's logits over ``tokens`` offloaded K rows, then a top-K over them:
    task overhead + max(FLOPs / CPU FLOP/s, bytes / memory bandwidth)."""
    k_bytes = batch * tokens * m.kv_row_bytes(p.element_bytes)
    logits_bytes = batch * tokens * m.heads * LOGIT_BYTES  # the top-K reads every logit once
    mem = host_read_time(p, k_bytes * (1 - k_cxl), k_bytes * k_cxl) + logits_bytes / p.cpu_bw
    flops = batch * m.heads * m.head_dim * 2 * tokens
    return p.cpu_task_overhead + max(mem, flops / p.cpu_flops)


def cpu_attention_time(m: ModelShape, p: Platform, batch: int, tokens: float, where: Placement) -> float:
    """Whole attention over ``tokens`` offloaded rows on the CPU (MoE-Lightning): K and V read, 4 flops per channel."""
    kv = batch * tokens * m.kv_row_bytes(p.element_bytes)
    cxl = kv * (where.k_cxl + where.v_cxl)
    mem = host_read_time(p, 2 * kv - cxl, cxl)
    flops = batch * m.heads * m.head_dim * 4 * tokens
    return p.cpu_task_overhead + max(mem, flops / p.cpu_flops)


def transfer_time(p: Platform, pcie_bytes: float, cxl_bytes: float = 0.0, cxl_requests: float = 0.0,
                  staged_bytes: float = 0.0) -> float:
    """Host -> GPU. Rows in the CXL tier cross its link too; the legs pipeline, so the slower one sets the time.
    ``staged_bytes``: the region an explicit prefetch stages in the CXL tier first, charged at the platform's
    staging bandwidth where it gives one."""
    cxl = 0.0
    if cxl_bytes or staged_bytes:
        cxl = p.cxl_lat + cxl_requests * p.cxl_request_overhead + cxl_bytes / p.cxl_bw
        if p.cxl_stage_bw:
            cxl += staged_bytes / p.cxl_stage_bw
    return p.pcie_lat + max(pcie_bytes / p.pcie_bw, cxl)


def staged_v_bytes(m: ModelShape, p: Platform, batch: int, offloaded: float, where: Placement) -> float:
    """Bytes of one layer's V rows in the CXL tier: what the engine stages ahead of each layer."""
    return batch * offloaded * m.kv_row_bytes(p.element_bytes) * where.v_cxl


def hybrid_times(m: ModelShape, p: Platform, batch: int, split: Split, k: int, strategy: str,
                 where: Placement = Placement(), cxl_requests: float | None = None) -> tuple[float, float, float]:
    """(T_cpu, T_tx, T_gpu) of HybridGen for one layer: the inputs of Algorithm 1.

    ``cxl_requests``: read requests the CXL tier serves for the V rows (the engine counts them;
    None: one pipelined stream).
    """
    if strategy not in (POST, PRE):
        raise ValueError(f"strategy={strategy!r} is invalid: allowed {(POST, PRE)}")
    k = min(k, split.offloaded)
    scanned = split.offloaded if strategy == POST else k
    t_cpu = cpu_logits_time(m, p, batch, scanned, where.k_cxl) + (p.cpu_cxl_interference if where.v_cxl else 0.0)
    v_bytes = batch * k * m.kv_row_bytes(p.element_bytes)
    logits = batch * k * m.heads * LOGIT_BYTES
    t_tx = transfer_time(p, v_bytes + logits, v_bytes * where.v_cxl, cxl_requests or 0.0,
                         staged_v_bytes(m, p, batch, split.offloaded, where))
    t_gpu = gpu_time(m, p, batch, split.resident + k)
    return t_cpu, t_tx, t_gpu


# ---- pipelines -------------------------------------------------------------------------------------------
def layer_ahead_step(layers: int, t_cpu: float, t_tx: float, t_gpu: float, selection_first: bool = False,
                     t_after_cpu: float = 0.0, exact_layers: int = EXACT_LAYERS) -> float:
    """Seconds of one decode step through ``layers`` layers of HybridGen's pipeline (per-layer stage times).

    The CPU job of layer j needs layer j-1's input (layer-ahead; the first ``exact_layers`` need their own)
    and a free CPU; the transfer of its rows follows it, or with ``selection_first`` (pre-QKᵀ: the rows are
    known up front) runs beside it and ends no earlier than ``t_after_cpu`` (the logits) after it; the GPU's
    layer j needs layer j-1 done and layer j's rows arrived.
    """
    done = [0.0]  # done[j]: end of layer j-1 = when layer j's input is known (done[0]: the embedding)
    cpu_free = link_free = 0.0
    for j in range(layers):
        cpu_start = max(done[j] if j < exact_layers else done[j - 1], cpu_free)
        cpu_free = cpu_start + t_cpu
        if selection_first:
            link_free = max(max(cpu_start, link_free) + t_tx, cpu_free + t_after_cpu)
        else:
            link_free = max(cpu_free, link_free) + t_tx
        done.append(max(done[j], link_free) + t_gpu)
    return done[-1]


def prefetch_step(layers: int, t_select: float, t_gather: float, t_tx: float, t_gpu: float) -> float:
    """Seconds of one decode step of InfiniGen's pipeline: at the start of layer j the GPU speculates layer
    j+1's tokens (``t_select``, serial), the host gathers their rows (``t_gather``), PCIe moves them
    (``t_tx``) while the GPU computes layer j; layer j+1 starts when both are done."""
    done = rows_ready = 0.0
    cpu_free = link_free = 0.0
    for _ in range(layers):
        start = max(done, rows_ready)
        selected = start + t_select
        cpu_free = max(selected, cpu_free) + t_gather
        link_free = max(cpu_free, link_free) + t_tx
        rows_ready = link_free
        done = selected + t_gpu
    return done


# ---- methods ----------------------------------------------------------------------------------------------
def settle_scheduler(m: ModelShape, p: Platform, batch: int, split: Split, k_min: int, where: Placement,
                     steps: int = SETTLE_STEPS) -> FeedbackScheduler:
    """Algorithm 1 on modelled per-layer times, run until its transient is over (fixed length)."""
    k_min = min(k_min, split.offloaded)
    k_max = max(k_min, split.offloaded)
    sched = FeedbackScheduler(k_min=k_min, k_max=k_max, k_step=max(1, (k_max - k_min) // 32))
    scan_bytes = batch * split.offloaded * m.kv_row_bytes(p.element_bytes)
    for _ in range(steps):
        sched.update(*hybrid_times(m, p, batch, split, sched.k, sched.strategy, where), scan_bytes=scan_bytes)
    return sched


def hybrid_step(m: ModelShape, p: Platform, batch: int, split: Split, k: int, strategy: str,
                where: Placement) -> float:
    """One decode step of HybridGen at (K, strategy): the layer-ahead pipeline on its per-layer times."""
    t_cpu, t_tx, t_gpu = hybrid_times(m, p, batch, split, k, strategy, where)
    logits_tx = p.pcie_lat + batch * min(k, split.offloaded) * m.heads * LOGIT_BYTES / p.pcie_bw
    return layer_ahead_step(m.layers, t_cpu, t_tx, t_gpu, selection_first=strategy == PRE, t_after_cpu=logits_tx)


METHODS = ("flexgen", "moe-lightning", "h2o", "keyformer", "streamingllm", "infinigen", "hybridgen",
           "hybridgen-fixed")


@dataclass(frozen=True)
class StepModel:
    """One method's modelled decode step: seconds, and for HybridGen the scheduler's steady state."""
    seconds: float
    post_fraction: float | None = None
    k_range: tuple[int, int] | None = None


def method_step(method: str, m: ModelShape, p: Platform, seq_len: int, batch: int = 1, k_min: int | None = None,
                mapping: str = "semantic") -> StepModel:
    """Modelled decode step (all layers, plus the LM head's weight read) of ``method``.

    ``k_min``: K_min of HybridGen and the fixed K of the selective baselines (default: the model's).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: allowed {METHODS}")
    split = Split.of(seq_len, p.gpu_kv_fraction)
    k = max(1, min(k_min or m.k_min, split.offloaded))
    row = m.kv_row_bytes(p.element_bytes)
    where = placement(m, p, batch, split.offloaded, mapping)
    head = m.vocab * m.hidden * p.element_bytes / p.gpu_bw
    layers = m.layers

    def kv_transfer(rows: float) -> float:  # K and V rows of offloaded tokens to the GPU
        kv = batch * rows * row
        return transfer_time(p, 2 * kv, kv * (where.k_cxl + where.v_cxl))

    if method == "flexgen":  # all offloaded K and V stream to the GPU, the next layer's while this one computes
        return StepModel(layers * max(gpu_time(m, p, batch, seq_len), kv_transfer(split.offloaded)) + head)
    if method == "moe-lightning":  # attention of offloaded tokens on the CPU, beside the GPU's resident part
        t_cpu = cpu_attention_time(m, p, batch, split.offloaded, where)
        t = max(gpu_time(m, p, batch, split.resident), t_cpu + transfer_time(p, batch * m.hidden * LOGIT_BYTES))
        return StepModel(layers * t + head)
    if method in ("h2o", "keyformer"):  # scores need all K on the GPU; only kept V moves
        passes = 2 if method == "keyformer" else 1  # Keyformer's Gumbel pass reads the logits again
        t_gpu = gpu_time(m, p, batch, split.resident + k, passes * split.offloaded)
        k_bytes, v_bytes = batch * split.offloaded * row, batch * k * row
        t_tx = transfer_time(p, k_bytes + v_bytes, k_bytes * where.k_cxl + v_bytes * where.v_cxl)
        return StepModel(layers * max(t_gpu, t_tx) + head)
    if method == "streamingllm":  # sinks + window only; rows beyond the GPU's share stream in
        kept = min(seq_len, STREAMINGLLM_SINKS + STREAMINGLLM_WINDOW)
        return StepModel(layers * max(gpu_time(m, p, batch, kept), kv_transfer(max(0, kept - split.resident))) + head)
    if method == "infinigen":
        partial = INFINIGEN_CHANNEL_FRACTION
        q_proj = (2 * batch * m.hidden * partial * m.hidden, partial * m.hidden * m.hidden * p.element_bytes)
        qk = (2 * batch * m.heads * partial * m.head_dim * split.offloaded, partial * batch * split.offloaded * row)
        topk_bytes = batch * m.heads * split.offloaded * LOGIT_BYTES
        t_select = INFINIGEN_LAUNCHES * p.kernel_launch + sum(
            max(flops / p.gpu_flops, nbytes / p.gpu_bw) for flops, nbytes in (q_proj, qk)) + topk_bytes / p.gpu_bw
        gather_bytes = 2 * batch * k * row  # K and V rows of the chosen tokens, into a pinned buffer
        t_gather = p.cpu_task_overhead + host_read_time(
            p, gather_bytes * (1 - (where.k_cxl + where.v_cxl) / 2), gather_bytes * (where.k_cxl + where.v_cxl) / 2
        ) + gather_bytes / p.cpu_bw
        t_gpu = gpu_time(m, p, batch, split.resident + k)
        return StepModel(prefetch_step(layers, t_select, t_gather, transfer_time(p, gather_bytes), t_gpu) + head)
    if method == "hybridgen-fixed":  # post-QKᵀ at K_min without the scheduler: isolates the KV mapping
        return StepModel(hybrid_step(m, p, batch, split, k, POST, where) + head, 1.0, (k, k))
    sched = settle_scheduler(m, p, batch, split, k, where)
    scan_bytes = batch * split.offloaded * row
    steps, strategies, ks = [], [], []
    for _ in range(AVERAGED_STEPS):  # the mean over Algorithm 1's steady-state oscillation
        k_now, strategy = min(sched.k, split.offloaded), sched.strategy
        steps.append(hybrid_step(m, p, batch, split, k_now, strategy, where))
        strategies.append(strategy)
        ks.append(k_now)
        sched.update(*hybrid_times(m, p, batch, split, k_now, strategy, where), scan_bytes=scan_bytes)
    return StepModel(fmean(steps) + head, strategies.count(POST) / len(strategies), (min(ks), max(ks)))


def decode_latency(method, m, p, seq_len, batch=1, k_min=None, mapping="semantic") -> float:
    """Seconds per decode step (all layers, plus the LM head's weight read)."""
    return method_step(method, m, p, seq_len, batch, k_min, mapping).seconds


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def scheduler_trace(m: ModelShape, p: Platform, resident: int = 1024, start: int = 256, growth: int = 64,
                    steps: int = 120, k_min: int = 64, k_max: int = 2048, k_step: int = 32, batch: int = 1):
    """Algorithm 1 on a sequence whose offloaded part grows by ``growth`` tokens per step.

    Returns [(offloaded tokens, Decision)]: K rises while the CPU is hidden, falls to
    K_min once scanning every offloaded K outgrows the GPU's time, then selection
    switches to pre-QKᵀ.
    """
    sched = FeedbackScheduler(k_min=k_min, k_max=k_max, k_step=k_step)
    trace = []
    for step in range(steps):
        split = Split(resident=resident, offloaded=start + growth * step)
        times = hybrid_times(m, p, batch, split, sched.k, sched.strategy)
        scan_bytes = batch * split.offloaded * m.kv_row_bytes(p.element_bytes)
        trace.append((split.offloaded, sched.update(*times, scan_bytes=scan_bytes)))
    return trace


# ---- the report of ``chm hybridgen model-perf`` ---------------------------------------------------------
SEQ_SWEEP_MODELS = ("llama-3.1-8b", "qwen2.5-7b")   # the paper's sequence-length study
SEQ_SWEEP_LENGTHS = (2048, 4096, 8192, 16384, 32768)
BATCH_SWEEP_MODEL = "opt-13b"                      # the paper's batch study (Fig. 17)
BATCH_SWEEP_SIZES = (1, 2, 4, 8, 16)
# The mapping study (platform C): the paper's models whose KV outgrows C's 128 GB of DRAM within 32K x 16
# (MHA; the GQA models' KV stays under 64 GB there).
MAPPING_MODELS = ("opt-6.7b", "opt-13b")
MAPPING_SEQ_LEN = 32768
MAPPING_BATCHES = (4, 8, 12, 16)


def _over(latency: dict[str, float]) -> dict[str, float]:
    """HybridGen's speedup over each baseline, from latencies."""
    return {m: t / latency["hybridgen"] for m, t in latency.items() if not m.startswith("hybridgen")}


def model_perf_report(p: Platform, seq_len: int = 2048, batch: int = 1, k_min: int | None = None) -> dict:
    """Every table of ``model-perf`` as one dict (JSON-ready)."""
    models = load_models()

    def run(name, seq, b, mapping="semantic"):
        return {meth: method_step(meth, models[name], p, seq, b, k_min, mapping) for meth in METHODS}

    table = []
    for name in PAPER_MODELS:
        steps = run(name, seq_len, batch)
        hg = steps["hybridgen"]
        table.append({"model": name, "latency_ms": {m: s.seconds * 1e3 for m, s in steps.items()},
                      "speedup_vs_flexgen": {m: steps["flexgen"].seconds / s.seconds for m, s in steps.items()},
                      "hybridgen": {"post_fraction": hg.post_fraction, "k_range": list(hg.k_range)}})
    gmean = {m: geomean(r["speedup_vs_flexgen"][m] for r in table) for m in METHODS}
    over = {m: {"geomean": gmean["hybridgen"] / gmean[m],
                "max": max(r["latency_ms"][m] / r["latency_ms"]["hybridgen"] for r in table)}
            for m in METHODS if not m.startswith("hybridgen")}
    seq_sweep = [{"model": name, "rows": [
        {"seq_len": n, "hybridgen_over": _over({m: s.seconds for m, s in run(name, n, batch).items()})}
        for n in SEQ_SWEEP_LENGTHS]} for name in SEQ_SWEEP_MODELS]
    batch_sweep = {"model": BATCH_SWEEP_MODEL, "rows": [
        {"batch": b, "hybridgen_over": _over({m: s.seconds for m, s in run(BATCH_SWEEP_MODEL, seq_len, b).items()})}
        for b in BATCH_SWEEP_SIZES]}
    mapping = []
    if p.has_cxl:
        for name in MAPPING_MODELS:
            m = models[name]
            for b in MAPPING_BATCHES:
                row = {"model": name, "seq_len": MAPPING_SEQ_LEN, "batch": b}
                split = Split.of(MAPPING_SEQ_LEN, p.gpu_kv_fraction)
                try:
                    where = placement(m, p, b, split.offloaded)
                except ValueError:
                    mapping.append({**row, "fits": False})
                    continue
                kv_gb = 2 * b * split.offloaded * m.layers * m.kv_row_bytes(p.element_bytes) / 1e9
                row.update(fits=True, offloaded_kv_gb=kv_gb, k_cxl=where.k_cxl, v_cxl=where.v_cxl)
                for meth in ("hybridgen-fixed", "hybridgen"):
                    sem, inter = (decode_latency(meth, m, p, MAPPING_SEQ_LEN, b, k_min, mp)
                                  for mp in ("semantic", "interleaved"))
                    row[meth] = {"semantic_ms": sem * 1e3, "interleaved_ms": inter * 1e3, "semantic_speedup": inter / sem}
                mapping.append(row)
    return {"platform": p.name, "seq_len": seq_len, "batch": batch, "k_min": k_min, "models": table,
            "geomean_speedup_vs_flexgen": gmean, "hybridgen_over": over, "paper_speedup": PAPER_SPEEDUP,
            "seq_len_sweep": seq_sweep, "batch_sweep": batch_sweep, "mapping": mapping}
