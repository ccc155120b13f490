"""``chm hymcache sweep --claims``: where each of the paper's serving claims holds, over every parameter the paper
leaves open (issue #25: "where the paper is silent, a single preset cannot settle the question; a map can").

``PARAMETERS`` is the one table of what is swept: per figure, a setting that the figure's preset has to assume
(an ``[assumption]`` there, or a value the paper bounds only from one side), the values it takes, where that range
comes from, and what the paper leaves open. A point is one whole ``simulate`` of the figure's preset -- every
tier of it, since claims compare tiers -- with that one setting changed, judged by ``claims.evaluate``; each point
is one Dask task (``host_runtime/replay/sweep.py`` ``run_tasks``). No point changes a tier's own constant (a
device, Mooncake or LMCache default, a link the paper states): only the parameter the paper leaves open.

Output: one table per parameter (claim x value -> holds / FAILS with the measured number), ``claims_map.json``,
``claims_map.md`` and ``claims_map.png`` (one panel per parameter, the preset's own value marked).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.checks import outside
from host_runtime.replay.models import get_model
from host_runtime.replay.sweep import format_columns, run_tasks

from .claims import paper_text
from .config import BY_KEY, check, check_settings, load_settings, preset_path

GB = 10 ** 9


@dataclass(frozen=True)
class Parameter:
    figure: str          # the preset it changes (presets/figN.toml) and whose claims judge it
    key: str             # the setting (config.FIELDS)
    values: tuple        # the sweep, in the field's own type (bytes as integers), ascending
    source: str          # where the range comes from
    open: str            # what the paper leaves open




def _turn_tokens(growth_bytes: float) -> float:
    """Fig. 13's workload.turn_tokens for ``growth_bytes`` of prefix growth per turn over the paper's 512
    conversations of Llama-3.1-8B KV (the preset's calibration: 64 GB -> 953)."""
    return float(int(growth_bytes / (512 * get_model("llama-3.1-8b").bytes_per_token)))


PARAMETERS = (
    Parameter("10", "workload.concurrency", (32, 128, 256, 1024),
              "32: the paper's own concurrency of one node (Fig. 13) for the whole deployment; 128: the preset, 32 per "
              "prefill worker; 256: vLLM's max_num_seqs default (one worker's batch full); 1024: 256 on each of the 4 "
              "prefill workers (above the 858 conversations: every session in flight)",
              "how many AIPerf sessions are in flight (AIPerf --concurrency) in Fig. 10"),
    Parameter("10", "tiers.staging", (10 * GB, 20 * GB, 30 * GB, 40 * GB),
              "the paper's own Fig. 12 sweep of the transfer buffer per node: 10, 20, 30, 40 GB",
              "Fig. 10's staging (transfer) buffer per prefill node"),
    Parameter("10", "topology.decode_tp", (1, 2, 4, 8),
              "the tensor-parallel sizes vLLM accepts for Qwen2.5-32B (they must divide its 40 attention and 8 KV "
              "heads), up to one 8-GPU A100 node (DGX A100 spec sheet)",
              "the decode worker's GPUs: the paper names one decode worker, not its GPU count"),
    Parameter("11", "nvmeof.fs_op_us", (10.0, 100.0, 300.0, 1000.0),
              "10 us: one NVMe-oF round trip with XFS's metadata cached; 100 us: the preset (a few metadata I/Os); "
              "300-1000 us: 3-10 uncached metadata reads, each a round trip plus a NAND read (~80 us 4 KiB read "
              "latency on Gen5 SSD spec sheets)",
              "XFS's software cost per file operation (its small-read rate) on Mooncake's NVMe-oF path"),
    Parameter("12", "workload.concurrency", (32, 128, 256, 1024),
              "as Fig. 10's (Fig. 12 runs Fig. 10's setup): 32 (Fig. 13's concurrency), 128 (the preset), 256 "
              "(vLLM's max_num_seqs), 1024 (256 per prefill worker)",
              "sessions in flight, which set how many transfers queue for the staging buffer in Fig. 12"),
    Parameter("13", "workload.turn_tokens", tuple(_turn_tokens(64 * GB * k) for k in (1, 4 / 3, 5 / 3, 2)),
              "the paper: \"the prefix-read footprint added between Turn 6 and Turn 7 alone exceeds 64 GB\"; 64, "
              "85, 107 and 128 GB of growth per turn over 512 conversations at 128 KiB a token (Llama-3.1-8B)",
              "how far the per-turn growth exceeds 64 GB (the paper gives a lower bound only)"),
    Parameter("14", "redis.gbps", (10.0, 25.0, 40.0, 100.0),
              "10: a 10 GbE server port; 25-40: one TCP stream on one core, Redis's single command thread "
              "(io-threads 1 by default); 100: the 100 Gbps NIC's line rate (the paper's ports)",
              "the Redis server's TCP throughput"),
    Parameter("14", "redis.latency_us", (30.0, 50.0, 100.0, 200.0),
              "Redis's latency docs (redis.io, \"Diagnosing latency issues\"): ~30 us over a Unix socket, ~200 us "
              "typical on a 1 Gbit/s network; 50 us: the preset, kernel TCP inside a rack",
              "one Redis command's round trip"),
    Parameter("15", "model.name", ("llama-2-7b", "llama-3.1-8b", "opt-30b", "qwen2.5-32b"),
              "the paper's own models on one A100 80GB: Fig. 5's 16, 64 and 168 MiB blocks of 128 tokens "
              "(Llama-3.1-8B, Llama-2-7B, OPT-30B) and Fig. 10's Qwen2.5-32B",
              "Fig. 15's model, i.e. the compute per loaded KV byte (the paper does not quote it)"),
)
NOTES = (
    "Fig. 12's transfer engine: no setting models Mooncake Transfer Engine's own queueing. A transfer is a "
    "pipe over the NICs (the paper's port speeds, its ~2 us RDMA latency) and waits first come first served for "
    "room in the staging buffer; an insert waits at most mooncake.insert_timeout_s, Mooncake's "
    "put_start_discard_timeout_sec default of 30 s. Inventing a queueing constant would be tuning a tier; the map "
    "sweeps what sets the queue's length instead: Fig. 12's sessions in flight (workload.concurrency).",
)


def figures() -> list[str]:
    """The figures with a parameter in the map, in number order."""
    return sorted({p.figure for p in PARAMETERS}, key=int)


def claim_figures() -> set[str]:
    """The figures claims.py judges now (its list grows)."""
    from .claims import CLAIMS

    return {c.figure for c in CLAIMS}


def select(figs: list[str] | None = None, keys: list[str] | None = None) -> list[Parameter]:
    """The parameters of ``figs`` (default: every figure with claims), only ``keys`` if given. ValueError naming
    the option, the value and what is allowed."""
    judged = [f for f in figures() if f in claim_figures()]
    for fig in figs or []:
        if fig not in judged:
            raise ValueError(outside("--figure", fig, f"one of {', '.join(judged)} (the figures with a claim in "
                                     f"claims.py and a parameter in the claims map)"))
    chosen = [p for p in PARAMETERS if p.figure in (figs or judged)]
    known = list(dict.fromkeys(p.key for p in chosen))
    for key in keys or []:
        if key not in known:
            raise ValueError(outside("--parameter", key, f"one of {', '.join(known)} (the claims map's parameters "
                                     f"of Fig. {', '.join(figs or judged)})"))
    return [p for p in chosen if not keys or p.key in keys]


def point_specs(parameters: list[Parameter], overrides: dict[str, Any] | None = None
                ) -> tuple[list[dict], dict[tuple[str, str, Any], int]]:
    """The task specs ({"figure", "settings"}), one per distinct point (the preset's own value of two parameters
    is one simulation), and (figure, key, value) -> its spec. ``overrides`` (tests: a smaller workload) apply to
    every point before the parameter's value; each is checked, and none may be the parameter."""
    specs: list[dict] = []
    seen: dict[str, int] = {}
    where: dict[tuple[str, str, Any], int] = {}
    for p in parameters:
        base = load_settings(preset_path(p.figure))
        for key, value in (overrides or {}).items():
            if key not in BY_KEY:
                raise ValueError(outside("override", key, "a setting of config.FIELDS"))
            if key == p.key:
                raise ValueError(f"override {key}: it is the swept parameter of Fig. {p.figure}")
            base[key] = check(BY_KEY[key], value, f"override {key}")
        for value in p.values:
            s = {**base, p.key: check(BY_KEY[p.key], value, f"Fig. {p.figure} {p.key}")}
            check_settings(s)
            ident = json.dumps([p.figure, s], sort_keys=True)
            if ident not in seen:
                seen[ident] = len(specs)
                specs.append({"figure": p.figure, "settings": s})
            where[(p.figure, p.key, value)] = seen[ident]
    return specs, where


def run_point(spec: dict) -> dict:
    """One point (in a Dask worker, or here): ``simulate`` of every tier of the figure's settings, then
    ``claims.evaluate``. A run the simulator refuses (a model that does not fit the GPU, ...) is the point's
    error, not the map's."""
    from .claims import evaluate
    from .run import simulate

    try:
        result = simulate(spec["settings"])
    except (ValueError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "verdicts": [], "wall_s": 0.0}
    return {"error": None, "verdicts": evaluate(spec["figure"], result), "wall_s": result["wall_s"],
            "speedups": result["speedups"], "makespan_s": {t: sm["makespan_s"] for t, sm in result["summary"].items()}}


def build_map(parameters: list[Parameter], where: dict[tuple[str, str, Any], int], records: list[dict]) -> dict:
    """The map: per parameter, its values (the preset's marked) and per claim one cell per value (``where``:
    ``point_specs``' index into ``records``)."""
    panels = []
    for p in parameters:
        preset = load_settings(preset_path(p.figure))[p.key]
        points = [records[where[(p.figure, p.key, v)]] for v in p.values]
        names = list(dict.fromkeys(v["name"] for r in points for v in r["verdicts"]))
        cells = {}
        for name in names:
            row = []
            for r in points:
                v = next((x for x in r["verdicts"] if x["name"] == name), None)
                row.append({"holds": v["holds"], "measured": v["measured"], "paper": v["paper"]} if v
                           else {"holds": None, "measured": None, "error": r["error"] or "claim not judged here"})
            cells[name] = row
        panels.append({"figure": p.figure, "key": p.key, "values": list(p.values), "preset": preset,
                       "source": p.source, "open": p.open, "claims": cells,
                       "statements": {v["name"]: v["statement"] for r in points for v in r["verdicts"]},
                       "paper": {v["name"]: v["paper"] for r in points for v in r["verdicts"]},
                       "errors": [r["error"] for r in points]})  # no wall time: a function of the settings
    return {"panels": panels, "notes": list(NOTES), "rule": _rule(), "tasks": len(records)}


def _rule() -> str:
    from .claims import RATIO_TOLERANCE, TURN_TOLERANCE

    return (f"a rate or ratio holds within +-{RATIO_TOLERANCE:.0%} of the paper's, a turn within +-{TURN_TOLERANCE}, "
            f"a count exactly (claims.py); a number the run does not define fails")


# ---- report ---------------------------------------------------------------------------------
def value_text(key: str, value: Any) -> str:
    if BY_KEY[key].kind == "bytes" and isinstance(value, int):
        if value % GB == 0:
            return f"{value // GB}GB"
        for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
            if value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _heads(panel: dict) -> list[str]:
    return [value_text(panel["key"], v) + ("*" if v == panel["preset"] else "") for v in panel["values"]]


def cell_text(cell: dict) -> str:
    if cell["holds"] is None:
        return "error"
    measured = "-" if cell["measured"] is None else f"{cell['measured']:.3g}"
    return f"{'holds' if cell['holds'] else 'FAILS'} {measured}"


def format_map(m: dict) -> str:
    """One table per parameter: a line per claim, a column per value (* the preset's)."""
    out = []
    for panel in m["panels"]:
        out.append(f"Fig. {panel['figure']}  {panel['key']}  (* the preset's value; source: {panel['source']})")
        if not panel["claims"]:
            out.append("  no verdicts: " + "; ".join(dict.fromkeys(e for e in panel["errors"] if e)))
        else:
            lines = [[name, paper_text(panel['paper'][name])] + [cell_text(c) for c in cells]
                     for name, cells in panel["claims"].items()]
            out.append(format_columns(["claim", "paper"] + _heads(panel), lines))
        out.append("")
    out += [f"note: {n}" for n in m["notes"]]
    return "\n".join(out)


def markdown(m: dict) -> str:
    out = ["# The claims map (`chm hymcache sweep --claims`)", "",
           f"Each cell: one `simulate` of the figure's preset with the one parameter at the column's value, every "
           f"tier; the verdict and the measured number. Rule: {m['rule']}. `*`: the preset's own value.", "",
           "| figure | setting | values | source | what the paper leaves open |", "|---|---|---|---|---|"]
    out += [f"| {p['figure']} | `{p['key']}` | {', '.join(_heads(p))} | {p['source']} | {p['open']} |"
            for p in m["panels"]]
    for panel in m["panels"]:
        out += ["", f"## Fig. {panel['figure']}: `{panel['key']}`", ""]
        if not panel["claims"]:
            out.append("No verdicts: " + "; ".join(dict.fromkeys(e for e in panel["errors"] if e)))
            continue
        out += ["| claim | paper | " + " | ".join(_heads(panel)) + " |", "|---" * (len(panel["values"]) + 2) + "|"]
        out += [f"| `{name}` | {paper_text(panel['paper'][name])} | " + " | ".join(cell_text(c) for c in cells) + " |"
                for name, cells in panel["claims"].items()]
        errors = [f"{value_text(panel['key'], v)}: {e}" for v, e in zip(panel["values"], panel["errors"]) if e]
        if errors:
            out += ["", "Points the simulator refused: " + "; ".join(errors)]
    out += ["", "## Notes", ""] + [f"* {n}" for n in m["notes"]]
    return "\n".join(out) + "\n"


def plot_map(m: dict, path: Path) -> None:
    """One panel per parameter: x its values, y its figure's claims; green holds, red fails, grey no verdict; the
    measured number in the cell; the preset's value outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    panels = m["panels"]
    heights = [max(1, len(p["claims"])) + 1.2 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.45 * sum(heights) + 0.6),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    colours = ListedColormap(["#e8a0a0", "#9fd49f", "#cccccc"])  # fails, holds, no verdict
    for ax, panel in zip(axes[:, 0], panels):
        names = list(panel["claims"]) or ["(no verdicts)"]
        grid = [[2 if c["holds"] is None else int(c["holds"]) for c in panel["claims"].get(n, [])] or
                [2] * len(panel["values"]) for n in names]
        ax.imshow(grid, cmap=colours, vmin=0, vmax=2, aspect="auto")
        for y, n in enumerate(names):
            for x, c in enumerate(panel["claims"].get(n, [])):
                ax.text(x, y, cell_text(c), ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(panel["values"])), _heads(panel), fontsize=8)
        ax.set_yticks(range(len(names)), [f"{n} (paper {paper_text(panel['paper'][n])})" if n in panel["paper"] else n
                                          for n in names], fontsize=7)
        if panel["preset"] in panel["values"]:
            x = panel["values"].index(panel["preset"])
            ax.add_patch(Rectangle((x - 0.5, -0.5), 1, len(names), fill=False, edgecolor="black", linewidth=2))
        ax.set_title(f"Fig. {panel['figure']}: {panel['key']} ({panel['open']}; * and outlined: the preset)",
                     fontsize=8)
    fig.suptitle("chm hymcache sweep --claims: where each claim holds (green) or fails (red)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_map(m: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "claims_map.json", out / "claims_map.md", out / "claims_map.png"]
    paths[0].write_text(json.dumps(m, indent=1) + "\n")
    paths[1].write_text(markdown(m))
    plot_map(m, paths[2])
    return paths


def claims_map(figs: list[str] | None = None, keys: list[str] | None = None, scheduler: str | None = None,
               workers: int | None = None, progress: bool = True, overrides: dict[str, Any] | None = None,
               announce: bool = False) -> dict:
    """The map of ``select(figs, keys)``: every distinct point one Dask task (``run_point``); ``announce``: say
    on stdout how many and where first."""
    from host_runtime.replay.sweep import cluster_text

    parameters = select(figs, keys)
    specs, where = point_specs(parameters, overrides)
    if announce:
        print(f"claims map: {len(parameters)} parameters, {len(where)} points ({len(specs)} distinct simulations) "
              f"on {cluster_text(len(specs), scheduler, workers)}", flush=True)
    records = run_tasks(run_point, specs, scheduler, workers, progress, desc="chm hymcache sweep --claims")
    return build_map(parameters, where, records)


def main(args) -> int:
    """``chm hymcache sweep --claims`` (``sweep.py`` parses). The setting flags, --sweep and --preset are refused:
    the map runs the presets, one parameter changed at a time."""
    from common.cli import UsageError

    from .cli import flag_settings

    given = [BY_KEY[key].flag for key in flag_settings(args)]
    for flag, bad in (("--sweep", args.sweep), ("--preset", args.preset), (", ".join(given), given)):
        if bad:
            raise UsageError(f"--claims runs each figure's preset with one parameter changed at a time: {flag} "
                             f"would change it; give none")
    figs = [f.strip() for f in args.figure.split(",") if f.strip()] if args.figure else None
    try:
        select(figs, args.parameter or None)  # bad input fails here, before any cluster starts
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    skipped = [f for f in figures() if f not in claim_figures()]
    if skipped and not figs:
        print(f"claims map: Fig. {', '.join(skipped)} not run: no claim of claims.py is judged there", file=sys.stderr)
    m = claims_map(figs, args.parameter or None, args.scheduler, args.workers, not args.no_progress, announce=True)
    print(format_map(m))
    if args.out:
        paths = write_map(m, args.out)
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
