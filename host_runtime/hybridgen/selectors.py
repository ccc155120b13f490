"""Token selectors: which offloaded tokens take part in a layer's attention.

One interface, ``select(request) -> indices``; indices point into the layer's
offloaded set (ascending, int64). ``stage`` says when a selector runs:

* ``post`` (post-QKᵀ): after the CPU computed logits of *all* offloaded tokens
  (top-K by score; H2O and Keyformer accumulate scores over steps);
* ``pre`` (pre-QKᵀ): before any logit, from positions (sinks + recent window)
  or from a cheap speculation (InfiniGen: partial query/key channels); the CPU
  then computes logits only for the chosen tokens.

Accumulating selectors learn from ``observe(layer, positions, probs, seq)``, called
with the attention probabilities the accelerator actually used. State is kept per
sequence of a batch (``seq``), so a batch selects exactly as its sequences alone would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import attention_logits
from .perfmodel import INFINIGEN_CHANNEL_FRACTION


@dataclass
class SelectionRequest:
    """Everything a selector may look at for one layer of one decode step.

    layer; k: how many offloaded tokens to keep; positions: [S] original
    positions of the offloaded tokens; n_tokens: tokens in the whole context;
    logits: [Hq, S] CPU logits (post stage only, else None); query: [Hq, d]
    (exact or layer-ahead) query; keys: callable returning offloaded K [Hkv, S, d];
    seq: the sequence of the batch.
    """
    layer: int
    k: int
    positions: torch.Tensor
    n_tokens: int
    logits: torch.Tensor | None = None
    query: torch.Tensor | None = None
    keys: object = None
    seq: int = 0


def _topk_sorted(score: torch.Tensor, k: int) -> torch.Tensor:
    """score: [S] -> ascending indices of the k largest (all when k >= S)."""
    if k >= score.numel():
        return torch.arange(score.numel())
    return torch.sort(torch.topk(score, k).indices).values


def head_aggregated_score(logits: torch.Tensor) -> torch.Tensor:
    """logits: [Hq, S] -> [S]: per-head softmax over the offloaded set, summed over heads."""
    return torch.softmax(logits, -1).sum(0)


class TokenSelector:
    name = "base"
    stage = "post"
    observes = False  # does it learn from the probabilities the accelerator used (``observe``)?

    def select(self, req: SelectionRequest) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, layer: int, positions: torch.Tensor, probs: torch.Tensor, seq: int = 0) -> None:
        """positions: [N] attended tokens, probs: [Hq, N] their attention probabilities."""

    def prepare(self, layer: int, q: torch.Tensor, k: torch.Tensor, seq: int = 0) -> None:
        """Prefill hook. q: [Hq, T, d], k: [Hkv, T, d]."""


class AllTokens(TokenSelector):
    """Selection off: every offloaded token (hybrid attention is then exact)."""
    name = "all"
    stage = "post"

    def select(self, req):
        return torch.arange(len(req.positions))


class TopKLogits(TokenSelector):
    """HybridGen's post-QKᵀ selector: top-K by this step's CPU logits."""
    name = "topk"
    stage = "post"

    def select(self, req):
        return _topk_sorted(head_aggregated_score(req.logits), req.k)


class RecentWithSinks(TokenSelector):
    """HybridGen's pre-QKᵀ selector: ``sinks`` first tokens plus the most recent offloaded ones, K in all."""
    name = "sinks+recent"
    stage = "pre"

    def __init__(self, sinks: int = 4):
        self.sinks = sinks

    def select(self, req):
        s = len(req.positions)
        if req.k >= s:
            return torch.arange(s)
        n_sink = min(self.sinks, req.k)
        return torch.cat([torch.arange(n_sink), torch.arange(s - (req.k - n_sink), s)]).unique()


class StreamingLLM(TokenSelector):
    """4 attention sinks + a fixed window of the most recent tokens of the whole context (K is ignored)."""
    name = "streamingllm"
    stage = "pre"

    def __init__(self, sinks: int = 4, window: int = 128):
        self.sinks, self.window = sinks, window

    def select(self, req):
        keep = (req.positions < self.sinks) | (req.positions >= req.n_tokens - self.window)
        return torch.nonzero(keep).flatten()


class AccumulatedScore(TokenSelector):
    """H2O: heavy hitters by accumulated attention probability, permanently evicting the rest.

    A token dropped once never comes back (as in H2O's KV eviction); the score
    of a candidate is its accumulated probability plus this step's.
    """
    name = "h2o"
    stage = "post"
    observes = True

    def __init__(self):
        self.acc: dict[tuple[int, int], dict[int, float]] = {}   # (seq, layer) -> position -> score
        self.dropped: dict[tuple[int, int], set[int]] = {}

    def _current(self, logits: torch.Tensor, seq: int) -> torch.Tensor:
        return head_aggregated_score(logits)

    def select(self, req):
        acc = self.acc.setdefault((req.seq, req.layer), {})
        dropped = self.dropped.setdefault((req.seq, req.layer), set())
        pos = req.positions.tolist()
        alive = torch.tensor([p not in dropped for p in pos], dtype=torch.bool)
        score = self._current(req.logits, req.seq) + torch.tensor([acc.get(p, 0.0) for p in pos])
        score[~alive] = float("-inf")
        k = min(req.k, int(alive.sum()))
        chosen = _topk_sorted(score, k) if k < len(pos) else torch.arange(len(pos))
        chosen = chosen[alive[chosen]]
        keep = set(chosen.tolist())
        dropped.update(p for i, p in enumerate(pos) if i not in keep)
        return chosen

    def observe(self, layer, positions, probs, seq=0):
        acc = self.acc.setdefault((seq, layer), {})
        for p, s in zip(positions.tolist(), probs.sum(0).tolist()):
            acc[p] = acc.get(p, 0.0) + s


class Keyformer(AccumulatedScore):
    """Keyformer: accumulated scores of a Gumbel-perturbed, temperature-scaled softmax (seeded: reproducible)."""
    name = "keyformer"

    def __init__(self, tau: float = 1.0, seed: int = 0):
        super().__init__()
        self.tau, self.seed = tau, seed
        self.gens: dict[int, torch.Generator] = {}  # one stream per sequence, each seeded alike

    def _gumbel(self, shape, seq: int) -> torch.Tensor:
        gen = self.gens.setdefault(seq, torch.Generator().manual_seed(self.seed))
        u = torch.rand(shape, generator=gen).clamp_(1e-9, 1 - 1e-9)
        return -torch.log(-torch.log(u))

    def _current(self, logits, seq):
        return torch.softmax((logits + self._gumbel(logits.shape, seq)) / self.tau, -1).sum(0)

    def observe(self, layer, positions, probs, seq=0):
        logp = torch.log(probs.clamp_min(1e-30))
        super().observe(layer, positions, torch.softmax((logp + self._gumbel(probs.shape, seq)) / self.tau, -1), seq)


class InfiniGenSpeculation(TokenSelector):
    """InfiniGen-style pre-QKᵀ: speculate logits from a few query/key channels, keep the top-K.

    At prefill, each layer picks the ``channel_fraction`` of head channels with
    the largest Σ|q|·|k| (per KV head, shared by its query group); at decode the
    speculation uses the layer-ahead query on those channels only.
    """
    name = "infinigen"
    stage = "pre"

    def __init__(self, channel_fraction: float = INFINIGEN_CHANNEL_FRACTION):
        if not 0 < channel_fraction <= 1:
            raise ValueError(f"channel_fraction {channel_fraction} must be in (0, 1]")
        self.channel_fraction = channel_fraction
        self.channels: dict[tuple[int, int], torch.Tensor] = {}  # (seq, layer) -> [Hkv, n]

    def prepare(self, layer, q, k, seq=0):
        hkv, _, d = k.shape
        qa = q.abs().reshape(hkv, -1, q.shape[1], d).sum((1, 2))  # [Hkv, d]
        importance = qa * k.abs().sum(1)
        n = max(1, int(round(self.channel_fraction * d)))
        self.channels[(seq, layer)] = torch.topk(importance, n, dim=-1).indices.cpu()  # [Hkv, n]

    def select(self, req):
        keys = req.keys()  # [Hkv, S, d]
        chans = self.channels.get((req.seq, req.layer))
        if chans is None:
            return _topk_sorted(head_aggregated_score(attention_logits(req.query[None], keys[None])[0]), req.k)
        hkv = keys.shape[0]
        g = req.query.shape[0] // hkv
        kp = torch.gather(keys, 2, chans[:, None, :].expand(-1, keys.shape[1], -1))  # [Hkv, S, n]
        qp = torch.gather(req.query.reshape(hkv, g, -1), 2, chans[:, None, :].expand(-1, g, -1))  # [Hkv, G, n]
        spec = attention_logits(qp.reshape(1, hkv * g, -1), kp[None])[0]
        return _topk_sorted(head_aggregated_score(spec), req.k)
