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
  turn's span (first arrival to last finish; with the per-session client the turns' spans overlap).
  ``read_gbps_loading``: the turn's read bytes over the time at least one of its loads ran (the union
  of their spans): the tier's read rate while it is being read, not diluted by compute; the summary's
  is every read byte over the time at least one worker was loading (``loading_s``).
  ``read_gbps_peak``: the most bytes read in one window of ``report.peak_window_ms`` (windows aligned at
  time 0; a load's bytes spread evenly over its span), per second.
* ``skipped_inserts``: blocks offered to the remote tier and not stored (write buffer full, no
  staging room); they are offered again next turn.
* ``ttft``: arrival at the worker to the first token; ``e2e``: arrival to the last token (the mean
  over the turn's requests). ``ttft_deciles_ms``: the turn's TTFT at each of ``TTFT_QUANTILES`` (its
  distribution, as a latency CDF shows it).
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
from .tiers import (FsPath, GpuPrefixTier, HyMCacheTier, Host, LMCacheLocal, LMCacheRedis, MooncakeNvmeofTier,
                    MooncakePool, MooncakeTier, Nic, RecomputeTier, Redis, rdma)
from .worker import DecodeWorker, Worker, client, open_client, session_client
from .workload import aiperf_conversations, conversations, footprints, mooncake_requests, recorded_turns

ROW_FIELDS = ("tier", "turn", "hit_rate", "ttft_p50_ms", "ttft_p99_ms", "e2e_ms", "read_gbps", "write_gbps",
              "skipped_inserts", "recomputed_tokens")
EXTRA_FIELDS = ("read_gbps_loading", "read_gbps_peak", "gpu_hit_rate", "reuse_rate", "ttft_mean_ms", "turn_s",
                "requests", "reusable_tokens",
                "gpu_hit_tokens", "loaded_tokens", "computed_tokens", "timeouts", "base_tier", "staging_bytes",
                "ttft_deciles_ms")
TTFT_QUANTILES = (10, 20, 30, 40, 50, 60, 70, 80, 90)  # percentiles of a turn's TTFT (ttft_deciles_ms)
# tiers whose transfers go through the staging buffer
USES_STAGING = ("mooncake-dram", "mooncake-nvmeof", "hymcache", "hymcache-noprefetch", "cmm-h")


def device_config(profile: str, dram_bytes: int, policy: str | None = None, link_gbps: float | None = None):
    """The emulator profile with data off and the DRAM budget. The prefetch window and flush batch keep their
    share of the (read staging, write buffer) areas when the DRAM differs from the profile's."""
    from emulator.config import load_profile

    base = load_profile(profile)
    changes: dict[str, Any] = {"emulation.data": False}
    if link_gbps is not None:  # the storage node's aggregate link is the device's RDMA link
        changes["host_link.bandwidth_gbps"] = link_gbps / 8
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


def make_tiers(name: str, env: Env, hosts: list[Host], s: dict, block_bytes: int) -> list:
    """Tier ``name`` on every prefill node (``hosts``): one object per node over one shared backend."""
    B = s["model.tokens_per_block"]
    if name == "recompute":
        return [RecomputeTier(env, h, block_bytes) for h in hosts]
    if name == "gpu-prefix":
        return [GpuPrefixTier(env, h, block_bytes) for h in hosts]
    if name == "lmcache-local":  # per worker: its own DRAM
        return [LMCacheLocal(env, h, block_bytes, B, s["tiers.dram"], s["lmcache.chunk_tokens"]) for h in hosts]
    if name == "mooncake-dram":
        chunk_bytes = s["lmcache.chunk_tokens"] // B * block_bytes
        pool = MooncakePool(len(hosts), s["mooncake.capacity"], chunk_bytes, high_watermark=s["mooncake.high_watermark"],
                            eviction_ratio=s["mooncake.eviction_ratio"], lease_s=s["mooncake.lease_s"],
                            seed=s["workload.seed"])
        out: list = []
        for h in hosts:
            out.append(MooncakeTier(env, h, block_bytes, B, s["lmcache.chunk_tokens"], pool, hosts,
                                    timeout_s=s["tiers.load_timeout_s"], insert_timeout_s=s["mooncake.insert_timeout_s"],
                                    peer=out[0] if out else None))
        return out
    if name == "mooncake-nvmeof":  # per node: its own volume and file-system path; one storage node NIC
        chunk_bytes = s["lmcache.chunk_tokens"] // B * block_bytes
        storage_nic = Nic("storage", s["topology.storage_gbps"], s["topology.rdma_latency_ns"])
        out = []
        for h in hosts:
            volume = MooncakePool(1, s["nvmeof.capacity"] // len(hosts), chunk_bytes,
                                  high_watermark=s["mooncake.high_watermark"], eviction_ratio=s["mooncake.eviction_ratio"],
                                  lease_s=s["mooncake.lease_s"], seed=s["workload.seed"])
            fs = FsPath(f"xfs{h.index}", s["nvmeof.fs_gb_per_s"], s["nvmeof.fs_op_us"] * 1e3)
            out.append(MooncakeNvmeofTier(env, h, block_bytes, B, s["lmcache.chunk_tokens"], volume, fs, storage_nic,
                                          timeout_s=s["tiers.load_timeout_s"],
                                          insert_timeout_s=s["mooncake.insert_timeout_s"],
                                          peer=out[0] if out else None))
        return out
    if name in ("lmcache-redis", "lmcache-local+redis"):  # one Redis for the deployment; local DRAM per worker
        chunk_bytes = s["lmcache.chunk_tokens"] // B * block_bytes
        redis = Redis(env, s["redis.capacity"], chunk_bytes, policy=s["redis.policy"], gbps=s["redis.gbps"],
                      latency_ns=s["redis.latency_us"] * 1e3)
        local = name == "lmcache-local+redis"
        return [LMCacheRedis(env, h, block_bytes, B, s["lmcache.chunk_tokens"], redis,
                             timeout_s=s["tiers.load_timeout_s"], name=name,
                             local=LMCacheLocal(env, h, block_bytes, B, s["tiers.dram"], s["lmcache.chunk_tokens"])
                             if local else None)
                for h in hosts]
    if name in ("hymcache", "hymcache-noprefetch", "cmm-h"):
        # hymcache-noprefetch: HyMCache's device policy (DRAM split, write path) and Master, demand reads
        hym = name != "cmm-h"
        cfg = device_config(s["hymcache.profile" if hym else "cmm-h.profile"], s["tiers.dram"],
                            "hymcache" if hym else "lru", s["topology.storage_gbps"])
        out = []
        for h in hosts:
            out.append(HyMCacheTier(env, h, block_bytes, cfg, window_bytes=s["hymcache.window_bytes"],
                                    timeout_s=s["tiers.load_timeout_s"], prefetch=name == "hymcache", name=name,
                                    peer=out[0] if out else None))
        return out
    raise ValueError(f"tier {name!r} is not built here")


def make_tier(name: str, env: Env, host: Host, s: dict, block_bytes: int):
    """One node's tier (the single topology)."""
    return make_tiers(name, env, [host], s, block_bytes)[0]


def make_turns(s: dict):
    """The workload of settings ``s``: ``result[t - 1]`` = turn t of every conversation."""
    P = s["topology.prefill_workers"] if s["topology.kind"] == "pd" else 1
    if s["workload.kind"] == "turns":  # recorded turns (bench_vllm's workload): the file has every turn
        from .config import trace_path

        return recorded_turns(trace_path(s))
    if s["workload.kind"] == "mooncake":
        from .config import trace_path

        B = s["model.tokens_per_block"]
        return mooncake_requests(trace_path(s), tokens_per_block=B,
                                 block_bytes=get_model(s["model.name"]).block_bytes(B),
                                 limit=s["workload.trace_limit"] or None, time_scale=s["workload.time_scale"],
                                 window_s=s["workload.window_s"], prefill_workers=P)
    if s["workload.kind"] == "aiperf":
        return aiperf_conversations(s["workload.conversations"], s["workload.turns"],
                                    input_tokens=s["workload.input_tokens"],
                                    input_tokens_stddev=s["workload.input_tokens_stddev"],
                                    output_tokens=s["workload.max_tokens"], prefix_ratio=s["workload.prefix_ratio"],
                                    prefill_workers=P, seed=s["workload.seed"])
    turns = conversations(s["workload.conversations"], s["workload.turns"],
                          mean_prompt_tokens=s["workload.mean_prompt_tokens"],
                          mean_response_tokens=s["workload.mean_response_tokens"],
                          turn_tokens=s["workload.turn_tokens"], min_prompt_tokens=s["workload.min_prompt_tokens"],
                          seed=s["workload.seed"])
    if P > 1:
        import dataclasses
        turns = [[dataclasses.replace(t, worker=t.conversation % P) for t in batch] for batch in turns]
    return turns


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans`` (time during which at least one of them runs)."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(spans):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _peak(loads: list[tuple[float, float, int]], window_ns: float) -> float:
    """The most bytes in one window of ``window_ns`` (aligned at 0) per second (GB/s); ``loads``: (start, end,
    bytes), each load's bytes spread evenly over its span (all in its window if it took no time)."""
    bins: dict[int, float] = {}
    for a, b, n in loads:
        first, last = int(a // window_ns), int(b // window_ns)
        if b <= a or first == last:
            bins[first] = bins.get(first, 0.0) + n
            continue
        for k in range(first, last + 1):
            lo, hi = max(a, k * window_ns), min(b, (k + 1) * window_ns)
            if hi > lo:
                bins[k] = bins.get(k, 0.0) + n * (hi - lo) / (b - a)
    return max(bins.values()) / window_ns if bins else 0.0


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
        self.loads: list[tuple[float, float, int]] = []  # (start, end, bytes read) of each load

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
        if r.read_bytes:
            self.loads.append((r.load_start, r.load_end, r.read_bytes))
        self.write_bytes += r.write_bytes
        self.skipped += r.skipped_inserts
        self.timeouts += r.timeouts
        self.computed += r.computed_tokens

    def row(self, tier: str, B: int, peak_window_ns: float) -> dict:
        span = (self.end - self.start) / 1e9
        loading = _union([(a, b) for a, b, _ in self.loads])
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
            "read_gbps_loading": self.read_bytes / loading if loading > 0 else 0.0,
            "read_gbps_peak": _peak(self.loads, peak_window_ns),
            "skipped_inserts": self.skipped,
            "recomputed_tokens": (self.reusable - self.gpu_hit - self.loaded) * B,
            "gpu_hit_rate": self.gpu_hit / self.reusable if self.reusable else None,
            "reuse_rate": (self.gpu_hit + self.loaded) / self.reusable if self.reusable else None,
            "ttft_mean_ms": sum(self.ttft) / len(self.ttft) / 1e6 if self.ttft else 0.0,
            "ttft_deciles_ms": [_pct(self.ttft, q) / 1e6 for q in TTFT_QUANTILES],
            "turn_s": span, "requests": len(self.ttft), "reusable_tokens": self.reusable * B,
            "gpu_hit_tokens": self.gpu_hit * B, "loaded_tokens": self.loaded * B,
            "computed_tokens": self.computed, "timeouts": self.timeouts,
        }


def simulate_tier(name: str, s: dict, turns=None, on_request: Callable[[], None] | None = None,
                  label: str | None = None) -> dict:
    """Run tier ``name`` under settings ``s`` ({section.name: value}); its rows and summary.

    ``topology.kind = single``: one worker (prefill and decode) over the tier. ``pd``: ``prefill_workers``
    prefill workers (one GPU and one host each: PCIe, staging, a KV port and a P->D port), each with its
    node's view of the tier; one decode worker (``decode_tp`` GPUs) behind one aggregate link; the
    tier's storage (HyMCache's device) behind the storage node's link."""
    wall0 = time.perf_counter()
    label = label or name
    model = get_model(s["model.name"])
    B = s["model.tokens_per_block"]
    block_bytes = model.block_bytes(B)
    gpu = load_serving_gpu(s["gpu.profile"])
    steps = StepModel(model, gpu)
    if turns is None:
        turns = make_turns(s)
    env = Env()
    pd = s["topology.kind"] == "pd"
    P = s["topology.prefill_workers"] if pd else 1
    lat = s["topology.rdma_latency_ns"]
    hosts = [Host(env, gpu.pcie_gbps, gpu.pcie_latency_ns, s["tiers.staging"], index=i,
                  kv_nic=Nic(f"prefill{i}.kv", s["topology.kv_port_gbps"], lat) if pd else None,
                  pd_nic=Nic(f"prefill{i}.pd", s["topology.pd_port_gbps"], lat) if pd else None)
             for i in range(P)]
    tiers = make_tiers(name, env, hosts, s, block_bytes)
    capacity = steps.kv_blocks(s["gpu.gpu_memory_utilization"], s["gpu.activation_bytes"], block_bytes)
    caches = [GpuPrefixCache(capacity, caching=t.gpu_prefix_caching) for t in tiers]
    decode = None
    pd_bytes = [0]
    if pd:
        dsteps = StepModel(model, gpu, tp=s["topology.decode_tp"])
        dcap = dsteps.kv_blocks(s["gpu.gpu_memory_utilization"], s["gpu.activation_bytes"], block_bytes)
        decode_nic = Nic("decode", s["topology.decode_gbps"], lat)
        releases: dict[str, Callable[[], None]] = {}

        def pull(r):
            """The decode worker pulls the prompt's KV over the prefill node's P->D port and its own link."""
            nbytes = r.input * model.bytes_per_token
            pd_bytes[0] += nbytes
            yield rdma(hosts[r.worker % P].pd_nic, decode_nic, env.now, nbytes)
            releases.pop(r.rid)()  # the prefill worker frees the request's blocks

        decode = DecodeWorker(env, dsteps, dcap, tokens_per_block=B, max_num_seqs=s["gpu.max_num_seqs"], pull=pull)

        def handoff(r, release):
            releases[r.rid] = release
            decode.submit(r)
    workers = [Worker(env, steps, cache, tier, tokens_per_block=B,
                      max_num_batched_tokens=s["gpu.max_num_batched_tokens"], max_num_seqs=s["gpu.max_num_seqs"],
                      handoff=handoff if pd else None)
               for cache, tier in zip(caches, tiers)]
    stats: list[TurnStats] = []  # in the order the turns (a trace: its windows with arrivals) start
    by_turn: dict[int, TurnStats] = {}

    def on_turn_start(t: int, now: float) -> None:
        stats.append(TurnStats(t, now))
        by_turn[t] = stats[-1]

    def on_done(r):
        by_turn[r.turn].add(r)
        if on_request is not None:
            on_request()

    for w in workers:
        env.process(w.run())
    if decode is not None:
        env.process(decode.run())
    client_args = dict(concurrency=s["workload.concurrency"], tokens_per_block=B,
                       max_tokens=1 if pd else s["workload.max_tokens"],
                       decode_tokens=s["workload.max_tokens"] if pd else 0,
                       on_turn_start=on_turn_start, on_done=on_done)
    if s["workload.kind"] == "mooncake":  # a trace: open loop, at its timestamps
        c = env.process(open_client(env, turns, workers, window_ns=s["workload.window_s"] * 1e9,
                                    **{k: v for k, v in client_args.items() if k != "concurrency"}))
    elif s["workload.client"] == "per-session":
        c = env.process(session_client(env, turns, workers, turn_delay_ns=s["workload.turn_delay_ms"] * 1e6,
                                       **client_args))
    else:
        c = env.process(client(env, turns, workers, **client_args))
    while not c.done.fired:
        env.run()
        if not c.done.fired:
            raise RuntimeError("the simulation stopped with requests outstanding (a process waits forever)")
    peak_ns = s["report.peak_window_ms"] * 1e6
    rows = [st.row(label, B, peak_ns) for st in stats]
    for row in rows:
        row["base_tier"], row["staging_bytes"] = name, s["tiers.staging"]
    ttft = [x for st in stats for x in st.ttft]
    read_bytes = sum(st.read_bytes for st in stats)
    loading_ns = _union([span for w in workers for span in w.load_spans])
    makespan = (max(st.end for st in stats) - stats[0].start) / 1e9 if stats else 0.0
    summary = {"tier": label, "makespan_s": makespan,
               "ttft_mean_ms": sum(ttft) / len(ttft) / 1e6 if ttft else 0.0,
               "ttft_p99_ms": _pct(ttft, 99) / 1e6,
               "skipped_inserts": sum(st.skipped for st in stats),
               "recomputed_tokens": sum(r["recomputed_tokens"] for r in rows),
               "gpu_kv_blocks": capacity, "gpu_evictions": sum(c.evictions for c in caches),
               "steps": sum(w.steps for w in workers),
               "gpu_busy_s": sum(w.busy_ns for w in workers) / 1e9, "load_s": sum(w.load_ns for w in workers) / 1e9,
               "loading_s": loading_ns / 1e9,
               "read_gbps_loading": read_bytes / loading_ns if loading_ns > 0 else 0.0,
               "read_gbps_peak": _peak([ld for st in stats for ld in st.loads], peak_ns),
               "staging_peak_bytes": max(h.staging.peak for h in hosts),
               "staging_waits": sum(h.staging.waits for h in hosts),
               "staging_timeouts": sum(h.staging.timeouts for h in hosts),
               "events": env.resumes, "wall_s": time.perf_counter() - wall0}
    if decode is not None:
        summary.update({"decode_kv_blocks": decode.capacity, "decode_kv_peak_blocks": decode.peak_used,
                        "decode_steps": decode.steps, "decode_busy_s": decode.busy_ns / 1e9,
                        "pd_bytes": pd_bytes[0]})
    details = tiers[0].describe()
    if name == "lmcache-local" and len(tiers) > 1:  # per worker: sum the counts
        for t in tiers[1:]:
            d = t.describe()
            for k in ("capacity_chunks", "chunks", "evictions"):
                details[k] += d[k]
    return {"tier": label, "rows": rows, "summary": summary, "details": details}


def runs(s: dict) -> list[tuple[str, str, dict]]:
    """(label, tier, settings) of every run of ``s``: each tier once, or -- with a staging sweep -- each tier that
    uses the staging buffer once per size (labelled ``tier@SIZE``), the others once."""
    out = []
    for name in s["tiers.run"]:
        sizes = s.get("sweep.staging") or []
        if sizes and name in USES_STAGING:
            for size in sizes:
                out.append((f"{name}@{_gb(size)}", name, {**s, "tiers.staging": size}))
        else:
            out.append((name, name, s))
    return out


def _gb(n: int) -> str:
    if n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    if n % 10 ** 9 == 0:
        return f"{n // 10 ** 9}GB"
    return f"{n >> 20}MiB" if n % (1 << 20) == 0 else f"{n}B"


def simulate(s: dict, progress: bool = False) -> dict:
    """Every run of ``s`` (``runs``) on the same workload; rows, summaries and speedups."""
    from tqdm import tqdm

    turns = make_turns(s)
    plan = runs(s)
    total = sum(len(t) for t in turns) * len(plan)
    wall0 = time.perf_counter()
    results = []
    with tqdm(total=total, unit="req", disable=not progress, mininterval=0.5, leave=False,
              desc="chm hymcache simulate") as bar:
        for label, name, settings in plan:
            bar.set_postfix_str(label)
            results.append(simulate_tier(name, settings, turns, on_request=lambda: bar.update(1), label=label))
    summaries = {r["tier"]: r["summary"] for r in results}
    speedups = {}
    for base in [lab for lab in summaries if lab.split("@")[0] == "hymcache"]:
        h = summaries[base]["makespan_s"]
        at = base.partition("@")[2]
        for other, sm in summaries.items():
            # with a staging sweep: against the tiers without one and those at the same staging size
            if other != base and h > 0 and other.partition("@")[2] in ("", at):
                speedups[f"{base}_vs_{other}"] = sm["makespan_s"] / h
    staging = {label: settings["tiers.staging"] for label, _, settings in plan}
    for label, name, _ in plan:  # a sweep: each buffered tier at its largest staging size against its smaller ones
        if "@" not in label:
            continue
        top = max((lab for lab, nm, _ in plan if nm == name and "@" in lab), key=staging.get)
        if top != label and summaries[top]["makespan_s"] > 0:
            speedups[f"{top}_vs_{label}"] = summaries[label]["makespan_s"] / summaries[top]["makespan_s"]
    model = get_model(s["model.name"])
    return {
        "settings": {k: v for k, v in s.items()},
        "rows": [row for r in results for row in r["rows"]],
        "summary": summaries, "speedups": speedups,
        "details": {r["tier"]: r["details"] for r in results},
        "workload": {"requests": sum(len(t) for t in turns),
                     **footprints(turns, model.bytes_per_token, s["model.tokens_per_block"])},
        "wall_s": time.perf_counter() - wall0,
    }


def write_json(result: dict, path: str) -> None:
    """One row per tier x turn (ROW_FIELDS first), then the summary beside them."""
    rows = [{**{k: r[k] for k in ROW_FIELDS}, **{k: r[k] for k in EXTRA_FIELDS}} for r in result["rows"]]
    # wall-clock figures stay out: the file is a function of the settings alone
    summary = {t: {k: v for k, v in sm.items() if k != "wall_s"} for t, sm in result["summary"].items()}
    with open(path, "w") as f:
        json.dump({"rows": rows, "summary": summary, "speedups": result["speedups"],
                   "workload": result["workload"], "settings": result["settings"], "details": result["details"]},
                  f, indent=1, sort_keys=False)
        f.write("\n")
