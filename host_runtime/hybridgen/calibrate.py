"""A platform file describing this machine, measured, for checking the model against ``generate``.

The paper's platforms (A, B, C) are described by spec sheets; this machine is
measured instead. Every time here is a best case (the minimum over repeated calls,
or over repeated runs step by step): on a shared machine another process's work
lands in a wall-clock time only as an excess, which the minimum drops. With the file, the model's CPU and transfer times of a step
come within ±25 % of what the engine measures (``test_hybridgen_calibration``)
only if the model's mechanisms scale right: everything measured here is a rate
or a cost at (almost) zero tokens, and the check runs at a thousand.

* rates (micro-benchmarks): memory read bandwidth (a sum over a buffer far larger
  than the caches), the logits kernel's FLOP rate on rows that stay in cache, the
  accelerator's logits FLOP rate likewise, the copy bandwidth of a row gather
  from host DRAM, the CXL tier's bandwidth on a large read of written rows and
  the cost of staging a layer's V region on it (prefetch, wait, release: its
  "latency", paid once per transfer);
* fixed costs per layer, in the engine itself, on a short generation with a few
  offloaded tokens and K = 1: the CPU job (layer-ahead query, logits, top-K, the
  hand-off between threads, and on this machine the contention between the two
  threads), the transfer from host DRAM, the accelerator's layer less its weights.
"""

from __future__ import annotations

import math
import os
import time
from statistics import median

import numpy as np
import torch

from .attention import attention_logits, cpu_logits_rows
from .names import POST
from .selectors import SelectionRequest, TopKLogits

BANDWIDTH_BUFFER_BYTES = 256 << 20   # far beyond the last-level cache
GATHER_BUFFER_BYTES = 64 << 20       # rows gathered from host DRAM for the copy bandwidth
CACHED_TOKENS = 256                  # K rows that stay in L2 for the FLOP rates
CXL_BANDWIDTH_BYTES = 4 << 20        # one large read of written rows from the CXL tier
REPEATS = 31                         # micro-benchmarks: the fastest of this many calls
IN_SITU_PROMPT = 256                 # the short generation: prompt tokens ...
IN_SITU_RESIDENT = 2                 # ... of which this many stay on the accelerator
IN_SITU_K = 64                       # selected offloaded tokens per layer
IN_SITU_K_FEW = 16                   # ... and in a second V-in-CXL run: fewer read requests per layer
IN_SITU_STEPS = 17                   # decode steps; the first (cold) is dropped
IN_SITU_RUNS = 3                     # the generation is repeated; each step's time is its fastest run's
STAGING_SCALE = 4                    # the CXL tier's staging is timed for the in-situ V region and 4x it


def timed(fn, repeats: int = REPEATS, clock=time.perf_counter) -> float:
    """Fewest seconds of ``fn()`` on ``clock`` over ``repeats`` calls after one warm-up call (load only adds time)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def fastest_runs(runs: list[list], fields: tuple[str, ...]) -> list[dict[str, float]]:
    """Steps of repeated runs (the same steps, each run a list of ``StepStats``) -> per step, each field's
    minimum over the runs: a step's time with the least interference from other processes."""
    return [{f: min(getattr(s, f) for s in same) for f in fields} for same in zip(*runs)]


def read_bandwidth(device: torch.device) -> float:
    """bytes/s of a reduction over a buffer much larger than the caches."""
    buf = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run():
        buf.sum()
        sync()
    return BANDWIDTH_BUFFER_BYTES / timed(run, 7)


def gather_bandwidth(row_floats: int) -> float:
    """bytes/s (read + write) of ``index_select`` of every other row out of a large DRAM array."""
    rows = torch.randn(GATHER_BUFFER_BYTES // (4 * row_floats), row_floats)
    idx = torch.arange(0, rows.shape[0], 2)
    return 2 * idx.numel() * row_floats * 4 / timed(lambda: rows.index_select(0, idx), 7)


def logits_flops(fn, n_heads: int, head_dim: int) -> float:
    """flop/s of a logits function over ``CACHED_TOKENS`` cache-resident rows."""
    return 2 * n_heads * head_dim * CACHED_TOKENS / timed(fn)


def cxl_bandwidth(cxl) -> float:
    """bytes/s of one large read from the CXL tier, of rows just written to it."""
    data = np.random.default_rng(0).bytes(CXL_BANDWIDTH_BYTES)
    chunk = max(cxl.info()["page_size"], cxl.info().get("write_buffer_bytes", 0) // 4)
    for off in range(0, CXL_BANDWIDTH_BYTES, chunk):
        cxl.write(off, data[off:off + chunk])
    return CXL_BANDWIDTH_BYTES / timed(lambda: cxl.read(0, CXL_BANDWIDTH_BYTES), 7)


def cxl_staging_bandwidth(cxl, region_bytes: int, clock) -> float:
    """bytes/s that each further byte of a staged region costs: prefetch + wait + release of ``region_bytes`` and
    of STAGING_SCALE times it, timed on ``clock`` (the engine's transfer clock); 0 where the larger took no longer."""
    def staged(nbytes: int):
        def run():
            handle = cxl.prefetch(0, nbytes)
            cxl.wait(handle)
            cxl.release(handle)
        return run
    extra = timed(staged(STAGING_SCALE * region_bytes), clock=clock) - timed(staged(region_bytes), clock=clock)
    return (STAGING_SCALE - 1) * region_bytes / extra if extra > 0 else 0.0


def cxl_line(many: dict, few: dict, link_latency: float, row_bytes: int, cxl_bw: float,
             staging: float) -> tuple[float, float]:
    """(fixed seconds per layer, seconds per read request) of the CXL leg, from two in-situ runs with V in the
    CXL tier that select IN_SITU_K and IN_SITU_K_FEW rows: each run's leg is its transfer time less the link's
    latency, its rows' bytes at ``cxl_bw`` and ``staging`` (its V region's bytes at the staging bandwidth); the
    line through the two legs over their read requests. The fixed part is the rest of staging the layer's V
    region (prefetch, wait, release) and the software around the reads."""
    legs = [(run["cxl_reads"], run["t_tx"] - link_latency - k * row_bytes / cxl_bw - staging)
            for run, k in ((many, IN_SITU_K), (few, IN_SITU_K_FEW))]
    (reads_many, leg_many), (reads_few, leg_few) = legs
    per_request = max(0.0, (leg_many - leg_few) / (reads_many - reads_few)) if reads_many > reads_few else 0.0
    return max(0.0, leg_many - per_request * reads_many), per_request


def in_situ(model, host_dram_bytes: float, k: int = IN_SITU_K) -> dict[str, float]:
    """Per-layer medians over the steps of a short generation with K = ``k``, post-QKᵀ, each step's time
    the fastest of IN_SITU_RUNS runs: t_cpu, t_tx, t_gpu (seconds) and cxl_reads (read requests)."""
    from .engine import Engine, EngineOptions

    opts = EngineOptions(method="hybridgen", strategy=POST, k_min=k, k_max=k,
                         resident_budget=IN_SITU_RESIDENT, host_dram_bytes=host_dram_bytes,
                         capacity=IN_SITU_PROMPT + IN_SITU_STEPS + 2)
    runs, layers = [], model.cfg.n_layers
    for _ in range(IN_SITU_RUNS):
        with Engine(model, opts) as eng:
            eng.generate(list(range(100, 100 + IN_SITU_PROMPT)), IN_SITU_STEPS + 1)
            runs.append(eng.steps[1:])
    steps = fastest_runs(runs, ("t_cpu", "t_tx", "t_gpu", "cxl_reads"))
    return {f: median(s[f] for s in steps) / layers for f in ("t_cpu", "t_tx", "t_gpu", "cxl_reads")}


def measure(model) -> dict:
    """The platform table (the same shape as ``platforms/A.toml``) of this machine."""
    from .engine import accelerator_device, transfer_clock
    from .tiers import open_cxl_tier

    cfg = model.cfg
    accel = accelerator_device()
    row_bytes = cfg.n_kv_heads * cfg.head_dim * 4
    cpu_bw = read_bandwidth(torch.device("cpu"))
    gpu_bw = cpu_bw if accel.type == "cpu" else read_bandwidth(accel)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(cfg.n_heads, cfg.head_dim, generator=g), torch.randn(cfg.n_kv_heads, CACHED_TOKENS,
                                                                            cfg.head_dim, generator=g)
    rows = k.transpose(0, 1).reshape(CACHED_TOKENS, -1).contiguous()
    selector, positions = TopKLogits(), torch.arange(CACHED_TOKENS)

    def logits_and_top_k():  # the CPU job's per-token work
        logits = cpu_logits_rows(q, rows)
        selector.select(SelectionRequest(layer=0, k=IN_SITU_K, positions=positions, n_tokens=CACHED_TOKENS,
                                         logits=logits))
    cpu_flops = logits_flops(logits_and_top_k, cfg.n_heads, cfg.head_dim)
    qa, ka = q[None].to(accel), k[None].to(accel)
    gpu_flops = logits_flops(lambda: attention_logits(qa, ka), cfg.n_heads, cfg.head_dim)
    offloaded = IN_SITU_PROMPT - IN_SITU_RESIDENT  # about: the context grows by one token per step
    with open_cxl_tier() as dev:  # a layer's V region of the short generation, staged ahead (engine.prefetch)
        cxl_bw, cxl_capacity = cxl_bandwidth(dev), dev.info()["capacity_bytes"]
        stage_bw = cxl_staging_bandwidth(dev, offloaded * row_bytes, transfer_clock(accel))
    dram = in_situ(model, host_dram_bytes=math.inf)  # every row in host DRAM
    gather_bw = gather_bandwidth(row_bytes // 4)
    link_latency = max(0.0, dram["t_tx"] - IN_SITU_K * row_bytes / gather_bw)
    # HybridGen's own placement: every K row in host DRAM, every V row in the CXL tier (the budget holds the K rows
    # of the whole generation, and the semantic mapping spills V first), so the CXL reads are the V reads alone
    k_budget = (IN_SITU_PROMPT + IN_SITU_STEPS + 2) * cfg.n_layers * row_bytes
    staging = offloaded * row_bytes / stage_bw if stage_bw else 0.0
    v_in_cxl = in_situ(model, k_budget)
    cxl_fixed, cxl_request = cxl_line(v_in_cxl, in_situ(model, k_budget, IN_SITU_K_FEW), link_latency, row_bytes,
                                      cxl_bw, staging)
    # The CPU job runs slower while the in-process CXL tier stages and serves V beside it on the same CPUs
    # (its K scan is the same in both runs: K stays in host DRAM)
    cxl_interference = max(0.0, v_in_cxl["t_cpu"] - dram["t_cpu"])
    scan = max(offloaded * row_bytes / cpu_bw, 2 * cfg.n_heads * cfg.head_dim * offloaded / cpu_flops)
    weights = sum(t.numel() for name, t in model.w.items() if name.startswith("blk.0.")) * 4
    return {
        "name": f"this machine ({os.cpu_count()} CPUs, accelerator: torch {accel.type}), measured",
        "gpu": {"name": f"torch device {accel.type}", "memory_bandwidth_gbps": gpu_bw / 1e9,
                "attention_tflops": gpu_flops / 1e12,
                "layer_overhead_us": max(0.0, dram["t_gpu"] - weights / gpu_bw) * 1e6,
                "kernel_launch_us": 0.0},
        "cpu": {"name": "this machine's CPU", "memory_bandwidth_gbps": cpu_bw / 1e9,
                "attention_gflops": cpu_flops / 1e9, "task_overhead_us": max(0.0, dram["t_cpu"] - scan) * 1e6,
                "cxl_interference_us": cxl_interference * 1e6,
                "host_dram_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9},
        "link": {"name": "host DRAM -> accelerator tensors (a row gather)",
                 "bandwidth_gbps": gather_bw / 1e9,
                 "latency_us": link_latency * 1e6},
        "cxl": {"name": "emulated CXL-HM device (in process)", "capacity_gb": cxl_capacity / 1e9,
                "bandwidth_gbps": cxl_bw / 1e9, "latency_us": cxl_fixed * 1e6,
                "staging_bandwidth_gbps": stage_bw / 1e9, "request_overhead_us": cxl_request * 1e6},
        "scenario": {"gpu_kv_fraction": 0.1, "element_bytes": 4},
    }


def to_toml(table: dict) -> str:
    """The table as TOML, tagged: every number is measured here, except the two scenario fields."""
    lines = [f'# {table["name"]}: written by `chm hybridgen calibrate`. Every number [measured] on this machine',
             "# (see host_runtime/hybridgen/calibrate.py), except [scenario]: gpu_kv_fraction is unused by the",
             "# engine's steps (they carry their own split) and element_bytes is the engine's fp32 rows.",
             f'name = "{table["name"]}"']
    for section in ("gpu", "cpu", "link", "cxl", "scenario"):
        lines.append(f"\n[{section}]")
        for key, value in table[section].items():
            lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value:.6g}")
    return "\n".join(lines) + "\n"
