"""The paper's quantitative serving claims as named predicates over ``simulate``'s output, and
``chm hymcache claims``: each claim's verdict at the presets, from one command.

A claim measures one number in a simulation's result (a hit rate, a speedup, a turn) and holds when that
number is within the tolerance of the paper's. One rule, fixed here before any run: a rate or a ratio within
``RATIO_TOLERANCE`` (relative) of the paper's value, a turn within ``TURN_TOLERANCE`` turns. A claim whose
number the run does not define (a tier not run, a collapse that never comes) does not hold, and says why; a
count (turns without growth) must equal the paper's.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Callable

RATIO_TOLERANCE = 0.10  # a rate or a ratio: within +-10 % of the paper's
TURN_TOLERANCE = 1      # a turn: within +-1 of the paper's
COLLAPSE_FRACTION = 0.5  # a tier has collapsed once its hit rate is below half of hymcache's (docs/simulation.md)


@dataclass(frozen=True)
class Claim:
    name: str          # figN.what_it_says
    figure: str        # the preset it is measured on (presets/figN.toml)
    statement: str     # the paper's claim, in words
    paper: float       # the paper's number
    kind: str          # "ratio", "turn" or "count" (exact): which tolerance applies
    measure: Callable[[dict], float | None]  # the number in a simulation's result (None: not defined there)

    def verdict(self, result: dict) -> dict:
        measured = self.measure(result)
        if measured is None or (isinstance(measured, float) and math.isnan(measured)):
            holds, why = False, "not defined by this run"
        elif self.kind == "count":
            holds, why = measured == self.paper, "exactly"
        elif self.kind == "turn":
            holds, why = abs(measured - self.paper) <= TURN_TOLERANCE, f"turn within +-{TURN_TOLERANCE}"
        else:
            holds, why = abs(measured / self.paper - 1) <= RATIO_TOLERANCE, f"within +-{RATIO_TOLERANCE:.0%}"
        return {"name": self.name, "figure": self.figure, "statement": self.statement, "paper": self.paper,
                "measured": measured, "holds": holds, "rule": why}


# ---- what a claim reads in a result (simulate(): rows per tier and turn, summary and speedups) ----

def turns_of(result: dict, tier: str) -> dict[int, dict]:
    return {r["turn"]: r for r in result["rows"] if r["tier"] == tier}


def mean_hit_rate_from(tier: str, first_turn: int) -> Callable[[dict], float | None]:
    def measure(result: dict) -> float | None:
        rates = [r["hit_rate"] for t, r in turns_of(result, tier).items() if t >= first_turn
                 and r["hit_rate"] is not None]
        return sum(rates) / len(rates) if rates else None
    return measure


def collapse_turn(tier: str) -> Callable[[dict], float | None]:
    """The first turn at which ``tier``'s hit rate is below ``COLLAPSE_FRACTION`` of hymcache's."""
    def measure(result: dict) -> float | None:
        ours, theirs = turns_of(result, "hymcache"), turns_of(result, tier)
        for t in sorted(set(ours) & set(theirs)):
            a, b = ours[t]["hit_rate"], theirs[t]["hit_rate"]
            if a is not None and b is not None and a > 0 and b < COLLAPSE_FRACTION * a:
                return t
        return None
    return measure


def speedup(key: str) -> Callable[[dict], float | None]:
    return lambda result: result.get("speedups", {}).get(key)


def turns_without_growth(tier: str) -> Callable[[dict], float | None]:
    """How many turns ``tier``'s TTFT p50 did not grow over the turn before (the claim: none)."""
    def measure(result: dict) -> float | None:
        rows = [r for _, r in sorted(turns_of(result, tier).items())]
        if len(rows) < 2:
            return None
        return sum(b["ttft_p50_ms"] <= a["ttft_p50_ms"] for a, b in zip(rows, rows[1:]))
    return measure


CLAIMS = (
    Claim("fig13.hymcache_hit_rate_near_90", "13", "HyMCache keeps ~90 % of reusable KV hits from turn 3",
          0.90, "ratio", mean_hit_rate_from("hymcache", 3)),
    Claim("fig13.gpu_prefix_collapse_turn_3", "13", "vLLM's GPU prefix cache alone collapses at turn 3",
          3, "turn", collapse_turn("gpu-prefix")),
    Claim("fig13.lmcache_local_collapse_turn_4", "13", "LMCache's local CPU tier collapses at turn 4",
          4, "turn", collapse_turn("lmcache-local")),
    Claim("fig13.speedup_3x_over_lmcache_local", "13", "HyMCache serves 3.0x faster than LMCache local",
          3.0, "ratio", speedup("hymcache_vs_lmcache-local")),
    Claim("fig13.recompute_ttft_grows_every_turn", "13", "recompute's TTFT grows every turn (no turn without growth)",
          0, "count", turns_without_growth("recompute")),
    Claim("fig10.speedup_1_45x_over_lmcache_local", "10", "HyMCache serves 1.45x faster than LMCache local (PD)",
          1.45, "ratio", speedup("hymcache_vs_lmcache-local")),
)
BY_NAME = {c.name: c for c in CLAIMS}


def evaluate(figure: str, result: dict) -> list[dict]:
    """Every claim of ``figure``, judged on ``result`` (a simulation of that figure's preset)."""
    return [c.verdict(result) for c in CLAIMS if c.figure == figure]


# ---- chm hymcache claims ----

def register(sub) -> None:
    p = sub.add_parser("claims", help="the paper's serving claims, each with its verdict at the presets",
                       description="Simulate each named figure's preset and judge every quantitative claim of the "
                                   f"paper's serving evaluation on it: a rate or ratio holds within "
                                   f"+-{RATIO_TOLERANCE:.0%} of the paper's, a turn within +-{TURN_TOLERANCE}.")
    figures = sorted({c.figure for c in CLAIMS}, key=int)
    p.add_argument("--figure", action="append", choices=figures, metavar="N",
                   help=f"only this figure's claims (repeatable; default all: {', '.join(figures)})")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_claims)


def _claims(args) -> int:
    from .config import load_settings, preset_path
    from .run import simulate

    figures = args.figure or sorted({c.figure for c in CLAIMS}, key=int)
    verdicts = []
    for figure in figures:
        result = simulate(load_settings(preset_path(figure)), progress=not args.no_progress and sys.stderr.isatty())
        verdicts += evaluate(figure, result)
    if args.json:
        print(json.dumps(verdicts, indent=2))
        return 0
    width = max(len(v["name"]) for v in verdicts)
    for v in verdicts:
        measured = "-" if v["measured"] is None else f"{v['measured']:.3g}"
        print(f"{v['name']:<{width}}  paper {v['paper']:<5g} measured {measured:<6} "
              f"{'holds' if v['holds'] else 'FAILS'} ({v['rule']})")
    held = sum(v["holds"] for v in verdicts)
    print(f"{held} of {len(verdicts)} claims hold at the presets")
    return 0
