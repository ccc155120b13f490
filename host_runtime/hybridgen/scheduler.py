"""Feedback scheduler: the paper's Algorithm 1.

One K for all layers (the selected tokens may differ per layer). After each
step, given the step's CPU, transfer and accelerator times:

* post-QKᵀ and T_cpu + T_tx <= T_gpu: K += step (capped at k_max) — accuracy for free;
* else if K > K_min: K -= step (never below K_min);
* else: switch to pre-QKᵀ selection (the CPU can no longer scan all offloaded K).

In pre-QKᵀ mode the CPU only touches K tokens, so the same rule keeps
adjusting K, bounded below by K_min; there is no switch back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POST, PRE = "post", "pre"


@dataclass
class Decision:
    k: int
    strategy: str
    branch: str  # "increase" | "decrease" | "switch" | "hold"


@dataclass
class FeedbackScheduler:
    k_min: int
    k_max: int
    k_step: int = 8
    k: int | None = None
    strategy: str = POST
    history: list = field(default_factory=list)

    def __post_init__(self):
        if self.k_min < 1:
            raise ValueError(f"k_min {self.k_min} must be >= 1")
        if self.k_max < self.k_min:
            raise ValueError(f"k_max {self.k_max} must be >= k_min {self.k_min}")
        if self.k_step < 1:
            raise ValueError(f"k_step {self.k_step} must be >= 1")
        if self.k is None:
            self.k = self.k_min

    def update(self, t_cpu: float, t_tx: float, t_gpu: float) -> Decision:
        """Apply Algorithm 1 to one step's times (any unit, all the same)."""
        if t_cpu + t_tx <= t_gpu:
            branch = "increase" if self.k < self.k_max else "hold"
            self.k = min(self.k + self.k_step, self.k_max)
        elif self.k > self.k_min:
            branch = "decrease"
            self.k = max(self.k - self.k_step, self.k_min)
        elif self.strategy == POST:
            branch = "switch"
            self.strategy = PRE
        else:
            branch = "hold"
        d = Decision(self.k, self.strategy, branch)
        self.history.append(d)
        return d
