"""One simulation per tier: build the node (GPU, host, tier), run the client and the worker, report per turn.

Definitions (issue #12):

* ``hit_rate``: prefix tokens loaded from the remote tier / prefix tokens requested beyond the GPU
  prefix cache (a request's *reusable* prefix is the previous turn's input, in full blocks, never
  the prompt's last token; beyond the GPU's hit it asks the remote tier). For ``gpu-prefix``, which
  has no remote tier, ``hit_rate`` is the GPU prefix cache's: hit tokens / reusable tokens (the
  paper's GPU-prefix-caching line). ``null`` when nothing was requested (turn 1; a turn whose
  reusable prefix the GPU held entirely).
* ``gpu_hit_rate`` (GPU hits / reusable) and ``reuse_rate`` (GPU hits + remote loads, / reusable)
  are reported beside it for every tier.
* ``recomputed_tokens``: reusable prefix tokens neither in the GPU nor loaded, computed again.
* ``read_gbps`` / ``write_gbps``: bytes the remote tier moved for the turn's requests over the
  turn's span (first arrival to last finish).
* ``skipped_inserts``: blocks offered to the remote tier and not stored (write buffer full, no
  staging room); they are offered again next turn.
* ``ttft``: arrival at the worker to the first token; ``e2e``: arrival to the last token (the mean
  over the turn's requests).
* A speedup is a ratio of makespans (the whole workload's completion time).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from host_runtime.replay.models import get_model

from .events import Env
from .gpu import StepModel, load_serving_gpu
from .gpucache import GpuPrefixCache
from .tiers import GpuPrefixTier, HyMCacheTier, Host, LMCacheLocal, RecomputeTier
from .worker import Worker, client
from .workload import conversations

ROW_FIELDS = ("tier", "turn", "hit_rate", "ttft_p50_ms", "ttft_p99_ms", "e2e_ms", "read_gbps", "write_gbps",
              "skipped_inserts", "recomputed_tokens")
EXTRA_FIELDS = ("gpu_hit_rate", "reuse_rate", "ttft_mean_ms", "turn_s", "requests", "reusable_tokens",
                "gpu_hit_tokens", "loaded_tokens", "computed_tokens", "timeouts")


def device_config(profile: str, dram_bytes: int, policy: str | None = None):
    """The emulator profile with data off and the DRAM budget. The prefetch window and flush batch keep their
    share of the (read staging, write buffer) areas when the DRAM differs from the profile's."""
    from emulator.config import load_profile

    base = load_profile(profile)
    changes: dict[str, Any] = {"emulation.data": False}
    if policy:
        changes["policy.name"] = policy
    cfg = base.with_overrides(changes)
    if dram_bytes != cfg.dram.size_bytes:
        page = cfg.device.page_size_bytes
        dram_bytes = dram_bytes // page * page
        share = cfg.policy.prefetch_window_bytes / (cfg.read_staging_frames * page)
        trial = cfg.with_overrides({"dram.size_bytes": dram_bytes, "policy.prefetch_window_bytes": page,
                                    "policy.flush_batch_bytes": page})  # only for the areas' sizes
        window = max(page, int(trial.read_staging_frames * share) * page)
        window = min(window, (trial.read_staging_frames - 1) * page)
        changes2 = {"dram.size_bytes": dram_bytes, "policy.prefetch_window_bytes": window}
        if trial.write_buffer_frames:
            changes2["policy.flush_batch_bytes"] = min(cfg.policy.flush_batch_bytes, trial.write_buffer_frames * page)
        cfg = cfg.with_overrides(changes2)
    return cfg


def make_tier(name: str, env: Env, host: Host, s: dict, block_bytes: int):
    if name == "recompute":
        return RecomputeTier(env, host, block_bytes)
    if name == "gpu-prefix":
        return GpuPrefixTier(env, host, block_bytes)
    if name == "lmcache-local":
        return LMCacheLocal(env, host, block_bytes, s["model.tokens_per_block"], s["tiers.dram"],
                            s["lmcache.chunk_tokens"])
    if name == "hymcache":
        cfg = device_config(s["hymcache.profile"], s["tiers.dram"], "hymcache")
        return HyMCacheTier(env, host, block_bytes, cfg, window_bytes=s["hymcache.window_bytes"],
                            timeout_s=s["tiers.load_timeout_s"])
    if name == "cmm-h":
        cfg = device_config(s["cmm-h.profile"], s["tiers.dram"], "lru")
        return HyMCacheTier(env, host, block_bytes, cfg, window_bytes=s["hymcache.window_bytes"],
                            timeout_s=s["tiers.load_timeout_s"], prefetch=False, name="cmm-h")
    raise ValueError(f"tier {name!r} is not built here")


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(p / 100 * len(v)))]


class TurnStats:
    def __init__(self, turn: int, start: float):
        self.turn, self.start, self.end = turn, start, start
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.reusable = self.gpu_hit = self.loaded = self.requested = 0
        self.read_bytes = self.write_bytes = self.skipped = self.timeouts = self.computed = 0

    def add(self, r) -> None:
        self.ttft.append(r.first_token - r.arrival)
        self.e2e.append(r.finish - r.arrival)
        self.end = max(self.end, r.finish)
        gpu_hit = min(r.gpu_hit, r.reusable_blocks)
        beyond = max(0, r.reusable_blocks - gpu_hit)
        self.reusable += r.reusable_blocks
        self.gpu_hit += gpu_hit
        self.requested += beyond
        self.loaded += min(r.loaded, beyond)
        self.read_bytes += r.read_bytes
        self.write_bytes += r.write_bytes
        self.skipped += r.skipped_inserts
        self.timeouts += r.timeouts
        self.computed += r.computed_tokens

    def row(self, tier: str, B: int) -> dict:
        span = (self.end - self.start) / 1e9
        if tier == "gpu-prefix":
            hit = self.gpu_hit / self.reusable if self.reusable else None
        else:
            hit = self.loaded / self.requested if self.requested else None
        return {
            "tier": tier, "turn": self.turn, "hit_rate": hit,
            "ttft_p50_ms": _pct(self.ttft, 50) / 1e6, "ttft_p99_ms": _pct(self.ttft, 99) / 1e6,
            "e2e_ms": sum(self.e2e) / len(self.e2e) / 1e6 if self.e2e else 0.0,
            "read_gbps": self.read_bytes / span / 1e9 if span > 0 else 0.0,
            "write_gbps": self.write_bytes / span / 1e9 if span > 0 else 0.0,
            "skipped_inserts": self.skipped,
            "recomputed_tokens": (self.reusable - self.gpu_hit - self.loaded) * B,
            "gpu_hit_rate": self.gpu_hit / self.reusable if self.reusable else None,
            "reuse_rate": (self.gpu_hit + self.loaded) / self.reusable if self.reusable else None,
            "ttft_mean_ms": sum(self.ttft) / len(self.ttft) / 1e6 if self.ttft else 0.0,
            "turn_s": span, "requests": len(self.ttft), "reusable_tokens": self.reusable * B,
            "gpu_hit_tokens": self.gpu_hit * B, "loaded_tokens": self.loaded * B,
            "computed_tokens": self.computed, "timeouts": self.timeouts,
        }


def simulate_tier(name: str, s: dict, turns=None, on_request: Callable[[], None] | None = None) -> dict:
    """Run tier ``name`` under settings ``s`` ({section.name: value}); its rows and summary."""
    wall0 = time.perf_counter()
    model = get_model(s["model.name"])
    B = s["model.tokens_per_block"]
    block_bytes = model.block_bytes(B)
    gpu = load_serving_gpu(s["gpu.profile"])
    steps = StepModel(model, gpu)
    if turns is None:
        turns = conversations(s["workload.conversations"], s["workload.turns"],
                              mean_prompt_tokens=s["workload.mean_prompt_tokens"],
                              mean_response_tokens=s["workload.mean_response_tokens"], seed=s["workload.seed"])
    env = Env()
    host = Host(env, gpu.pcie_gbps, gpu.pcie_latency_ns, s["tiers.staging"])
    tier = make_tier(name, env, host, s, block_bytes)
    capacity = steps.kv_blocks(s["gpu.gpu_memory_utilization"], s["gpu.activation_bytes"], block_bytes)
    cache = GpuPrefixCache(capacity, caching=tier.gpu_prefix_caching)
    worker = Worker(env, steps, cache, tier, tokens_per_block=B,
                    max_num_batched_tokens=s["gpu.max_num_batched_tokens"], max_num_seqs=s["gpu.max_num_seqs"])
    stats: list[TurnStats] = []

    def on_done(r):
        stats[r.turn - 1].add(r)
        if on_request is not None:
            on_request()

    env.process(worker.run())
    c = env.process(client(env, turns, worker, concurrency=s["workload.concurrency"], tokens_per_block=B,
                           max_tokens=s["workload.max_tokens"],
                           on_turn_start=lambda t, now: stats.append(TurnStats(t, now)), on_done=on_done))
    while not c.done.fired:
        env.run()
        if not c.done.fired:
            raise RuntimeError("the simulation stopped with requests outstanding (a process waits forever)")
    rows = [st.row(name, B) for st in stats]
    ttft = [x for st in stats for x in st.ttft]
    makespan = (stats[-1].end - stats[0].start) / 1e9 if stats else 0.0
    return {
        "tier": name, "rows": rows,
        "summary": {"tier": name, "makespan_s": makespan,
                    "ttft_mean_ms": sum(ttft) / len(ttft) / 1e6 if ttft else 0.0,
                    "ttft_p99_ms": _pct(ttft, 99) / 1e6,
                    "skipped_inserts": sum(st.skipped for st in stats),
                    "recomputed_tokens": sum(r["recomputed_tokens"] for r in rows),
                    "gpu_kv_blocks": capacity, "gpu_evictions": cache.evictions, "steps": worker.steps,
                    "gpu_busy_s": worker.busy_ns / 1e9, "load_s": worker.load_ns / 1e9,
                    "staging_peak_bytes": host.staging.peak, "staging_waits": host.staging.waits,
                    "events": env.resumes, "wall_s": time.perf_counter() - wall0},
        "details": tier.describe(),
    }


def simulate(s: dict, progress: bool = False) -> dict:
    """Every tier of ``s["tiers.run"]`` on the same workload; rows, summaries and speedups."""
    from tqdm import tqdm

    turns = conversations(s["workload.conversations"], s["workload.turns"],
                          mean_prompt_tokens=s["workload.mean_prompt_tokens"],
                          mean_response_tokens=s["workload.mean_response_tokens"], seed=s["workload.seed"])
    total = sum(len(t) for t in turns) * len(s["tiers.run"])
    wall0 = time.perf_counter()
    results = []
    with tqdm(total=total, unit="req", disable=not progress, mininterval=0.5, leave=False,
              desc="chm hymcache simulate") as bar:
        for name in s["tiers.run"]:
            bar.set_postfix_str(name)
            results.append(simulate_tier(name, s, turns, on_request=lambda: bar.update(1)))
    summaries = {r["tier"]: r["summary"] for r in results}
    speedups = {}
    if "hymcache" in summaries:
        h = summaries["hymcache"]["makespan_s"]
        for other, sm in summaries.items():
            if other != "hymcache" and h > 0:
                speedups[f"hymcache_vs_{other}"] = sm["makespan_s"] / h
    reusable = sum(t.input_tokens for t in turns[-2]) if len(turns) > 1 else 0
    model = get_model(s["model.name"])
    return {
        "settings": {k: v for k, v in s.items()},
        "rows": [row for r in results for row in r["rows"]],
        "summary": summaries, "speedups": speedups,
        "details": {r["tier"]: r["details"] for r in results},
        "workload": {"requests": sum(len(t) for t in turns),
                     "reusable_footprint_bytes": reusable * model.bytes_per_token,  # what the last turn reuses
                     "kv_footprint_bytes": sum(t.input_tokens for t in turns[-1]) * model.bytes_per_token},
        "wall_s": time.perf_counter() - wall0,
    }


def write_json(result: dict, path: str) -> None:
    """One row per tier x turn (ROW_FIELDS first), then the summary beside them."""
    rows = [{**{k: r[k] for k in ROW_FIELDS}, **{k: r[k] for k in EXTRA_FIELDS}} for r in result["rows"]]
    # wall-clock figures stay out: the file is a function of the settings alone
    summary = {t: {k: v for k, v in sm.items() if k != "wall_s"} for t, sm in result["summary"].items()}
    with open(path, "w") as f:
        json.dump({"rows": rows, "summary": summary, "speedups": result["speedups"],
                   "workload": result["workload"], "settings": result["settings"]}, f, indent=1, sort_keys=False)
        f.write("\n")
