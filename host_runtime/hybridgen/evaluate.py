"""Accuracy of each method on the real model: perplexity, agreement with full attention, passkey retrieval,
layer-input similarity (Figure 11) and K_min profiling (Figure 14's knee)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .engine import Engine, EngineOptions

LICENSE_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def long_english_text() -> str:
    """A long English text available offline (Debian's license texts)."""
    for path in LICENSE_TEXTS:
        if Path(path).exists():
            return Path(path).read_text()
    raise FileNotFoundError(f"none of {LICENSE_TEXTS} exists; install Debian's base-files")


@dataclass
class EvalSettings:
    context_tokens: int = 384      # prefix prefilled with full attention
    scored_tokens: int = 64        # continuation decoded one step at a time with the method
    passkey_tokens: int = 384      # filler length of the passkey context
    passkey_depths: tuple = (0.1, 0.5, 0.9)
    passkey_seed: int = 0

    def validate(self):
        for name in ("context_tokens", "scored_tokens", "passkey_tokens"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 2")
        for d in self.passkey_depths:
            if not 0 <= d <= 1:
                raise ValueError(f"passkey depth {d} must be in [0, 1]")


def perplexity_and_argmax(model, opts: EngineOptions, prefix: list[int], scored: list[int]):
    """Teacher-forced NLL of ``scored`` after ``prefix``: (perplexity, argmax ids [N])."""
    with Engine(model, replace(opts, capacity=max(opts.capacity, len(prefix) + len(scored) + 1))) as eng:
        logits = eng.teacher_force(prefix, scored)
    nll = torch.nn.functional.cross_entropy(logits.float().cpu(), torch.tensor(scored))
    return math.exp(float(nll)), logits.argmax(-1).cpu()


def passkey_prompt(tok, n_filler_tokens: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """(context ids with the key sentence at ``depth`` of the filler, question ids)."""
    filler = tok.encode(PASSKEY_FILLER)
    reps = max(1, n_filler_tokens // len(filler))
    cut = int(round(depth * reps))
    needle = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ")
    ctx = filler * cut + needle + filler * (reps - cut)
    return ctx, tok.encode(" " + PASSKEY_QUESTION)


def passkey_found(model, tok, opts: EngineOptions, settings: EvalSettings) -> float:
    """Fraction of depths at which greedy decoding repeats the hidden number."""
    rng = random.Random(settings.passkey_seed)
    hits = 0
    for depth in settings.passkey_depths:
        key = str(rng.randrange(10000, 99999))
        ctx, question = passkey_prompt(tok, settings.passkey_tokens, depth, key)
        with Engine(model, replace(opts, capacity=max(opts.capacity, len(ctx) + len(question) + 16))) as eng:
            logits = eng.prefill(torch.tensor(ctx))
            for t in question:  # the question goes through the method's decode path
                logits = eng.step(t)
            out = []
            for _ in range(len(key) + 2):
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                logits = eng.step(nxt)
        hits += key in tok.decode(out)
    return hits / len(settings.passkey_depths)


def evaluate_methods(model, tok, methods: dict[str, EngineOptions], settings: EvalSettings, progress=None) -> list[dict]:
    """One row per method: method, perplexity, agreement (top-1 with 'full'), passkey_accuracy."""
    settings.validate()
    ids = tok.encode(long_english_text())
    need = settings.context_tokens + settings.scored_tokens
    if len(ids) < need:
        raise ValueError(f"context_tokens + scored_tokens = {need} exceeds the text's {len(ids)} tokens")
    prefix, scored = ids[:settings.context_tokens], ids[settings.context_tokens:need]
    _, reference = perplexity_and_argmax(model, EngineOptions(method="full"), prefix, scored)
    rows = []
    for name, opts in methods.items():
        ppl, argmax = perplexity_and_argmax(model, opts, prefix, scored)
        rows.append({"method": name, "perplexity": round(ppl, 4),
                     "agreement": round(float((argmax == reference).float().mean()), 4),
                     "passkey_accuracy": round(passkey_found(model, tok, opts, settings), 4)})
        if progress is not None:
            progress.update(1)
    return rows


@torch.no_grad()
def layer_input_similarity(model, ids: list[int]) -> list[float]:
    """Cosine similarity of consecutive layers' inputs x_i, x_{i+1} ([T, D] each), averaged over tokens.

    One value per pair (i, i+1): what layer-ahead pipelining relies on, since
    the CPU feeds x_i to layer i+1's norm and W_q.
    """
    _, _, _, inputs = model.prefill(torch.tensor(ids))
    return [torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item() for a, b in zip(inputs, inputs[1:])]


def knee_point(xs: list[float], ys: list[float]) -> int:
    """Index of the knee of an increasing, saturating curve: the point farthest above the chord (Kneedle)."""
    if len(xs) < 3:
        return len(xs) - 1
    x0, y0, x1, y1 = xs[0], ys[0], xs[-1], ys[-1]
    span_x, span_y = (x1 - x0) or 1.0, (y1 - y0) or 1.0
    dist = [((y - y0) / span_y) - ((x - x0) / span_x) for x, y in zip(xs, ys)]
    return max(range(len(xs)), key=lambda i: dist[i])


def profile_kmin(model, tok, ratios: list[float], settings: EvalSettings, base: EngineOptions, progress=None):
    """Sweep the retained-KV ratio (K / offloaded tokens); returns (rows, knee index).

    Accuracy is top-1 agreement with full attention on the long text, the
    method HybridGen with post-QKᵀ top-K at that fixed K (no scheduler).
    """
    ids = tok.encode(long_english_text())
    prefix = ids[:settings.context_tokens]
    scored = ids[settings.context_tokens:settings.context_tokens + settings.scored_tokens]
    _, reference = perplexity_and_argmax(model, EngineOptions(method="full"), prefix, scored)
    rows = []
    offloaded = max(1, settings.context_tokens - base.resident_budget)
    for r in ratios:
        k = max(1, int(round(r * offloaded)))
        opts = replace(base, method="hybridgen",
                       k_min=k, k_max=k, layer_ahead=False)
        ppl, argmax = perplexity_and_argmax(model, opts, prefix, scored)
        rows.append({"ratio": r, "k": k, "agreement": float((argmax == reference).float().mean()), "perplexity": ppl})
        if progress is not None:
            progress.update(1)
    knee = knee_point([row["ratio"] for row in rows], [row["agreement"] for row in rows])
    return rows, knee
