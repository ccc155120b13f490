"""The decode engine: one model, one method, a batch of sequences, tiered KV, per-step statistics.

Every method runs in this one engine and differs only in where KV lives and
who computes what (``METHODS``):

* ``full`` — all KV on the accelerator, monolithic attention;
* ``hybridgen`` — logit parallelism: the CPU computes logits of offloaded
  tokens (one layer ahead), a selector picks K of them, the accelerator
  concatenates them with its own logits in token order and finishes the
  layer; the feedback scheduler adapts K and the strategy;
* ``flexgen`` — all KV offloaded, every row streamed to the accelerator;
* ``moe-lightning`` — all KV offloaded, attention computed on the CPU;
* ``h2o``, ``keyformer``, ``streamingllm``, ``infinigen`` — the hybrid
  pipeline with that selector at a fixed K.

A step decodes one token for each of B sequences of any lengths: the dense parts
(projections, MLP, LM head) run on [B, D] rows, attention on tensors padded to the
longest sequence with masks, and the CPU selects per sequence (selector state is
per sequence). The accelerator is a torch device of its own (CUDA when present);
the CPU side runs in a worker thread of its own, so layer-ahead logits really
overlap the accelerator's layer.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import perfmodel
from .attention import attention_logits, cpu_logits_rows, hybrid_attention, monolithic_attention
from .mapped_tier import MappedHostKV
from .names import HOST_DRAM_BYTES, METHODS, STRATEGY_MODES, TIMINGS, V_TIERS  # noqa: F401 -- re-exported
from .scheduler import POST, PRE, FeedbackScheduler
from .selectors import (AccumulatedScore, AllTokens, InfiniGenSpeculation, Keyformer, RecentWithSinks,
                        SelectionRequest, StreamingLLM, TokenSelector, TopKLogits)
from .tiers import EvictionEngine, HostKV, ResidentKV, open_cxl_tier, pad_stack

HYBRID_FAMILY = ("hybridgen", "h2o", "keyformer", "streamingllm", "infinigen")
ENGINE_MODEL = "smollm2-135m"  # the model this engine runs, by its name in models.toml


def timed(fn, *args, clock=time.perf_counter) -> float:
    """Seconds ``fn(*args)`` took on ``clock``."""
    t0 = clock()
    fn(*args)
    return clock() - t0


def timed_both(fn, *args, clock=time.perf_counter) -> tuple[float, float]:
    """(wall seconds, seconds on ``clock``) of ``fn(*args)``."""
    w0, c0 = time.perf_counter(), clock()
    fn(*args)
    return time.perf_counter() - w0, clock() - c0


def accelerator_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def transfer_clock(device: torch.device):
    """The transfer's clock. With a CPU "accelerator" a transfer is the CPU copying rows (and the in-process
    CXL tier serving reads) in the thread that asks: its thread CPU time, as for t_cpu, leaves out the waits
    for Python's lock and for CPUs other processes hold, which a DMA engine would not have. A real
    accelerator's copies are timed on the wall clock."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


@dataclass
class EngineOptions:
    method: str = "hybridgen"
    resident_budget: int = 64      # tokens per layer kept on the accelerator (hybrid family)
    k_min: int = field(default_factory=lambda: perfmodel.load_models()[ENGINE_MODEL].k_min)  # K_min: Algorithm 1's
    # floor, the fixed K of pinned strategies and of the baselines; default: SmolLM2's, profiled (models.toml)
    k_max: int = 512
    k_step: int = 16
    selection: bool = True         # False: every offloaded token is used (exact hybrid attention)
    strategy: str = "auto"         # hybridgen: "auto" (Algorithm 1 sets K and strategy) or "post"/"pre" at K = k_min
    layer_ahead: bool = True       # False: exact mode, the CPU uses the layer's true query
    exact_layers: int = 2          # first layers always exact: their inputs differ most (`chm hybridgen similarity`)
    mapping: str = "semantic"      # or "interleaved" (baseline)
    host_dram_bytes: float = HOST_DRAM_BYTES  # host DRAM for offloaded KV (semantic mapping); beyond: the CXL tier
    prefetch: bool = True          # stage layer i+1's CXL-resident V rows on the device while layer i runs
    capacity: int = 2048           # max context tokens per sequence (sizes host arrays and CXL regions)
    batch: int = 1                 # sequences decoded together
    timing: str = "measured"       # Algorithm 1's inputs: times measured here, or the platform model's
    platform: str = "A"
    sinks: int = 4
    window: int = 128              # StreamingLLM's recent window over the whole context
    cxl_policy: str = "hymcache"   # the in-process tier's policy (a served one has its server's)
    cxl_node: str | None = None    # a `chm serve` device node (name or path) as the CXL tier; None: in process
    v_tier: str = "read"           # CXL-resident V rows by explicit reads, or "mapped" (loads through a mapping
                                   # of the served device at cxl_node: mapped_tier)

    def validate(self) -> None:
        def need(ok, name, value, allowed):
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")
        need(self.method in METHODS, "method", self.method, METHODS)
        need(self.timing in TIMINGS, "timing", self.timing, TIMINGS)
        need(self.strategy in STRATEGY_MODES, "strategy", self.strategy, STRATEGY_MODES)
        need(self.resident_budget >= 0, "resident_budget", self.resident_budget, ">= 0")
        need(1 <= self.k_min <= self.k_max, "k_min", self.k_min, f"1..k_max ({self.k_max})")
        need(self.k_step >= 1, "k_step", self.k_step, ">= 1")
        need(self.capacity >= 1, "capacity", self.capacity, ">= 1")
        need(self.batch >= 1, "batch", self.batch, ">= 1")
        need(self.host_dram_bytes >= 0, "host_dram_bytes", self.host_dram_bytes, ">= 0")
        need(self.window >= 1, "window", self.window, ">= 1")
        need(self.sinks >= 0, "sinks", self.sinks, ">= 0")
        need(self.exact_layers >= 0, "exact_layers", self.exact_layers, ">= 0")
        need(self.v_tier in V_TIERS, "v_tier", self.v_tier, V_TIERS)
        need(self.cxl_node is None or (isinstance(self.cxl_node, str) and self.cxl_node), "cxl_node",
             self.cxl_node, "None or a device node name or path")
        try:
            perfmodel.platform_path(self.platform)
        except ValueError:
            need(False, "platform", self.platform, f"{perfmodel.list_platforms()} or a platform TOML path")


def make_selector(opts: EngineOptions) -> TokenSelector:
    """The method's token selector (hybridgen's depends on the scheduler's strategy: see ``Engine._selector``)."""
    if opts.method == "h2o":
        return AccumulatedScore()
    if opts.method == "keyformer":
        return Keyformer()
    if opts.method == "streamingllm":
        return StreamingLLM(opts.sinks, opts.window)
    if opts.method == "infinigen":
        return InfiniGenSpeculation()
    if opts.method == "hybridgen" and not opts.selection:
        return AllTokens()
    return TopKLogits()


@dataclass
class CpuResult:
    """The CPU side's answer for one layer and sequence: selected indices [k], their logits [Hq, k], positions [k]."""
    idx: torch.Tensor
    logits: torch.Tensor
    positions: torch.Tensor


@dataclass
class StepStats:
    """One decode step of the whole batch. Token counts are summed over its sequences."""
    step: int
    n_tokens: int
    resident: int
    offloaded: int
    k: int                 # K per sequence (the budget; a sequence with fewer offloaded tokens uses them all)
    strategy: str
    t_cpu: float           # seconds: CPU logits + selection (sum over layers; the job's thread CPU time)
    t_gpu: float           # seconds: accelerator work
    t_tx: float            # seconds: fetching selected rows from host tiers (``Engine.tx_clock``)
    batch: int = 1
    model_t_cpu: float = 0.0
    model_t_tx: float = 0.0
    model_t_gpu: float = 0.0
    cxl_ns: float = 0.0    # modelled time the CXL tier spent on this step's I/O
    cxl_reads: int = 0     # read requests to the CXL tier
    k_in_cxl: int = 0      # K rows (all layers) living in the CXL tier: host DRAM was full
    v_in_cxl: int = 0      # V rows (all layers) living in the CXL tier
    prefetch_busy: int = 0  # V prefetches the device refused (EBUSY): read on demand
    bytes: dict = field(default_factory=dict)
    branch: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Engine:
    def __init__(self, model, opts: EngineOptions, cxl=None):
        opts.validate()
        self.opts = opts
        self.cpu_model = model if model.device.type == "cpu" else model.copy_to("cpu")
        dev = accelerator_device()
        self.accel = model if model.device == dev else model.copy_to(dev)
        cfg = model.cfg
        self.cfg = cfg
        budget = {"full": None, "flexgen": 0, "moe-lightning": 0}.get(opts.method, opts.resident_budget)
        self.eviction = EvictionEngine(budget)
        resident_capacity = opts.capacity if budget is None else max(1, budget)
        self.resident = [ResidentKV(opts.batch, cfg.n_kv_heads, cfg.head_dim, resident_capacity, dev)
                         for _ in range(cfg.n_layers)]
        self._own_cxl = cxl is None and opts.method != "full"
        if self._own_cxl and opts.v_tier == "mapped" and opts.cxl_node is None:
            raise ValueError("cxl_node=None is invalid with v_tier='mapped': allowed the node of a `chm serve` "
                             "device (mapped V rows need a device out of this process)")
        self.cxl = open_cxl_tier(policy=opts.cxl_policy, node=opts.cxl_node) if self._own_cxl else cxl
        self.host = None
        if opts.method != "full":
            tier = MappedHostKV if opts.v_tier == "mapped" else HostKV
            try:
                self.host = tier(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, opts.capacity, self.cxl, opts.mapping,
                                 opts.host_dram_bytes, batch=opts.batch)
            except BaseException:
                self._close_cxl()
                raise
        self.selector = make_selector(opts)
        self.pre_selector = RecentWithSinks(opts.sinks)
        self.scheduler = FeedbackScheduler(opts.k_min, opts.k_max, opts.k_step)
        self.shape = perfmodel.load_models()[ENGINE_MODEL]
        self.platform = perfmodel.load_platform(opts.platform)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridgen-cpu")
        self.tx_clock = transfer_clock(dev)
        self.n_tokens = [0] * opts.batch
        self.steps: list[StepStats] = []

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        self.worker.shutdown(wait=True)
        if self.host is not None:
            self.host.close()  # before the tier: a mapping's tensors go before the device does
        self._close_cxl()

    def _close_cxl(self) -> None:
        if self._own_cxl and self.cxl is not None:
            self.cxl.close()
            self.cxl = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- prefill -----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prefilled: tuple | None = None) -> torch.Tensor:
        """One sequence (batch 1): full causal attention over the prompt, KV placed. ids: [T] -> logits [vocab].

        ``prefilled``: ``model.prefill(ids, last_logits_only=True)`` computed before (on the accelerator): the
        prompt pass is the same for every method, so an evaluation computes it once.
        """
        return self.prefill_batch([ids], [prefilled])[0]

    @torch.no_grad()
    def prefill_batch(self, prompts: list, prefilled: list | None = None) -> torch.Tensor:
        """B prompts of any lengths (ids [T_b] each) -> next-token logits [B, vocab]. The tokens beyond the
        resident budget go to host memory (oldest first), under the host-DRAM budget."""
        if len(prompts) != self.opts.batch:
            raise ValueError(f"prompts={len(prompts)} is invalid: allowed batch ({self.opts.batch})")
        out = []
        for b, ids in enumerate(prompts):
            ids = torch.as_tensor(ids)
            if not 1 <= len(ids) < self.opts.capacity:
                raise ValueError(f"prompt of {len(ids)} tokens is invalid: allowed 1..{self.opts.capacity - 1} "
                                 f"(capacity={self.opts.capacity})")
            logits, ks, vs, inputs = (prefilled or [None] * len(prompts))[b] or self.accel.prefill(
                ids, last_logits_only=True)
            pos = torch.arange(len(ids))
            budget = self.eviction.budget
            n_host = 0 if budget is None else max(0, len(ids) - budget)
            for layer in range(self.cfg.n_layers):
                if n_host:
                    self.host.append(layer, b, ks[layer][:, :n_host], vs[layer][:, :n_host])
                self.resident[layer].append(b, ks[layer][:, n_host:], vs[layer][:, n_host:], pos[n_host:])
                if isinstance(self.selector, InfiniGenSpeculation):
                    self.selector.prepare(layer, self.accel.query(layer, inputs[layer], pos).cpu(), ks[layer].cpu(), b)
            self.n_tokens[b] = len(ids)
            out.append(logits[-1])
        if self.host is not None:
            self.host.enforce_dram_budget()
        return torch.stack(out)

    # ---- CPU side -----------------------------------------------------------------------
    @property
    def scheduled(self) -> bool:
        """Does Algorithm 1 choose K and the strategy (hybridgen with selection and strategy "auto")?"""
        return self.opts.method == "hybridgen" and self.opts.selection and self.opts.strategy == "auto"

    def _k_and_strategy(self) -> tuple[int, str]:
        if self.scheduled:
            return self.scheduler.k, self.scheduler.strategy
        if self.opts.method == "hybridgen" and self.opts.selection:
            return self.opts.k_min, self.opts.strategy
        return self.opts.k_min, self.selector.stage

    def _selector(self, strategy: str) -> TokenSelector:
        if self.opts.method == "hybridgen" and self.opts.selection and strategy == PRE:
            return self.pre_selector
        return self.selector

    def _cpu_job(self, layer: int, q: torch.Tensor | None, x: torch.Tensor | None, pos: torch.Tensor,
                 k: int, strategy: str) -> tuple[list[CpuResult], float]:
        """Logits calculator + selector for one layer and every sequence, on the CPU: (results, CPU seconds).

        q: [B, Hq, d] true queries (exact mode) or None, then x: [B, D] are the previous
        layer's inputs and the queries are speculated with this layer's weights. pos: [B].
        """
        t0 = time.thread_time()  # the job's own CPU time: not the waits for Python's lock, which a native CPU
        if q is None:            # side would not have and which the accelerator's thread causes on this machine
            q = self.cpu_model.query(layer, x, pos).transpose(0, 1)  # [B, Hq, d]
        host, selector, out = self.host, self._selector(strategy), []
        for b in range(len(pos)):
            positions = host.positions(layer, b)
            req = SelectionRequest(layer=layer, k=k, positions=positions, n_tokens=self.n_tokens[b] + 1, query=q[b],
                                   keys=lambda b=b: host.keys(layer, b), seq=b)
            if selector.stage == POST:
                logits = cpu_logits_rows(q[b], host.key_rows(layer, b))  # [Hq, S], one pass over K
                req.logits = logits
                idx = selector.select(req)
                sel = logits[:, idx]
            elif self.opts.method == "infinigen":  # speculation only; the accelerator computes the logits
                idx = selector.select(req)
                sel = torch.empty(q.shape[1], 0)  # no logits leave the CPU
            else:
                idx = selector.select(req)
                sel = attention_logits(q[b][None], host.keys_at(layer, idx, b)[None])[0]
            out.append(CpuResult(idx, sel, positions[idx]))
        return out, time.thread_time() - t0

    # ---- one decode step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """One sequence (batch 1): feed one token; returns next-token logits [vocab]."""
        return self.step_batch([token])[0]

    @torch.no_grad()
    def step_batch(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token to each of the B sequences; returns next-token logits [B, vocab] and records a
        ``StepStats``."""
        opts, cfg = self.opts, self.cfg
        if len(tokens) != opts.batch:
            raise ValueError(f"tokens={len(tokens)} is invalid: allowed batch ({opts.batch})")
        longest = max(self.n_tokens) + 1
        if longest > opts.capacity:
            raise ValueError(f"context of {longest} tokens is invalid: allowed <= capacity ({opts.capacity})")
        host = self.host
        if host is not None:
            host.counters.reset()
            self.eviction.enforce(self.resident, host, incoming=1)
        pos = torch.tensor(self.n_tokens)
        k_budget, strategy = self._k_and_strategy()
        t_cpu = t_gpu = t_tx = 0.0
        x = self.accel.embed(torch.tensor(tokens))  # [B, D]
        pending = None
        hybrid = opts.method in HYBRID_FAMILY
        # layer-ahead is HybridGen's (and InfiniGen's speculation); other baselines select with the true query
        ahead = (opts.method == "hybridgen" and opts.layer_ahead) or opts.method == "infinigen"
        prefetch = hybrid and opts.prefetch
        if prefetch:
            t_tx += timed(host.prefetch_values, 0, clock=self.tx_clock)
        pcie = 0
        staging = None  # the worker's prefetch of the next layer's V (seconds, when done)
        for layer in range(cfg.n_layers):
            t0 = time.perf_counter()
            not_accel = 0.0  # seconds of this layer spent on the CPU side or on transfers
            launch = ahead and opts.exact_layers <= layer + 1 < cfg.n_layers
            if prefetch and layer + 1 < cfg.n_layers:  # the device stages layer+1's V while this layer runs:
                if launch:                             # the CPU side asks, before its logits job
                    next_staging = self.worker.submit(timed, host.prefetch_values, layer + 1, clock=self.tx_clock)
                else:
                    wall, dt = timed_both(host.prefetch_values, layer + 1, clock=self.tx_clock)
                    t_tx, not_accel = t_tx + dt, not_accel + wall
            if launch:  # start layer+1's logits from this layer's input
                nxt = self.worker.submit(self._cpu_job, layer + 1, None, x.cpu(), pos, k_budget, strategy)
            q, k, v = self.accel.qkv(layer, x, pos)  # q [Hq, B, d], k, v [Hkv, B, d]
            res_kv = self.resident[layer]
            res_kv.append_step(k.transpose(0, 1), v.transpose(0, 1), pos)
            rk, rv, rpos, rmask = res_kv.view()
            qb = q.transpose(0, 1)  # [B, Hq, d]
            if opts.method == "full":
                attn = monolithic_attention(qb, rk, rv, rmask)
            elif opts.method in ("flexgen", "moe-lightning"):
                ta, ca = time.perf_counter(), self.tx_clock()
                batch = range(opts.batch)
                hk, hmask = pad_stack([host.keys(layer, b) for b in batch], axis=1)
                hv, _ = pad_stack([host.values(layer, host.positions(layer, b), b) for b in batch], axis=1)
                mask = torch.cat([hmask, rmask], -1)
                if opts.method == "flexgen":  # every offloaded row streams to the accelerator
                    hk, hv = hk.to(x.device), hv.to(x.device)
                    t_tx, not_accel = t_tx + self.tx_clock() - ca, not_accel + time.perf_counter() - ta
                    pcie += (hk.numel() + hv.numel()) * 4
                    attn = monolithic_attention(qb, torch.cat([hk, rk], 2), torch.cat([hv, rv], 2), mask)
                else:  # attention where the rows are: the CPU
                    attn = monolithic_attention(qb.cpu(), torch.cat([hk, rk.cpu()], 2), torch.cat([hv, rv.cpu()], 2),
                                                mask).to(x.device)
                    dt = time.perf_counter() - ta
                    t_cpu, not_accel = t_cpu + dt, not_accel + dt
                    pcie += 2 * qb.numel() * 4
            else:
                tw = time.perf_counter()
                if staging is not None:
                    t_tx += staging.result()
                if ahead and layer >= max(1, opts.exact_layers):
                    results, seconds = pending.result()
                else:
                    results, seconds = self._cpu_job(layer, qb.cpu(), None, pos, k_budget, strategy)
                t_cpu += seconds
                ta, ca = time.perf_counter(), self.tx_clock()
                logits = [r.logits for r in results]
                if opts.method == "infinigen":  # speculation only chose tokens: fetch their K, use the true query
                    k_sel = [host.keys_at(layer, r.idx, b).to(x.device) for b, r in enumerate(results)]
                    logits = [attention_logits(qb[b:b + 1], ks[None])[0] for b, ks in enumerate(k_sel)]
                    pcie += sum(ks.numel() for ks in k_sel) * 4
                v_sel = [host.values(layer, r.idx, b) for b, r in enumerate(results)]
                if prefetch:
                    host.release_values(layer)
                t_tx += self.tx_clock() - ca
                not_accel += time.perf_counter() - tw
                pcie += sum(v.numel() + r.logits.numel() for v, r in zip(v_sel, results)) * 4
                off_logits, omask = pad_stack(logits, axis=1)
                off_v, _ = pad_stack(v_sel, axis=1)
                off_pos, _ = pad_stack([r.positions for r in results], axis=0)
                # offloaded tokens precede resident ones in every sequence (eviction is oldest first):
                # the mapper's order, so the concatenation is a plain one
                attn, _, probs = hybrid_attention(qb, rk, rv, rpos, off_logits, off_v, off_pos, return_probs=True,
                                                  resident_mask=rmask, offloaded_mask=omask, offloaded_first=True)
                if self.selector.observes:
                    for b, r in enumerate(results):
                        keep = torch.cat([omask[b], rmask[b]])
                        self.selector.observe(layer, torch.cat([r.positions, rpos[b][rmask[b]]]),
                                              probs[b][:, keep.to(probs.device)].cpu(), b)
            x = self.accel.finish(layer, x, attn.transpose(0, 1))
            t_gpu += time.perf_counter() - t0 - not_accel
            staging = next_staging if prefetch and launch else None
            if launch:
                pending = nxt
        self.n_tokens = [n + 1 for n in self.n_tokens]
        return self._record(x, k_budget, strategy, t_cpu, t_gpu, t_tx, pcie)

    def _record(self, x, k_budget, strategy, t_cpu, t_gpu, t_tx, pcie) -> torch.Tensor:
        opts, host = self.opts, self.host
        layers, batch = self.cfg.n_layers, opts.batch
        resident = sum(self.resident[0].count)
        offloaded = int(host.count[0].sum()) if host is not None else 0
        stats = StepStats(step=len(self.steps), n_tokens=sum(self.n_tokens), resident=resident, offloaded=offloaded,
                          k=k_budget if opts.method in HYBRID_FAMILY else offloaded, strategy=strategy,
                          t_cpu=t_cpu, t_gpu=t_gpu, t_tx=t_tx, batch=batch)
        if host is not None:
            counters = host.counters
            stats.bytes = dict(counters.bytes)
            stats.bytes["pcie_to_accel"] = pcie
            stats.cxl_ns, stats.cxl_reads = counters.cxl_ns, counters.cxl_reads
            stats.prefetch_busy = counters.prefetch_busy
            where = host.placement()
            stats.k_in_cxl = round(where.k_cxl * offloaded * layers)
            stats.v_in_cxl = round(where.v_cxl * offloaded * layers)
        if opts.method in HYBRID_FAMILY:
            split = perfmodel.Split(resident / batch, offloaded / batch)  # per sequence, on average
            # the rows as this engine placed them; a platform without a CXL tier holds them all in DRAM
            where = host.placement() if self.platform.has_cxl else perfmodel.Placement()
            mc, mt, mg = perfmodel.hybrid_times(self.shape, self.platform, batch, split, k_budget, strategy, where,
                                                stats.cxl_reads / layers)
            stats.model_t_cpu, stats.model_t_tx, stats.model_t_gpu = mc * layers, mt * layers, mg * layers
        if self.scheduled:
            times = ((stats.t_cpu, stats.t_tx, stats.t_gpu) if opts.timing == "measured"
                     else (stats.model_t_cpu, stats.model_t_tx, stats.model_t_gpu))
            scan_bytes = offloaded * host.row_bytes * layers  # what a post-QKᵀ step scans
            stats.branch = self.scheduler.update(*times, scan_bytes=scan_bytes).branch
        self.steps.append(stats)
        return self.accel.lm_head(x)

    # ---- drivers ---------------------------------------------------------------------------------
    def generate(self, ids: list[int], max_new_tokens: int, eos_id: int | None = None, progress=None,
                 prefilled: tuple | None = None) -> list[int]:
        """Greedy decoding of one sequence (batch 1). Returns the new token ids (stops after ``eos_id``)."""
        return self.generate_batch([ids], max_new_tokens, eos_id, progress, [prefilled])[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None = None,
                       progress=None, prefilled: list | None = None) -> list[list[int]]:
        """Greedy decoding of B sequences together. Returns each one's new token ids; a sequence that emitted
        ``eos_id`` stops there (the batch decodes on until every sequence has stopped or the limit is reached)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: allowed >= 0")
        logits = self.prefill_batch([torch.tensor(p) for p in prompts], prefilled)
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for n in range(max_new_tokens):
            nxt = [int(t) for t in torch.argmax(logits, -1)]
            for b, t in enumerate(nxt):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t == eos_id
            if progress is not None:
                progress.update(1)
            if all(done) or n + 1 == max_new_tokens:
                break
            logits = self.step_batch(nxt)
        return out

    def teacher_force(self, prefix: list[int], continuation: list[int], prefilled: tuple | None = None) -> torch.Tensor:
        """Prefill ``prefix``, then feed ``continuation`` one token at a time (batch 1).

        Returns next-token logits [len(continuation), vocab]: row i predicts continuation[i]
        (row 0 from the prefill, row i>0 after feeding continuation[i-1]).
        """
        rows = [self.prefill(torch.tensor(prefix), prefilled)]
        for tok in continuation[:-1]:
            rows.append(self.step(tok))
        return torch.stack(rows)
