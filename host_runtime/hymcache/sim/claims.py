"""The paper's quantitative serving claims as named predicates over ``simulate``'s output, and
``chm hymcache claims``: each claim's verdict at the presets, from one command.

A claim measures one number in a simulation's result and holds when that number meets the paper's under one
rule, fixed here before any run, with one tolerance (``RATIO_TOLERANCE`` relative, ``TURN_TOLERANCE`` turns):

* ``ratio``: a rate or a ratio within +-``RATIO_TOLERANCE`` (relative) of the paper's value; "the same as" a
  reference (flat, near recompute, matches a CDF) is a ratio to the reference, paper value 1;
* ``turn``: a turn within +-``TURN_TOLERANCE`` turns;
* ``count``: exactly the paper's count;
* ``range``: a value the paper gives as a range [lo, hi], inside it widened by the tolerance:
  lo x (1 - tol) <= measured <= hi x (1 + tol);
* ``at_least``: "more than p": measured >= p x (1 - tol);
* ``below``: a direction against the value of no change p ("the gap narrows": a ratio below p = 1), which a
  ratio within the tolerance of p cannot be told from: measured <= p x (1 - tol).

A claim whose number the run does not define (a tier not run, a collapse that never comes, a gap that never
opens) does not hold, and says why. Every measured number, defined (docs/simulation.md, "The paper's claims",
has the table):

* makespan ratios are ``summary[tier]["makespan_s"]`` ratios (issue #12: a speedup is a ratio of makespans);
* per-turn latency is ``ttft_mean_ms`` (the mean TTFT, the first panel of report.plot, as the paper's figures);
  the gap of hymcache behind a tier at a turn: hymcache's mean TTFT / the tier's - 1;
* a latency CDF is compared at ``run.TTFT_QUANTILES`` (p10..p90): the ratio of hymcache's TTFT to the other
  tier's at each, the one farthest from 1 is the measured number;
* HyMCache's skipped share: its ``skipped_inserts`` (refused by the write buffer or no staging room) over the
  blocks offered to its device (``details["hymcache"]["put_blocks"]``);
* Fig. 15's numbers are turn 6's, prefetch (``hymcache``) against ``hymcache-noprefetch``: mean read bandwidth
  while loading (``read_gbps_loading``), its peak (``read_gbps_peak``, in Gbit/s against the 200 Gbps link),
  end-to-end time (``e2e_ms``), hit rate.

The statements quote issue #12's text of the paper's claims.
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
KINDS = ("ratio", "turn", "count", "range", "at_least", "below")
GB = 10 ** 9


@dataclass(frozen=True)
class Claim:
    name: str          # figN.what_it_says
    figure: str        # the preset it is measured on (presets/figN.toml)
    statement: str     # the paper's claim, in words
    paper: float | tuple[float, float]  # the paper's number ((lo, hi) for a range)
    kind: str          # one of KINDS: which rule applies
    measure: Callable[[dict], float | None]  # the number in a simulation's result (None: not defined there)

    def verdict(self, result: dict) -> dict:
        measured = self.measure(result)
        tol = RATIO_TOLERANCE
        paper = list(self.paper) if isinstance(self.paper, tuple) else self.paper
        if measured is None or (isinstance(measured, float) and math.isnan(measured)):
            holds, why = False, "not defined by this run"
        elif self.kind == "count":
            holds, why = measured == self.paper, "exactly"
        elif self.kind == "turn":
            holds, why = abs(measured - self.paper) <= TURN_TOLERANCE, f"turn within +-{TURN_TOLERANCE}"
        elif self.kind == "range":
            lo, hi = self.paper
            holds, why = lo * (1 - tol) <= measured <= hi * (1 + tol), f"inside [lo, hi] widened by {tol:.0%}"
        elif self.kind == "at_least":
            holds, why = measured >= self.paper * (1 - tol), f"at least the paper's less {tol:.0%}"
        elif self.kind == "below":
            holds, why = measured <= self.paper * (1 - tol), f"below the paper's by more than {tol:.0%}"
        else:
            holds, why = abs(measured / self.paper - 1) <= tol, f"within +-{tol:.0%}"
        return {"name": self.name, "figure": self.figure, "statement": self.statement, "paper": paper,
                "measured": measured, "holds": holds, "rule": why}


# ---- what a claim reads in a result (simulate(): rows per tier and turn, summary and speedups) ----

def turns_of(result: dict, tier: str) -> dict[int, dict]:
    return {r["turn"]: r for r in result["rows"] if r["tier"] == tier}


def at_turn(result: dict, tier: str, turn: int, key: str):
    """``key`` of ``tier``'s row for ``turn`` (None: no such row or value)."""
    return turns_of(result, tier).get(turn, {}).get(key)


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


def makespan(result: dict, label: str) -> float | None:
    s = result.get("summary", {}).get(label, {}).get("makespan_s")
    return s if s else None


def makespan_ratio(tier: str, reference: str) -> Callable[[dict], float | None]:
    """``tier``'s makespan / ``reference``'s (1: as slow as the reference)."""
    def measure(result: dict) -> float | None:
        a, b = makespan(result, tier), makespan(result, reference)
        return a / b if a and b else None
    return measure


def ahead_of_hymcache(tier: str) -> Callable[[dict], float | None]:
    """How much faster ``tier`` serves the workload than hymcache: hymcache's makespan / ``tier``'s - 1."""
    def measure(result: dict) -> float | None:
        r = makespan_ratio("hymcache", tier)(result)
        return None if r is None else r - 1
    return measure


def gap_narrowing(tier: str) -> Callable[[dict], float | None]:
    """hymcache's gap behind ``tier`` at the last turn over its widest (the gap at a turn: hymcache's mean TTFT /
    ``tier``'s - 1); undefined where ``tier`` is never ahead."""
    def measure(result: dict) -> float | None:
        ours, theirs = turns_of(result, "hymcache"), turns_of(result, tier)
        gaps = {t: ours[t]["ttft_mean_ms"] / theirs[t]["ttft_mean_ms"] - 1
                for t in sorted(set(ours) & set(theirs)) if theirs[t]["ttft_mean_ms"] > 0}
        if not gaps or max(gaps.values()) <= 0:
            return None
        return gaps[max(gaps)] / max(gaps.values())
    return measure


def hit_rate_lead(tier: str, turn: int) -> Callable[[dict], float | None]:
    """hymcache's hit rate minus ``tier``'s at ``turn`` (a fraction: 0.10 = 10 points)."""
    def measure(result: dict) -> float | None:
        a, b = at_turn(result, "hymcache", turn, "hit_rate"), at_turn(result, tier, turn, "hit_rate")
        return None if a is None or b is None else a - b
    return measure


def skipped_share(result: dict) -> float | None:
    """hymcache's skipped insertions over the blocks offered to its device."""
    offered = result.get("details", {}).get("hymcache", {}).get("put_blocks")
    skipped = result.get("summary", {}).get("hymcache", {}).get("skipped_inserts")
    return skipped / offered if offered and skipped is not None else None


def staged_label(result: dict, tier: str, staging_bytes: int) -> str | None:
    """The label of ``tier``'s run with ``staging_bytes`` of staging per node (a staging sweep: tier@SIZE)."""
    for r in result["rows"]:
        if r.get("base_tier") == tier and r.get("staging_bytes") == staging_bytes:
            return r["tier"]
    return None


def staged_vs_recompute(tier: str, staging_bytes: int) -> Callable[[dict], float | None]:
    """``tier``'s makespan at ``staging_bytes`` of staging / recompute's."""
    def measure(result: dict) -> float | None:
        label = staged_label(result, tier, staging_bytes)
        return None if label is None else makespan_ratio(label, "recompute")(result)
    return measure


def flat_from(tier: str, staging_bytes: int) -> Callable[[dict], float | None]:
    """Of ``tier``'s makespans at each staging size from ``staging_bytes`` up, over the one at the largest
    size: the ratio farthest from 1 (undefined with fewer than two sizes)."""
    def measure(result: dict) -> float | None:
        sizes = {r["staging_bytes"]: r["tier"] for r in result["rows"]
                 if r.get("base_tier") == tier and r.get("staging_bytes", 0) >= staging_bytes}
        if len(sizes) < 2 or not makespan(result, sizes[max(sizes)]):
            return None
        ratios = [makespan_ratio(label, sizes[max(sizes)])(result) for size, label in sizes.items()
                  if size != max(sizes)]
        return None if None in ratios else max(ratios, key=lambda r: abs(r - 1))
    return measure


def cdf_match(tier: str, turn: int) -> Callable[[dict], float | None]:
    """hymcache's TTFT over ``tier``'s at each of run.TTFT_QUANTILES at ``turn``: the ratio farthest from 1."""
    def measure(result: dict) -> float | None:
        a, b = at_turn(result, "hymcache", turn, "ttft_deciles_ms"), at_turn(result, tier, turn, "ttft_deciles_ms")
        if not a or not b or len(a) != len(b) or min(b) <= 0:
            return None
        return max((x / y for x, y in zip(a, b)), key=lambda r: abs(r - 1))
    return measure


def prefetch_gain(key: str, turn: int) -> Callable[[dict], float | None]:
    """hymcache's ``key`` at ``turn`` over hymcache-noprefetch's, - 1."""
    def measure(result: dict) -> float | None:
        a, b = at_turn(result, "hymcache", turn, key), at_turn(result, "hymcache-noprefetch", turn, key)
        return a / b - 1 if a is not None and b else None
    return measure


def prefetch_cut(key: str, turn: int) -> Callable[[dict], float | None]:
    """1 - hymcache's ``key`` at ``turn`` over hymcache-noprefetch's (0.14: 14 % less)."""
    def measure(result: dict) -> float | None:
        g = prefetch_gain(key, turn)(result)
        return None if g is None else -g
    return measure


def peak_gbit(tier: str, turn: int) -> Callable[[dict], float | None]:
    """``tier``'s peak read bandwidth at ``turn`` in Gbit/s (read_gbps_peak is GB/s)."""
    def measure(result: dict) -> float | None:
        v = at_turn(result, tier, turn, "read_gbps_peak")
        return None if v is None else 8 * v
    return measure


def hit_rate_at(tier: str, turn: int) -> Callable[[dict], float | None]:
    return lambda result: at_turn(result, tier, turn, "hit_rate")


CLAIMS = (
    # Fig. 13: single node, Llama-3.1-8B, LMSYS chat
    Claim("fig13.hymcache_hit_rate_near_90", "13", "HyMCache keeps a hit rate near 90 % (mean from turn 3)",
          0.90, "ratio", mean_hit_rate_from("hymcache", 3)),
    Claim("fig13.gpu_prefix_collapse_turn_3", "13", "GPU prefix caching loses its reuse around turn 3",
          3, "turn", collapse_turn("gpu-prefix")),
    Claim("fig13.lmcache_local_collapse_turn_4", "13", "LMCache with 64 GB local CPU DRAM loses its reuse around "
          "turn 4: LRU evicts early blocks, and a prefix is only reusable as an unbroken chain",
          4, "turn", collapse_turn("lmcache-local")),
    Claim("fig13.speedup_3x_over_lmcache_local", "13", "HyMCache beats local LMCache by 3.0x with the same DRAM budget",
          3.0, "ratio", speedup("hymcache_vs_lmcache-local")),
    Claim("fig13.recompute_ttft_grows_every_turn", "13", "Recomputation latency grows every turn (no turn without "
          "growth)", 0, "count", turns_without_growth("recompute")),
    # Fig. 10: PD 4P-1D-1S, Qwen2.5-32B, AIPerf-style
    Claim("fig10.speedup_1_45x_over_lmcache_local", "10", "HyMCache (64 GB device DRAM, 2 TB of SSD) beats local "
          "LMCache (64 GB per worker, 256 GB in total) by 1.45x", 1.45, "ratio", speedup("hymcache_vs_lmcache-local")),
    Claim("fig10.mooncake_ahead_10_50pct", "10", "Distributed Mooncake, a 1 TB DRAM pool over RDMA, is about 30 % "
          "faster than HyMCache (issue #12's acceptance: ahead by 10-50 %)",
          (0.10, 0.50), "range", ahead_of_hymcache("mooncake-dram")),
    Claim("fig10.gap_narrows", "10", "the gap [Mooncake ahead of HyMCache] narrows in later turns (the last turn's "
          "gap over the widest)", 1.0, "below", gap_narrowing("mooncake-dram")),
    Claim("fig10.turn7_hit_rate_lead", "10", "At turn 7 HyMCache's hit rate is about 10 % above Mooncake's, whose 1 TB "
          "covers about 2/3 of the footprint (in points)", 0.10, "ratio", hit_rate_lead("mooncake-dram", 7)),
    Claim("fig10.skipped_inserts_over_15pct", "10", "HyMCache skips more than 15 % of insertions because of its "
          "read-prioritized write buffer", 0.15, "at_least", skipped_share),
    # Fig. 12: the transfer buffer, Fig. 10's setup with 10-40 GB of staging per node
    Claim("fig12.mooncake_10gb_near_recompute", "12", "with 10 GB of staging per node, Mooncake's insertions miss "
          "their timeout and break prefix chains, so it falls to near recomputation (makespan / recompute's)",
          1.0, "ratio", staged_vs_recompute("mooncake-dram", 10 * GB)),
    Claim("fig12.hymcache_flat_from_10gb", "12", "HyMCache skips refused writes, and is flat from 10 GB of staging up "
          "(makespan / its own at the largest staging)", 1.0, "ratio", flat_from("hymcache", 10 * GB)),
    # Fig. 11: Mooncake over NVMe-oF
    Claim("fig11.nvmeof_near_recompute", "11", "Remote fetches then often exceed the 10 s timeout and fall back to "
          "recomputation, so the result is near the recompute baseline (makespan / recompute's)",
          1.0, "ratio", makespan_ratio("mooncake-nvmeof", "recompute")),
    # Fig. 14: LMCache + Redis over TCP
    Claim("fig14.hymcache_matches_lmcache_redis_cdf", "14", "LMCache with 64 GB local + 64 GB Redis is stable, and "
          "HyMCache matches its latency CDF at turn 6 (TTFT p10..p90, the ratio farthest from 1)",
          1.0, "ratio", cdf_match("lmcache-local+redis", 6)),
    # Fig. 15b/c: the device prefetch on and off, turn 6
    Claim("fig15.hymcache_hit_rate_over_90", "15", "turn 6, hit rate over 90 %", 0.90, "at_least",
          hit_rate_at("hymcache", 6)),
    Claim("fig15.prefetch_bw_plus_35pct", "15", "Prefetch raises mean remote read bandwidth by over 35 % (turn 6, "
          "while loading)", 0.35, "at_least", prefetch_gain("read_gbps_loading", 6)),
    Claim("fig15.prefetch_peak_near_200gbps", "15", "[prefetch's read bandwidth] peaks near the 200 Gbps link "
          "(turn 6, Gbit/s)", 200.0, "ratio", peak_gbit("hymcache", 6)),
    Claim("fig15.prefetch_e2e_minus_14pct", "15", "[prefetch] cuts end-to-end time by 14 % (turn 6, mean e2e)",
          0.14, "ratio", prefetch_cut("e2e_ms", 6)),
)
BY_NAME = {c.name: c for c in CLAIMS}


def paper_text(paper: float | list | tuple) -> str:
    """A verdict's paper number as text: ``0.9``, or a range ``0.1-0.5``."""
    return "-".join(f"{x:g}" for x in paper) if isinstance(paper, (list, tuple)) else f"{paper:g}"


def figures() -> list[str]:
    """The figures that have claims, in order."""
    return sorted({c.figure for c in CLAIMS}, key=int)


def evaluate(figure: str, result: dict) -> list[dict]:
    """Every claim of ``figure``, judged on ``result`` (a simulation of that figure's preset)."""
    return [c.verdict(result) for c in CLAIMS if c.figure == figure]


# ---- chm hymcache claims ----

def register(sub) -> None:
    p = sub.add_parser("claims", help="the paper's serving claims, each with its verdict at the presets",
                       description="Simulate each named figure's preset and judge every quantitative claim of the "
                                   f"paper's serving evaluation on it: a rate or ratio holds within "
                                   f"+-{RATIO_TOLERANCE:.0%} of the paper's, a turn within +-{TURN_TOLERANCE}, a "
                                   f"range widened by {RATIO_TOLERANCE:.0%} (docs/simulation.md).")
    p.add_argument("--figure", action="append", choices=figures(), metavar="N",
                   help=f"only this figure's claims (repeatable; default all: {', '.join(figures())})")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--out", metavar="DIR", help="also write DIR/claims.json and DIR/claims.md (the verdicts' table)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_claims)


def markdown(verdicts: list[dict]) -> str:
    """The verdicts as a markdown table, one row a claim (what the README shows)."""
    lines = ["| claim | the paper | measured | verdict | rule |", "|---|---|---|---|---|"]
    for v in verdicts:
        measured = "not defined" if v["measured"] is None else f"{v['measured']:.3g}"
        lines.append(f"| `{v['name']}` | {paper_text(v['paper'])} | {measured} | "
                     f"{'holds' if v['holds'] else '**fails**'} | {v['rule']} |")
    held = sum(v["holds"] for v in verdicts)
    return "\n".join(lines) + f"\n\n{held} of {len(verdicts)} claims hold at the presets.\n"


def judge(figures_: list[str], progress: bool = False) -> list[dict]:
    """Every claim of ``figures_``, each figure's preset simulated once."""
    from .config import load_settings, preset_path
    from .run import simulate

    verdicts = []
    for figure in figures_:
        verdicts += evaluate(figure, simulate(load_settings(preset_path(figure)), progress=progress))
    return verdicts


def write_verdicts(verdicts: list[dict], out) -> list:
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "claims.json").write_text(json.dumps(verdicts, indent=1) + "\n")
    (out / "claims.md").write_text(markdown(verdicts))
    return [out / "claims.json", out / "claims.md"]


def _claims(args) -> int:
    verdicts = judge(args.figure or figures(), progress=not args.no_progress and sys.stderr.isatty())
    if args.out:
        write_verdicts(verdicts, args.out)
    if args.json:
        print(json.dumps(verdicts, indent=2))
        return 0
    width = max(len(v["name"]) for v in verdicts)
    for v in verdicts:
        measured = "-" if v["measured"] is None else f"{v['measured']:.3g}"
        print(f"{v['name']:<{width}}  paper {paper_text(v['paper']):<8} measured {measured:<6} "
              f"{'holds' if v['holds'] else 'FAILS'} ({v['rule']})")
    held = sum(v["holds"] for v in verdicts)
    print(f"{held} of {len(verdicts)} claims hold at the presets")
    return 0
