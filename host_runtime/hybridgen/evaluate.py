"""Accuracy of each method on the real model: perplexity, agreement with full attention, passkey retrieval,
layer-input similarity (Figure 11) and K_min profiling (Figure 14's knee)."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .engine import HYBRID_FAMILY, Engine, EngineOptions
from .names import EVAL_ROWS, METHODS, POST

LICENSE_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def long_english_text() -> str:
    """A long English text available offline (Debian's license texts)."""
    for path in LICENSE_TEXTS:
        if Path(path).exists():
            return Path(path).read_text()
    raise FileNotFoundError(f"none of {LICENSE_TEXTS} exists; install Debian's base-files")


def paper_k_min_ratio() -> float:
    """The paper's K_min over its sequence length (128 / 2048 = 6.25 %): the accuracy row's K / context."""
    from .perfmodel import PAPER_SEQ_LEN, load_models

    return load_models()["opt-13b"].k_min / PAPER_SEQ_LEN


@dataclass
class EvalSettings:
    context_tokens: int = 1024     # prefix prefilled with full attention
    scored_tokens: int = 64        # continuation decoded one step at a time with the method
    passkey_tokens: int = 1024     # filler length of the passkey context
    passkey_depths: tuple = (0.1, 0.5, 0.9)
    passkey_seed: int = 0
    budget_ratio: float | None = None  # K / context_tokens; None: the paper's K_min ratio
    k_min: int | None = None           # K in tokens, instead of the ratio
    window: int | None = None          # StreamingLLM's window; None: its budget matches the others' (K + resident)

    def validate(self):
        for name in ("context_tokens", "scored_tokens", "passkey_tokens"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: allowed >= 2")
        for d in self.passkey_depths:
            if not 0 <= d <= 1:
                raise ValueError(f"passkey_depths={d} is invalid: allowed [0, 1]")
        if self.budget_ratio is not None and not 0 < self.budget_ratio <= 1:
            raise ValueError(f"budget_ratio={self.budget_ratio} is invalid: allowed (0, 1]")
        for name in ("k_min", "window"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: allowed >= 1")

    @property
    def k(self) -> int:
        """Selected offloaded tokens per layer: ``k_min``, or the budget ratio of the context."""
        if self.k_min is not None:
            return self.k_min
        ratio = paper_k_min_ratio() if self.budget_ratio is None else self.budget_ratio
        return max(1, round(ratio * self.context_tokens))


def row_options(row: str, base: EngineOptions, settings: EvalSettings) -> EngineOptions:
    """The engine options of one eval row (``names.EVAL_ROWS``), from the command line's ``base``.

    Every selective row keeps K = ``settings.k`` offloaded tokens next to the resident budget;
    StreamingLLM gets the same budget (sinks + window = K + resident) unless ``settings.window`` is set.
    """
    k = settings.k
    if row in ("full", "flexgen", "moe-lightning"):
        return replace(base, method=row)
    if row == "hybridgen":  # accuracy: post-QKᵀ pinned at K with the layer's true query, no branch taken on timing
        return replace(base, method="hybridgen", strategy="post", k_min=k, k_max=k, layer_ahead=False)
    if row == "hybridgen-scheduled":  # Algorithm 1 on modelled times: deterministic
        return replace(base, method="hybridgen", strategy="auto", timing="model", k_min=k,
                       k_max=max(k, base.k_max))
    if row == "streamingllm":
        window = settings.window or max(1, k + base.resident_budget - base.sinks)
        return replace(base, method=row, window=window, k_min=k, k_max=max(k, base.k_max))
    if row in METHODS:
        return replace(base, method=row, k_min=k, k_max=max(k, base.k_max))
    raise ValueError(f"row={row!r} is invalid: allowed {EVAL_ROWS}")


class PrefillCache:
    """The prompt pass of every prompt, computed once and shared by all methods (it is the same full attention)."""

    def __init__(self, model):
        self.model, self.done = model, {}

    def __call__(self, eng: Engine, ids: list[int]):
        key = tuple(ids)
        if key not in self.done:
            self.done[key] = eng.accel.prefill(torch.tensor(ids), last_logits_only=True)
        return self.done[key]


def decode_run(model, opts: EngineOptions, prefix: list[int], scored: list[int], prefill: PrefillCache | None = None):
    """Teacher-forced run of ``scored`` after ``prefix``: (perplexity, argmax ids [N], the engine's steps)."""
    with Engine(model, replace(opts, capacity=max(opts.capacity, len(prefix) + len(scored) + 1))) as eng:
        logits = eng.teacher_force(prefix, scored, prefill(eng, prefix) if prefill else None)
        steps = eng.steps
    nll = torch.nn.functional.cross_entropy(logits.float().cpu(), torch.tensor(scored))
    return math.exp(float(nll)), logits.argmax(-1).cpu(), steps


def perplexity_and_argmax(model, opts: EngineOptions, prefix: list[int], scored: list[int]):
    """Teacher-forced NLL of ``scored`` after ``prefix``: (perplexity, argmax ids [N])."""
    ppl, argmax, _ = decode_run(model, opts, prefix, scored)
    return ppl, argmax


def passkey_prompt(tok, n_filler_tokens: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """(context ids with the key sentence at ``depth`` of the filler, question ids)."""
    filler = tok.encode(PASSKEY_FILLER)
    reps = max(1, n_filler_tokens // len(filler))
    cut = int(round(depth * reps))
    needle = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ")
    ctx = filler * cut + needle + filler * (reps - cut)
    return ctx, tok.encode(" " + PASSKEY_QUESTION)


def passkey_found(model, tok, opts: EngineOptions, settings: EvalSettings, prefill: PrefillCache | None = None) -> float:
    """Fraction of depths at which greedy decoding repeats the hidden number."""
    rng = random.Random(settings.passkey_seed)
    hits = 0
    for depth in settings.passkey_depths:
        key = str(rng.randrange(10000, 99999))
        ctx, question = passkey_prompt(tok, settings.passkey_tokens, depth, key)
        with Engine(model, replace(opts, capacity=max(opts.capacity, len(ctx) + len(question) + 16))) as eng:
            logits = eng.prefill(torch.tensor(ctx), prefill(eng, ctx) if prefill else None)
            for t in question:  # the question goes through the method's decode path
                logits = eng.step(t)
            out = []
            for _ in range(len(key) + 2):
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                logits = eng.step(nxt)
        hits += key in tok.decode(out)
    return hits / len(settings.passkey_depths)


TIMING_FIELDS = ("decode_ms_per_token",)  # the only fields of a row that depend on this machine's speed


def evaluate_methods(model, tok, rows: list[str], base: EngineOptions, settings: EvalSettings,
                     progress=None) -> list[dict]:
    """One dict per row: method, perplexity, agreement (top-1 with 'full'), passkey_accuracy, the K each step
    used (k_range), the share of post-QKᵀ steps (post_qkt_fraction; None for the methods that select nothing:
    full, flexgen, moe-lightning), offloaded tokens at the last step, and
    decode_ms_per_token (measured: the one timing field). K, strategy and offloaded come from the perplexity run."""
    settings.validate()
    ids = tok.encode(long_english_text())
    need = settings.context_tokens + settings.scored_tokens
    if len(ids) < need:
        raise ValueError(f"context_tokens + scored_tokens = {need} exceeds the text's {len(ids)} tokens")
    prefix, scored = ids[:settings.context_tokens], ids[settings.context_tokens:need]
    prefill = PrefillCache(model)
    _, reference, _ = decode_run(model, replace(base, method="full"), prefix, scored, prefill)
    out = []
    for row in rows:
        opts = row_options(row, base, settings)
        t0 = time.perf_counter()
        ppl, argmax, steps = decode_run(model, opts, prefix, scored, prefill)
        seconds = time.perf_counter() - t0
        out.append({"method": row, "perplexity": round(ppl, 4),
                    "agreement": round(float((argmax == reference).float().mean()), 4),
                    "passkey_accuracy": round(passkey_found(model, tok, opts, settings, prefill), 4),
                    "k_range": [min(s.k for s in steps), max(s.k for s in steps)],
                    "post_qkt_fraction": (round(sum(s.strategy == POST for s in steps) / len(steps), 4)
                                          if opts.method in HYBRID_FAMILY else None),  # no selection: no strategy
                    "offloaded": steps[-1].offloaded,
                    "decode_ms_per_token": round(seconds / len(scored) * 1e3, 2)})
        if progress is not None:
            progress.update(1)
    return out


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
    prefill = PrefillCache(model)
    _, reference, _ = decode_run(model, replace(base, method="full"), prefix, scored, prefill)
    rows = []
    offloaded = max(1, settings.context_tokens - base.resident_budget)
    for r in ratios:
        k = max(1, int(round(r * offloaded)))
        opts = replace(base, method="hybridgen", strategy="post", k_min=k, k_max=k, layer_ahead=False)
        ppl, argmax, _ = decode_run(model, opts, prefix, scored, prefill)
        rows.append({"ratio": r, "k": k, "agreement": float((argmax == reference).float().mean()), "perplexity": ppl})
        if progress is not None:
            progress.update(1)
    knee = knee_point([row["ratio"] for row in rows], [row["agreement"] for row in rows])
    return rows, knee
