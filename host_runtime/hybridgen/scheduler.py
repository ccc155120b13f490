"""Feedback scheduler: the paper's Algorithm 1, as a controller that works on measured times.

One K for all layers (the selected tokens may differ per layer). After each
step the engine reports the step's CPU, transfer and accelerator times and the
offloaded K bytes a post-QKᵀ step has to scan. On smoothed times (an
exponential moving average, so one slow step does not steer it):

post-QKᵀ (the CPU scans every offloaded K, then keeps the top K):
* T_cpu + T_tx <= (1 - hysteresis)·T_gpu: K += step (capped at k_max) — accuracy for free;
* T_cpu + T_tx > T_gpu: K -= step, never below K_min; at K_min switch to pre-QKᵀ;
* in between: hold. The dead band keeps K from chattering on noise.

pre-QKᵀ (the CPU touches only the K chosen tokens): the same K rule, and a
switch back to post-QKᵀ once the CPU could scan every offloaded K again. That
cost is not measured while running pre-QKᵀ, so it is estimated from the scan
rate (bytes/s) of the last post-QKᵀ steps and the offloaded K bytes now:
T_cpu_post = bytes / rate; back to post when T_cpu_post + T_tx <= (1 - hysteresis)·T_gpu.
The dead band also separates the two switches: leaving post-QKᵀ needs T > T_gpu,
coming back needs T <= (1 - hysteresis)·T_gpu.

The first ``warmup_steps`` reports steer nothing: they include cold reads (first
touch of the CXL tier's pages and of host caches), which are not the steady cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .names import POST, PRE

STRATEGIES = (POST, PRE)
BRANCHES = ("warmup", "increase", "decrease", "hold", "switch-to-pre", "switch-to-post")


@dataclass
class Decision:
    k: int
    strategy: str
    branch: str  # one of BRANCHES


def _smooth(old: float | None, new: float, weight: float) -> float:
    return new if old is None else weight * new + (1 - weight) * old


@dataclass
class FeedbackScheduler:
    k_min: int
    k_max: int
    k_step: int = 8
    warmup_steps: int = 1     # reports ignored at the start (cold first step)
    smoothing: float = 0.5    # weight of the newest step in the moving averages; 1.0 = no smoothing
    hysteresis: float = 0.1   # dead band below T_gpu, as a fraction of it
    k: int | None = None
    strategy: str = POST
    history: list = field(default_factory=list)
    _times: tuple | None = field(default=None, repr=False)        # smoothed (t_cpu, t_tx, t_gpu)
    _scan_rate: float | None = field(default=None, repr=False)    # smoothed post-QKᵀ bytes/s

    def __post_init__(self):
        def need(ok, name, value, allowed):
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")
        need(self.k_min >= 1, "k_min", self.k_min, ">= 1")
        need(self.k_max >= self.k_min, "k_max", self.k_max, f">= k_min ({self.k_min})")
        need(self.k_step >= 1, "k_step", self.k_step, ">= 1")
        need(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0")
        need(0 < self.smoothing <= 1, "smoothing", self.smoothing, "(0, 1]")
        need(0 <= self.hysteresis < 1, "hysteresis", self.hysteresis, "[0, 1)")
        need(self.strategy in STRATEGIES, "strategy", self.strategy, STRATEGIES)
        if self.k is None:
            self.k = self.k_min

    def estimated_post_cpu(self, scan_bytes: float) -> float | None:
        """Seconds a post-QKᵀ step would spend scanning ``scan_bytes`` of K, at the learnt rate (None: not learnt)."""
        return None if not self._scan_rate else scan_bytes / self._scan_rate

    def update(self, t_cpu: float, t_tx: float, t_gpu: float, scan_bytes: float = 0.0) -> Decision:
        """Apply Algorithm 1 to one step's times (any unit, all the same).

        ``scan_bytes``: the offloaded K bytes a post-QKᵀ step scans (all of them);
        needed for the switch back from pre-QKᵀ. 0 disables that switch.
        """
        for name, value in (("t_cpu", t_cpu), ("t_tx", t_tx), ("t_gpu", t_gpu), ("scan_bytes", scan_bytes)):
            if not value >= 0:
                raise ValueError(f"{name}={value!r} is invalid: allowed >= 0")
        if len(self.history) < self.warmup_steps:
            return self._decide("warmup")
        new = (t_cpu, t_tx, t_gpu)
        self._times = new if self._times is None else tuple(
            _smooth(o, n, self.smoothing) for o, n in zip(self._times, new))
        if self.strategy == POST and scan_bytes > 0 and t_cpu > 0:
            self._scan_rate = _smooth(self._scan_rate, scan_bytes / t_cpu, self.smoothing)
        cpu, tx, gpu = self._times
        fits = cpu + tx <= (1 - self.hysteresis) * gpu
        over = cpu + tx > gpu
        if self.strategy == PRE:
            post_cpu = self.estimated_post_cpu(scan_bytes)
            if post_cpu is not None and scan_bytes > 0 and post_cpu + tx <= (1 - self.hysteresis) * gpu:
                return self._switch(POST, "switch-to-post")
        if fits and self.k < self.k_max:
            self.k = min(self.k + self.k_step, self.k_max)
            return self._decide("increase")
        if over and self.k > self.k_min:
            self.k = max(self.k - self.k_step, self.k_min)
            return self._decide("decrease")
        if over and self.strategy == POST:
            return self._switch(PRE, "switch-to-pre")
        return self._decide("hold")

    def _switch(self, strategy: str, branch: str) -> Decision:
        self.strategy = strategy
        self._times = None  # the other strategy's times are a different quantity: start averaging afresh
        return self._decide(branch)

    def _decide(self, branch: str) -> Decision:
        d = Decision(self.k, self.strategy, branch)
        self.history.append(d)
        return d
