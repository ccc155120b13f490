"""The decode engine: one model, one method, tiered KV, per-step statistics.

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

The accelerator is a torch device of its own (CUDA when present); the CPU
side runs in a worker thread of its own, so layer-ahead logits really overlap
the accelerator's layer.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import perfmodel
from .names import METHODS, TIMINGS  # noqa: F401 -- re-exported: the engine's public names
from .attention import attention_logits, cpu_logits_rows, hybrid_attention, monolithic_attention
from .scheduler import POST, PRE, FeedbackScheduler
from .selectors import (AccumulatedScore, AllTokens, InfiniGenSpeculation, Keyformer, RecentWithSinks,
                        SelectionRequest, StreamingLLM, TokenSelector, TopKLogits)
from .tiers import EvictionEngine, HostKV, ResidentKV, open_cxl_tier

HYBRID_FAMILY = ("hybridgen", "h2o", "keyformer", "streamingllm", "infinigen")


def accelerator_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class EngineOptions:
    method: str = "hybridgen"
    resident_budget: int = 64      # tokens per layer kept on the accelerator (hybrid family)
    k_min: int = 32                # selected offloaded tokens: the floor of Algorithm 1 / fixed K of baselines
    k_max: int = 512
    k_step: int = 16
    selection: bool = True         # False: every offloaded token is used (exact hybrid attention)
    layer_ahead: bool = True       # False: exact mode, the CPU uses the layer's true query
    exact_layers: int = 2          # first layers always exact: their inputs differ most (`chm hybridgen similarity`)
    mapping: str = "semantic"      # or "interleaved" (baseline)
    v_dram_tokens: int = 128       # V rows per layer in host DRAM before the CXL tier (semantic mapping)
    capacity: int = 2048           # max context tokens (sizes host arrays and CXL regions)
    timing: str = "measured"       # Algorithm 1's inputs: wall times here, or the platform model
    platform: str = "A"
    sinks: int = 4
    window: int = 128              # StreamingLLM's recent window over the whole context
    cxl_policy: str = "hymcache"

    def validate(self) -> None:
        def need(ok, name, value, allowed):
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")
        need(self.method in METHODS, "method", self.method, METHODS)
        need(self.timing in TIMINGS, "timing", self.timing, TIMINGS)
        need(self.resident_budget >= 0, "resident_budget", self.resident_budget, ">= 0")
        need(1 <= self.k_min <= self.k_max, "k_min", self.k_min, f"1..k_max ({self.k_max})")
        need(self.k_step >= 1, "k_step", self.k_step, ">= 1")
        need(self.capacity >= 1, "capacity", self.capacity, ">= 1")
        need(self.window >= 1, "window", self.window, ">= 1")
        need(self.sinks >= 0, "sinks", self.sinks, ">= 0")
        need(self.exact_layers >= 0, "exact_layers", self.exact_layers, ">= 0")
        need(self.platform in perfmodel.list_platforms(), "platform", self.platform, perfmodel.list_platforms())


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
    """The CPU side's answer for one layer: selected indices [k], their logits [Hq, k], positions [k], seconds."""
    idx: torch.Tensor
    logits: torch.Tensor
    positions: torch.Tensor
    seconds: float


@dataclass
class StepStats:
    step: int
    n_tokens: int
    resident: int
    offloaded: int
    k: int
    strategy: str
    t_cpu: float           # seconds: CPU logits + selection (sum over layers)
    t_gpu: float           # seconds: accelerator work
    t_tx: float            # seconds: fetching selected rows from host tiers
    model_t_cpu: float = 0.0
    model_t_tx: float = 0.0
    model_t_gpu: float = 0.0
    cxl_ns: float = 0.0    # modelled time the CXL tier spent on this step's I/O
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
        self.resident = [ResidentKV(cfg.n_kv_heads, cfg.head_dim, dev) for _ in range(cfg.n_layers)]
        self._own_cxl = cxl is None and opts.method != "full"
        self.cxl = open_cxl_tier(policy=opts.cxl_policy) if self._own_cxl else cxl
        self.host = HostKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, opts.capacity, self.cxl, opts.mapping,
                           opts.v_dram_tokens) if opts.method != "full" else None
        self.selector = make_selector(opts)
        self.pre_selector = RecentWithSinks(opts.sinks)
        self.scheduler = FeedbackScheduler(opts.k_min, opts.k_max, opts.k_step)
        self.shape = perfmodel.load_models()["smollm2-135m"]
        self.platform = perfmodel.load_platform(opts.platform)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridgen-cpu")
        self.n_tokens = 0
        self.steps: list[StepStats] = []

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        self.worker.shutdown(wait=True)
        if self._own_cxl and self.cxl is not None:
            self.cxl.close()
            self.cxl = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- prefill -----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Full causal attention over the prompt, then KV placed by the eviction engine. ids: [T] -> logits [vocab]."""
        if len(ids) + 1 > self.opts.capacity:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit capacity={self.opts.capacity}")
        logits, ks, vs, inputs = self.accel.prefill(ids)
        pos = torch.arange(len(ids))
        for layer in range(self.cfg.n_layers):
            self.resident[layer].append(ks[layer], vs[layer], pos)
            if isinstance(self.selector, InfiniGenSpeculation):
                self.selector.prepare(layer, self.accel.query(layer, inputs[layer], pos).cpu(), ks[layer].cpu())
        self.n_tokens = len(ids)
        if self.host is not None:
            self.eviction.enforce(self.resident, self.host)
        return logits[-1]

    # ---- CPU side -----------------------------------------------------------------------
    def _k_and_strategy(self) -> tuple[int, str]:
        if self.opts.method == "hybridgen" and self.opts.selection:
            return self.scheduler.k, self.scheduler.strategy
        return self.opts.k_min, self.selector.stage

    def _selector(self, strategy: str) -> TokenSelector:
        if self.opts.method == "hybridgen" and self.opts.selection and strategy == PRE:
            return self.pre_selector
        return self.selector

    def _cpu_job(self, layer: int, q: torch.Tensor | None, x: torch.Tensor | None, pos: torch.Tensor,
                 k: int, strategy: str) -> CpuResult:
        """Logits calculator + selector for one layer, on the CPU.

        q: [Hq, d] true query (exact mode) or None, then x: [1, D] is the previous
        layer's input and the query is speculated with this layer's weights.
        """
        t0 = time.perf_counter()
        if q is None:
            q = self.cpu_model.query(layer, x, pos)[:, 0, :]
        host = self.host
        positions = host.positions(layer)
        selector = self._selector(strategy)
        req = SelectionRequest(layer=layer, k=k, positions=positions, n_tokens=self.n_tokens + 1, query=q,
                               keys=lambda: host.keys(layer))
        if selector.stage == POST:
            logits = cpu_logits_rows(q, host.key_rows(layer))  # [Hq, S], one pass over K in DRAM
            req.logits = logits
            idx = selector.select(req)
            sel = logits[:, idx]
        elif self.opts.method == "infinigen":  # speculation only; the accelerator computes the logits
            idx = selector.select(req)
            sel = torch.empty(q.shape[0], 0)  # no logits leave the CPU
        else:
            idx = selector.select(req)
            sel = attention_logits(q[None], host.keys_at(layer, idx)[None])[0]
        return CpuResult(idx, sel, positions[idx], time.perf_counter() - t0)

    # ---- one decode step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token; returns next-token logits [vocab] and records a ``StepStats``."""
        if self.n_tokens + 1 > self.opts.capacity:
            raise ValueError(f"context of {self.n_tokens + 1} tokens exceeds capacity={self.opts.capacity}")
        opts, cfg = self.opts, self.cfg
        if self.host is not None:
            self.host.counters.reset()
            self.eviction.enforce(self.resident, self.host, incoming=1)
        pos = torch.tensor([self.n_tokens])
        k_budget, strategy = self._k_and_strategy()
        t_cpu = t_gpu = t_tx = 0.0
        x = self.accel.embed(torch.tensor([token]))
        pending = None
        hybrid = opts.method in HYBRID_FAMILY
        # layer-ahead is HybridGen's (and InfiniGen's speculation); other baselines select with the true query
        ahead = (opts.method == "hybridgen" and opts.layer_ahead) or opts.method == "infinigen"
        pcie = 0
        for layer in range(cfg.n_layers):
            t0 = time.perf_counter()
            not_accel = 0.0  # seconds of this layer spent on the CPU side or on transfers
            launch = ahead and opts.exact_layers <= layer + 1 < cfg.n_layers
            if launch:  # start layer+1's logits from this layer's input
                nxt = self.worker.submit(self._cpu_job, layer + 1, None, x.cpu(), pos, k_budget, strategy)
            q, k, v = self.accel.qkv(layer, x, pos)
            self.resident[layer].append(k, v, pos)
            r = self.resident[layer]
            qb = q[:, 0, :][None]  # [1, Hq, d]
            if opts.method == "full":
                attn = monolithic_attention(qb, r.k[None], r.v[None])
            elif opts.method == "flexgen":
                ta = time.perf_counter()
                hk = self.host.keys(layer).to(x.device)
                hv = self.host.values(layer, self.host.positions(layer)).to(x.device)
                dt = time.perf_counter() - ta
                t_tx, not_accel = t_tx + dt, dt
                pcie += (hk.numel() + hv.numel()) * 4
                attn = monolithic_attention(qb, torch.cat([hk, r.k], 1)[None], torch.cat([hv, r.v], 1)[None])
            elif opts.method == "moe-lightning":
                tc = time.perf_counter()
                hk = torch.cat([self.host.keys(layer), r.k.cpu()], 1)
                hv = torch.cat([self.host.values(layer, self.host.positions(layer)), r.v.cpu()], 1)
                attn = monolithic_attention(qb.cpu(), hk[None], hv[None]).to(x.device)
                dt = time.perf_counter() - tc
                t_cpu, not_accel = t_cpu + dt, dt
                pcie += 2 * qb.numel() * 4
            else:
                tw = time.perf_counter()
                if ahead and layer >= max(1, opts.exact_layers):
                    res = pending.result()
                else:
                    res = self._cpu_job(layer, q[:, 0, :].cpu(), None, pos, k_budget, strategy)
                t_cpu += res.seconds
                ta = time.perf_counter()
                logits = res.logits
                if opts.method == "infinigen":  # speculation only chose tokens: fetch their K, use the true query
                    k_sel = self.host.keys_at(layer, res.idx).to(x.device)
                    logits = attention_logits(qb, k_sel[None])[0]
                    pcie += k_sel.numel() * 4
                v_sel = self.host.values(layer, res.idx)
                dt = time.perf_counter() - ta
                t_tx += dt
                not_accel = ta - tw + dt
                pcie += (v_sel.numel() + res.logits.numel()) * 4
                attn, probs_pos, probs = hybrid_attention(qb, r.k[None], r.v[None], r.pos, logits[None],
                                                          v_sel[None], res.positions, return_probs=True)
                self.selector.observe(layer, probs_pos, probs[0].cpu())
            x = self.accel.finish(layer, x, attn[0][:, None, :])
            t_gpu += time.perf_counter() - t0 - not_accel
            if launch:
                pending = nxt
        self.n_tokens += 1
        return self._record(x, k_budget, strategy, t_cpu, t_gpu, t_tx, pcie)

    def _record(self, x, k_budget, strategy, t_cpu, t_gpu, t_tx, pcie) -> torch.Tensor:
        opts = self.opts
        resident = len(self.resident[0])
        offloaded = self.host.count[0] if self.host is not None else 0
        stats = StepStats(step=len(self.steps), n_tokens=self.n_tokens, resident=resident, offloaded=offloaded,
                          k=k_budget if opts.method in HYBRID_FAMILY else offloaded, strategy=strategy,
                          t_cpu=t_cpu, t_gpu=t_gpu, t_tx=t_tx)
        if self.host is not None:
            counters = self.host.counters
            stats.bytes = dict(counters.bytes)
            stats.bytes["pcie_to_accel"] = pcie
            stats.cxl_ns = counters.cxl_ns
        if opts.method in HYBRID_FAMILY:
            split = perfmodel.Split(resident, offloaded)
            mc, mt, mg = perfmodel.hybrid_times(self.shape, self.platform, 1, split, k_budget, strategy, opts.mapping)
            layers = self.cfg.n_layers
            stats.model_t_cpu, stats.model_t_tx, stats.model_t_gpu = mc * layers, mt * layers, mg * layers
        if opts.method == "hybridgen" and opts.selection:
            times = ((stats.t_cpu, stats.t_tx, stats.t_gpu) if opts.timing == "measured"
                     else (stats.model_t_cpu, stats.model_t_tx, stats.model_t_gpu))
            stats.branch = self.scheduler.update(*times).branch
        self.steps.append(stats)
        return self.accel.lm_head(x)[0]

    # ---- drivers ---------------------------------------------------------------------------------
    def generate(self, ids: list[int], max_new_tokens: int, eos_id: int | None = None, progress=None) -> list[int]:
        """Greedy decoding. Returns the new token ids (stops after ``eos_id``)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens {max_new_tokens} must be >= 0")
        logits = self.prefill(torch.tensor(ids))
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            if progress is not None:
                progress.update(1)
            if nxt == eos_id or len(out) == max_new_tokens:
                break
            logits = self.step(nxt)
        return out

    def teacher_force(self, prefix: list[int], continuation: list[int]) -> torch.Tensor:
        """Prefill ``prefix``, then feed ``continuation`` one token at a time.

        Returns next-token logits [len(continuation), vocab]: row i predicts continuation[i]
        (row 0 from the prefill, row i>0 after feeding continuation[i-1]).
        """
        rows = [self.prefill(torch.tensor(prefix))]
        for tok in continuation[:-1]:
            rows.append(self.step(tok))
        return torch.stack(rows)
