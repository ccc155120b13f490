"""``chm hymcache sweep``: a grid of serving simulations, one Dask task per point.

    chm hymcache sweep --figure 13 --sweep tier=hymcache,lmcache-local --sweep dram=32GiB,64GiB --out sw
    chm hymcache sweep --figure 10 --sweep staging=10GiB,40GiB --scheduler tcp://HOST:8786   # a running cluster

Each ``--sweep FIELD=V1,V2,...`` is one axis; the grid is their product, the first given varying slowest.
Axes: ``tier`` (the one tier a point runs), ``dram`` (``tiers.dram``), ``staging`` (``tiers.staging``),
``workload`` (``workload.kind``: lmsys, aiperf, mooncake), ``conversations``, ``figure`` (the preset a point
starts from), or any setting by its key (``workload.concurrency``, ``hymcache.window_bytes``, ...). Without a
``tier`` axis every tier of the point's ``tiers.run`` (the preset's, or ``--tiers``) is a point of its own; a
preset with a staging sweep of its own (Fig. 12) gives the staging axis when no ``staging`` axis is given.

A point is one ``simulate`` of one tier (``run.simulate_tier``, the code ``chm hymcache simulate`` runs) on
the settings ``chm hymcache simulate`` would use -- the preset, then the flags, then the point's values --
run by :func:`run_point` as one task on Dask distributed, through the replayer's sweep plumbing
(``host_runtime/replay/sweep.py`` ``run_tasks``: a ``LocalCluster`` of ``--workers`` single-threaded worker
processes by default, or the scheduler ``--scheduler`` names, whose workers must import this package and
read any trace file at the same path). Every point's settings are checked here first, so a bad value
fails before any task runs. Results come back in grid order: one table, ``sweep.json`` and ``sweep.png``
(``--out``).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

from common.checks import outside
from host_runtime.replay.sweep import (add_dask_args, cluster_text, fmt_value, format_columns, grid, point_label,
                                      run_tasks, split_axis, write_sweep)

from .config import BY_KEY, FIELDS, Field, check, check_settings, preset_path, trace_path
from .tiers import TIERS

# shorthand -> (the setting it sets, help); "figure" picks the preset
AXES: dict[str, tuple[str, str]] = {
    "tier": ("tiers.run", f"the one tier a point runs: {', '.join(TIERS)} (default: each of the point's --tiers)"),
    "dram": ("tiers.dram", "the DRAM budget (tiers.dram): LMCache's local DRAM, the HyMCache / CMM-H device's"),
    "staging": ("tiers.staging", "host staging buffer per node (tiers.staging)"),
    "workload": ("workload.kind", "the workload (workload.kind): lmsys, aiperf, mooncake"),
    "conversations": ("workload.conversations", "conversations (workload.conversations)"),
    "figure": ("figure", "the preset a point starts from (presets/figN.toml), before the flags and the point's values"),
}
TIER_FIELD = Field("tiers.run", "choice", choices=TIERS)  # one tier per point
SWEEPABLE = [f for f in FIELDS if f.kind not in ("tiers", "byteslist")]  # lists are not values of one point
WALL_FIELDS = ("wall_s",)  # what differs between two runs of the same point


def axes_help() -> str:
    return "; ".join(f"{name}: {text}" for name, (_, text) in AXES.items()) + \
        "; or any setting by its key (e.g. workload.concurrency, hymcache.window_bytes)"


def _figures() -> list[str]:
    return sorted((p.stem[3:] for p in preset_path(13).parent.glob("fig*.toml")), key=lambda n: (len(n), n))


def _target(name: str) -> str:
    return AXES[name][0] if name in AXES else name


def _field(name: str) -> Field | None:
    target = _target(name)
    if target == "tiers.run":
        return TIER_FIELD
    return BY_KEY.get(target)


def parse_axes(items: list[str]) -> dict[str, list]:
    """``["tier=hymcache,cmm-h", "dram=32GiB,64GiB"]`` -> ``{"tier": ["hymcache", "cmm-h"], "dram": [...]}``.

    A bad item is a UsageError naming the field, the value and what is allowed (``chm replay --sweep``'s
    convention)."""
    from common.cli import UsageError

    axes: dict[str, list] = {}
    for item in items:
        name, texts = split_axis(item, axes, AXES, [f.key for f in SWEEPABLE], "dram=32GiB,64GiB",
                                 "a setting such as workload.concurrency", "a setting")
        target = _target(name)
        where = f"--sweep {name}"
        parsed: list[Any] = []
        for text in texts:
            if target == "figure":
                known = _figures()
                if text not in known:
                    raise UsageError(outside(where, text, f"one of {', '.join(known)} (the presets)"))
                value: Any = text
            else:
                try:
                    value = check(_field(name), text, where)
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
            if value in parsed:
                raise UsageError(f"{where}: {text!r} is given twice")
            parsed.append(value)
        axes[name] = parsed
    return axes


def _conflicts(args, axes: dict[str, list], flags: dict[str, Any]) -> None:
    """An axis and a flag that both choose the same setting: a UsageError."""
    from common.cli import UsageError

    for name in axes:
        target = _target(name)
        if target == "figure":
            if args.preset or args.figure is not None:
                raise UsageError(f"--sweep figure and {'--preset' if args.preset else '--figure'} both choose the "
                                 f"preset: give one")
            continue
        if target in flags:
            raise UsageError(f"--sweep {name} and {BY_KEY[target].flag} both choose it: give one")
        if target == "tiers.staging" and "sweep.staging" in flags and flags["sweep.staging"]:
            raise UsageError(f"--sweep {name} and --staging-sweep both choose the staging size: give one")


def point_specs(args, axes: dict[str, list]) -> list[dict]:
    """Every point's task spec ({"point", "settings"}), in grid order, its settings checked here first: a bad
    point is a UsageError naming it."""
    from common.cli import UsageError

    from .cli import flag_settings, preset_settings

    flags = flag_settings(args)
    _conflicts(args, axes, flags)
    presets: dict[str | None, dict] = {}
    specs = []
    for explicit in grid(axes):
        figure = explicit.get("figure")
        if figure not in presets:
            presets[figure] = {**preset_settings(args, figure), **flags}
        base = presets[figure]
        tiers = [explicit["tier"]] if "tier" in explicit else base["tiers.run"]
        sizes = [None] if "staging" in explicit or "tiers.staging" in explicit else (base["sweep.staging"] or [None])
        for tier in tiers:
            for size in sizes:
                point = explicit if "tier" in explicit else {"tier": tier, **explicit}
                if size is not None:
                    point = {**point, "staging": size}
                specs.append({"point": point, "settings": _settings(base, point)})
    for spec in specs:
        try:
            check_settings(spec["settings"])
            s = spec["settings"]
            if s["workload.kind"] == "mooncake":  # the workers read the trace at this path
                s["workload.trace"] = str(trace_path(s).resolve())
        except ValueError as exc:
            raise UsageError(f"--sweep point {label(spec['point'])}: {exc}") from None
    return specs


def _settings(base: dict, point: dict) -> dict:
    s = dict(base)
    for name, value in point.items():
        target = _target(name)
        if target == "figure":
            continue
        s[target] = [value] if target == "tiers.run" else value
    s["sweep.staging"] = []  # a point runs one staging size
    return s


def label(point: dict) -> str:
    return point_label(point, _byte_names(point))


def _byte_names(point: dict) -> tuple[str, ...]:
    return tuple(n for n in point if (f := _field(n)) is not None and f.kind == "bytes")


def run_point(spec: dict) -> dict:
    """One grid point: ``simulate_tier`` of its tier on its settings (in a Dask worker, or here). A bad setting
    that only the run finds (a DRAM too small for one chunk, ...) is a ValueError naming the point."""
    from .run import simulate_tier

    s = spec["settings"]
    try:
        result = simulate_tier(s["tiers.run"][0], s)
    except ValueError as exc:
        raise ValueError(f"--sweep point {label(spec['point'])}: {exc}") from None
    result["point"] = spec["point"]
    return result


def run_sweep(specs: list[dict], scheduler: str | None = None, workers: int | None = None,
              progress: bool = True) -> list[dict]:
    """Every spec as one Dask task (``run_point``); the results in spec order."""
    return run_tasks(run_point, specs, scheduler, workers, progress, desc="chm hymcache sweep")


# ---- report ---------------------------------------------------------------------------------
def hit_rate(rows: list[dict]) -> float | None:
    """Over the rows (run.py's definition): remote loads / requested beyond the GPU; gpu-prefix: its own hits."""
    reusable = sum(r["reusable_tokens"] for r in rows)
    gpu = sum(r["gpu_hit_tokens"] for r in rows)
    if rows and rows[0]["base_tier"] == "gpu-prefix":
        return gpu / reusable if reusable else None
    requested = reusable - gpu
    return sum(r["loaded_tokens"] for r in rows) / requested if requested else None


COLUMNS = (  # header, value of a result, format
    ("makespan s", lambda r: r["summary"]["makespan_s"], "{:.1f}"),
    ("TTFT mean ms", lambda r: r["summary"]["ttft_mean_ms"], "{:.0f}"),
    ("TTFT p99 ms", lambda r: r["summary"]["ttft_p99_ms"], "{:.0f}"),
    ("hit %", lambda r: hit_rate(r["rows"]), "{:.1%}"),
    ("hit % last", lambda r: r["rows"][-1]["hit_rate"], "{:.1%}"),
    ("skipped", lambda r: r["summary"]["skipped_inserts"], "{:d}"),
    ("recomputed tok", lambda r: r["summary"]["recomputed_tokens"], "{:d}"),
    ("loading GB/s", lambda r: r["summary"]["read_gbps_loading"], "{:.2f}"),
    ("peak GB/s", lambda r: r["summary"]["read_gbps_peak"], "{:.2f}"),
    ("wall s", lambda r: r["summary"]["wall_s"], "{:.1f}"),
)


def format_sweep(results: list[dict]) -> str:
    """One line per grid point: its values, then its summary."""
    names = list(dict.fromkeys(n for r in results for n in r["point"]))
    head = names + [c[0] for c in COLUMNS]
    lines = []
    for r in results:
        bytes_names = _byte_names(r["point"])
        cells = [fmt_value(r["point"][n], n, bytes_names) if n in r["point"] else "" for n in names]
        for _, get, fmt in COLUMNS:
            value = get(r)
            cells.append("-" if value is None else fmt.format(value))
        lines.append(cells)
    return format_columns(head, lines)


def plot_sweep(results: list[dict], path: Path, title: str = "") -> None:
    """Per point: makespan (bars), mean TTFT and hit rate per turn (one line per point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label(r["point"]) for r in results]
    ys = range(len(results))
    fig, (ax_m, ax_t, ax_h) = plt.subplots(1, 3, figsize=(17, 1.8 + 0.4 * len(results)),
                                           gridspec_kw={"width_ratios": [1.3, 1, 1]})
    ax_m.barh(ys, [r["summary"]["makespan_s"] for r in results], color="grey")
    ax_m.set_yticks(list(ys), labels, fontsize=8)
    ax_m.invert_yaxis()
    ax_m.set_xlabel("makespan (s, simulated)")
    ax_m.grid(axis="x", alpha=0.3)
    for r, lab in zip(results, labels):
        turns = [row["turn"] for row in r["rows"]]
        ax_t.plot(turns, [row["ttft_mean_ms"] / 1e3 for row in r["rows"]], marker="o", markersize=3, label=lab)
        hits = [(row["turn"], 100 * row["hit_rate"]) for row in r["rows"] if row["hit_rate"] is not None]
        ax_h.plot([t for t, _ in hits], [h for _, h in hits], marker="o", markersize=3, label=lab)
    ax_t.set_xlabel("turn (a trace: window)")
    ax_t.set_ylabel("mean TTFT (s)")
    ax_t.grid(alpha=0.3)
    ax_h.set_xlabel("turn (a trace: window)")
    ax_h.set_ylabel("hit rate (%)")
    ax_h.set_ylim(-2, 102)
    ax_h.grid(alpha=0.3)
    if len(results) <= 12:
        ax_h.legend(fontsize=7)
    fig.suptitle(title or f"chm hymcache sweep: {len(results)} points", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------
EPILOG = """\
Each point is one `chm hymcache simulate` of one tier: the preset (--figure / --preset, or the point's figure),
then the setting flags, then the point's values. Axes and flags that choose the same setting are an error, as is
a value out of its range (named with the field, the value and the range). Output: one line per point (makespan,
TTFT, hit rate over all turns and the last, skipped insertions, recomputed tokens, read bandwidth while
loading and its peak, wall time), a progress bar of points on stderr, --out DIR: sweep.json (every point's
rows, summary and details) and sweep.png.

examples:
  chm hymcache sweep --figure 13                                   # every tier of Fig. 13, one task each
  chm hymcache sweep --figure 13 --sweep tier=hymcache,lmcache-local --sweep dram=32GiB,64GiB,128GiB --out sw
  chm hymcache sweep --figure 12 --tiers mooncake-dram,hymcache    # Fig. 12's staging sizes as the staging axis
  chm hymcache sweep --sweep figure=13,15 --sweep tier=hymcache --conversations 128
  chm hymcache sweep --figure 13 --sweep workload=lmsys,mooncake --trace-limit 1000 --tiers hymcache
  chm hymcache sweep --figure 15 --sweep workload.concurrency=32,64,128 --scheduler tcp://HOST:8786
  chm hymcache sweep --claims --out map --workers 2                # the claims map: every open parameter
  chm hymcache sweep --claims --figure 13,14 --parameter redis.gbps    # a part of it

--claims: for each parameter the paper leaves open (host_runtime/hymcache/sim/claims_map.py PARAMETERS: figure,
setting, values, source), each value is one task: the figure's preset, every tier, with that one setting changed,
judged by the claims of chm hymcache claims. Output: a table per parameter (claim x value -> holds / FAILS and the
measured number; * the preset's value) and, with --out, claims_map.json, claims_map.md and claims_map.png.
"""


def register(sub) -> None:
    """Add ``sweep`` to the ``chm hymcache`` subcommands."""
    import argparse

    from .cli import add_settings_args

    description = textwrap.fill(
        "Run a grid of serving simulations (tiers x DRAM sizes x staging sizes x workloads, or any setting) as "
        "independent tasks on Dask distributed: a LocalCluster on this machine by default, or a running "
        "cluster's scheduler (--scheduler). Results are gathered into one table and one plot.", 100)
    p = sub.add_parser("sweep", help="a grid of serving simulations on Dask distributed (LocalCluster or --scheduler)",
                       description=description, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("sweep (Dask distributed)")
    g.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2,...",
                   help="an axis of the grid (repeatable; the grid is the product, the first given varying slowest). "
                        "FIELD: " + axes_help())
    g.add_argument("--claims", action="store_true",
                   help="the claims map instead of a grid: every parameter the paper leaves open (claims_map.py "
                        "PARAMETERS), each value one simulate of its figure's preset judged by chm hymcache claims; "
                        "--figure N[,M...] and --parameter narrow it")
    g.add_argument("--parameter", action="append", metavar="KEY",
                   help="with --claims: only this parameter of the map (repeatable), e.g. workload.turn_tokens")
    add_dask_args(g)
    g.add_argument("--out", metavar="DIR", help="write sweep.json and sweep.png here (--claims: claims_map.json, "
                                                ".md and .png)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_settings_args(p.add_argument_group("settings (as chm hymcache simulate)"), figure_default=None)
    p.set_defaults(func=_sweep)


def _sweep(args) -> int:
    from common.cli import UsageError

    if args.scheduler and args.workers is not None:
        raise UsageError("--workers is for the LocalCluster; a --scheduler's cluster has its own workers")
    if args.claims:
        from .claims_map import main as claims_map_main

        return claims_map_main(args)
    if args.parameter:
        raise UsageError("--parameter chooses a parameter of the claims map: give it with --claims")
    axes = parse_axes(args.sweep)
    specs = point_specs(args, axes)
    names = list(dict.fromkeys(n for spec in specs for n in spec["point"]))
    shape = " x ".join(f"{n} {len({spec['point'].get(n) for spec in specs})}" for n in names)
    print(f"sweep: {len(specs)} points ({shape}) on {cluster_text(len(specs), args.scheduler, args.workers)}",
          flush=True)
    results = run_sweep(specs, args.scheduler, args.workers, progress=not args.no_progress)
    print(format_sweep(results))
    wall = sum(r["summary"]["wall_s"] for r in results)
    print(f"{len(results)} points, {wall:.1f} s of simulation wall time in all", file=sys.stderr)
    if args.out:
        json_path, png_path = write_sweep(results, args.out, plot=plot_sweep)
        print(f"wrote {json_path} and {png_path}")
    return 0
