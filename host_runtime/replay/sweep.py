"""``chm replay --sweep``: a grid of replays, one Dask task per grid point.

    chm replay microbench --block-bytes 64MiB --sweep variant=lru,hymcache --sweep dram=32GiB,64GiB
    chm replay microbench --sweep dram=16GiB,32GiB --scheduler tcp://HOST:8786   # a running cluster

Each ``--sweep FIELD=V1,V2,...`` is one axis; the grid is their product, in the order given. A point is
the command's own arguments with the point's values put in (``variant`` is ``--policy``, ``dram`` is
``--set dram.size_bytes``, ...), replayed by :func:`run_point` -- the same code a plain ``chm replay``
runs -- as one task on Dask distributed: a ``LocalCluster`` of ``--workers`` single-threaded worker
processes by default, or the scheduler ``--scheduler`` names (its workers must import this package and
read any trace file at the same path). Results come back in grid order: one table, ``sweep.json`` and
``sweep.png`` (``--out``).

The Dask plumbing (``run_tasks``: a cluster, one task per spec, progress, results in spec order), the grid
(``grid``) and the point labels (``point_label``, ``fmt_value``) are shared with ``chm hymcache sweep``
(``host_runtime/hymcache/sim/sweep.py``): one definition.
"""

from __future__ import annotations

import itertools
import logging
import os
from argparse import Namespace
from pathlib import Path
from typing import Any

from common.cli import UsageError, int_at_least
from common.units import parse_bytes
from emulator.config import FIELDS_BY_KEY, parse_field_value
from emulator.errors import ConfigError

from .driver import VARIANTS
from .runs import configs, replay_results

# shorthand -> (what it sets, help)
SHORTHANDS: dict[str, tuple[str, str]] = {
    "variant": ("policy", f"how requests use the device (--policy): {', '.join(VARIANTS)}"),
    "device_policy": ("device_policy", "the device's DRAM policy (--device-policy; config policy.name)"),
    "dram": ("dram.size_bytes", "device DRAM (--set dram.size_bytes), a byte count such as 32GiB"),
    "write_buffer": ("policy.write_buffer_fraction",
                     "hymcache: the write buffer's share of DRAM, the rest is read staging (policy.write_buffer_fraction)"),
    "block": ("block_bytes", "KV block bytes (--block-bytes), e.g. 16MiB"),
    "workload": ("trace", "TRACE_OR_GENERATOR: a generator name or a trace file"),
}
WALL_FIELDS = ("speed",)  # what differs between two runs of the same point: wall and CPU time, peak RSS


def sweep_fields_help() -> str:
    return "; ".join(f"{name}: {text}" for name, (_, text) in SHORTHANDS.items()) + \
        "; or any profile field KEY as --set takes it (e.g. policy.flush_batch_bytes)"


def _profile_value(key: str, text: str, where: str) -> Any:
    """A profile field's value from the command line, checked as the config checks it."""
    field = FIELDS_BY_KEY[key]
    if field.kind is int and key.endswith("_bytes"):
        value: Any = parse_bytes(text, where)
    else:
        value = parse_field_value(text)
    try:
        return field.check(value, where)
    except ConfigError as exc:
        raise ValueError(exc.message if hasattr(exc, "message") else str(exc)) from None


def split_axis(item: str, axes: dict, shorthands: dict, keys, example: str, such_as: str,
               keys_are: str) -> tuple[str, list[str]]:
    """One ``--sweep FIELD=V1,V2,...`` item: (FIELD, its value texts). FIELD is a shorthand (``shorthands[name][0]``
    is the setting it sets) or one of ``keys``; ``axes``, the axes given before it, must not set the same setting.
    A bad item is a UsageError naming the field and what is allowed."""
    name, sep, values = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise UsageError(f"--sweep {item!r} must be FIELD=V1,V2,... (e.g. {example}); fields: "
                         f"{', '.join(shorthands)} or {such_as}")
    if name not in shorthands and name not in keys:
        raise UsageError(f"--sweep {name}: unknown field; allowed: {', '.join(shorthands)}, or {keys_are}: "
                         f"{', '.join(keys)}")

    def target(a: str) -> str:
        return shorthands[a][0] if a in shorthands else a

    if target(name) in (target(a) for a in axes):
        raise UsageError(f"--sweep {name} is given twice (or as both its shorthand and {target(name)}): give one axis")
    texts = [v.strip() for v in values.split(",") if v.strip()]
    if not texts:
        raise UsageError(f"--sweep {name}= names no value")
    return name, texts


def parse_sweep(items: list[str], generators: tuple[str, ...] = ()) -> dict[str, list]:
    """``["dram=16GiB,32GiB", "variant=lru,hymcache"]`` -> ``{"dram": [17179869184, 34359738368], ...}``.

    A bad item is a UsageError naming the field, the value and what is allowed."""
    axes: dict[str, list] = {}
    for item in items:
        name, texts = split_axis(item, axes, SHORTHANDS, FIELDS_BY_KEY, "dram=16GiB,32GiB",
                                 "a profile field such as policy.flush_batch_bytes", "a profile field")
        parsed = []
        for text in texts:
            where = f"--sweep {name}"
            try:
                if name == "variant":
                    if text not in VARIANTS:
                        raise ValueError(f"{where}: {text!r} is not one of {', '.join(VARIANTS)}")
                    value: Any = text
                elif name == "device_policy":
                    value = _profile_value("policy.name", text, where)
                elif name == "block":
                    value = parse_bytes(text, where)
                elif name == "workload":
                    if text not in generators and not Path(text).is_file():
                        raise ValueError(f"{where}: {text!r} is neither a file nor one of {', '.join(generators)}")
                    value = text
                else:
                    value = _profile_value(SHORTHANDS[name][0] if name in SHORTHANDS else name, text, where)
            except ValueError as exc:
                message = str(exc)
                raise UsageError(message if message.startswith(where) else f"{where}: {message}") from None
            if value in parsed:
                raise UsageError(f"--sweep {name}: {text!r} is given twice")
            parsed.append(value)
        axes[name] = parsed
    return axes


def grid(axes: dict[str, list]) -> list[dict]:
    """The product of the axes, the first given varying slowest."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))]


def point_args(args: dict, point: dict) -> dict:
    """The command's arguments (``vars(args)``, picklable) with the point's values put in."""
    out = {k: v for k, v in args.items() if not callable(v) and not k.startswith("_")}
    out["set"] = list(args.get("set") or [])
    out["compare"] = None
    for name, value in point.items():
        target = SHORTHANDS[name][0] if name in SHORTHANDS else name
        if target == "policy":
            out["policy"] = value
        elif target == "device_policy":
            out["device_policy"] = [value]
        elif target == "block_bytes":
            out["block_bytes"] = str(value)
        elif target == "trace":
            out["trace"] = value
        else:  # a profile field: a --set of its value as TOML (strings quoted)
            out["set"].append(f"{target}={value!r}" if isinstance(value, str) else f"{target}={value}")
    out["progress"] = False
    return out


def run_point(spec: dict) -> dict:
    """One grid point, replayed as ``chm replay`` would with these arguments (in a Dask worker, or here)."""
    args = Namespace(**spec["args"])
    result = replay_results(args, progress=False)[0]
    result["point"] = spec["point"]
    return result


def check_points(args: Namespace, points: list[dict]) -> list[dict]:
    """Every point's task spec, its profile built here first, so a bad value fails before any task runs."""
    specs = []
    for point in points:
        spec = {"point": point, "args": point_args(vars(args), point)}
        try:
            configs(Namespace(**spec["args"]))
        except (ValueError, ConfigError) as exc:
            raise UsageError(f"--sweep point {point_label(point)}: {exc}") from None
        specs.append(spec)
    return specs


def point_label(point: dict, byte_names: tuple[str, ...] = ("dram", "block")) -> str:
    """``name=value ...``: the point's values as given (``fmt_value``)."""
    return " ".join(f"{k}={fmt_value(v, k, byte_names)}" for k, v in point.items())



def fmt_value(value, name: str = "", byte_names: tuple[str, ...] = ("dram", "block")) -> str:
    """A point's value as given: byte counts (axes ``byte_names``, fields ``*_bytes``) with their binary unit."""
    if (name in byte_names or name.endswith("_bytes")) and isinstance(value, int):
        for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    return str(value)



def local_workers(points: int, workers: int | None = None) -> int:
    """A LocalCluster's worker processes: ``workers``, else one per point up to the CPUs."""
    return workers or min(points, os.cpu_count() or 1)


def cluster_text(points: int, scheduler: str | None = None, workers: int | None = None) -> str:
    """Where the tasks run, for the sweep's first line."""
    if scheduler:
        return f"the scheduler {scheduler}"
    return f"a LocalCluster of {local_workers(points, workers)} single-threaded workers"


def run_tasks(fn, specs: list, scheduler: str | None = None, workers: int | None = None, progress: bool = True,
              desc: str = "sweep") -> list:
    """``fn(spec)`` for every spec, each one Dask task: on the scheduler ``scheduler`` names, else on a
    ``LocalCluster`` of ``workers`` single-threaded worker processes (default: one per spec up to the CPUs),
    closed at the end. A progress bar of points on stderr. The results in spec order; a task's exception
    is raised here. ``fn`` must be importable by the workers (a module-level function)."""
    from distributed import Client, LocalCluster, as_completed
    from tqdm import tqdm

    if scheduler:
        client, cluster = Client(scheduler, timeout="30s"), None
    else:
        cluster = LocalCluster(n_workers=local_workers(len(specs), workers), threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.ERROR)
        client = Client(cluster)
    try:
        futures = client.map(fn, specs, pure=False)
        bar = tqdm(total=len(futures), unit="point", desc=desc, disable=not progress)
        for future in as_completed(futures):
            if future.status == "error":
                future.result()  # raises the task's exception
            bar.update(1)
        bar.close()
        return client.gather(futures)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def run_sweep(specs: list[dict], scheduler: str | None = None, workers: int | None = None,
              progress: bool = True) -> list[dict]:
    """Every replay spec as one Dask task (``run_point``); the results in spec order."""
    return run_tasks(run_point, specs, scheduler, workers, progress)


def format_columns(head: list[str], lines: list[list[str]]) -> str:
    """A table: the header, a rule, the lines; every column right-aligned to its widest cell."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


# ---- report ---------------------------------------------------------------------------------
SWEEP_COLUMNS = (  # header, key of the result's total row, format
    ("read GB/s", "read_gbps", "{:.2f}"),
    ("hit %", "hit_rate", "{:.1%}"),
    ("blk read", "blocks_read", "{:d}"),
    ("refused", "refused_writes", "{:d}"),
    ("recomp blk", "recomputed_blocks", "{:d}"),
    ("read s", "read_s", "{:.2f}"),
    ("recomp s", "recompute_s", "{:.2f}"),
    ("serve s", "serve_s", "{:.2f}"),
)


def format_sweep(results: list[dict]) -> str:
    """One line per grid point: its values, then its totals and its wall time."""
    names = list(results[0]["point"])
    head = names + [c[0] for c in SWEEP_COLUMNS] + ["wall s"]
    lines = [[fmt_value(r["point"][n], n) for n in names] + [fmt.format(r["total"][key]) for _, key, fmt in SWEEP_COLUMNS]
             + [f"{r['speed']['wall_s']:.1f}"] for r in results]
    return format_columns(head, lines)


def plot_sweep(results: list[dict], path: Path, title: str = "") -> None:
    """Per grid point: the device read time and the recomputation on top (serve time), and read bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [point_label(r["point"]) for r in results]
    ys = range(len(results))
    read = [r["total"]["read_s"] for r in results]
    recompute = [r["total"]["recompute_s"] for r in results]
    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(10, 1.2 + 0.45 * len(results)), sharey=True,
                                      gridspec_kw={"width_ratios": [2, 1]})
    ax_t.barh(ys, read, label="device read")
    ax_t.barh(ys, recompute, left=read, label="recomputation (prefill)")
    ax_t.set_yticks(list(ys), labels, fontsize=8)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("serve time, all turns / windows (s)")
    ax_t.legend(fontsize=8)
    ax_t.grid(axis="x", alpha=0.3)
    ax_bw.barh(ys, [r["total"]["read_gbps"] for r in results], color="grey")
    ax_bw.axvline(results[0]["link_gbps"], color="black", linestyle="--", linewidth=1)
    ax_bw.set_xlabel("read GB/s (link dashed)")
    ax_bw.grid(axis="x", alpha=0.3)
    fig.suptitle(title or f"sweep: {results[0]['workload']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep(results: list[dict], out_dir: str | Path, title: str = "", plot=None,
                png: bool = True) -> tuple[Path, Path | None]:
    """``sweep.json`` (the results) and (``png``) ``sweep.png`` (``plot(results, path, title)``; default this
    module's ``plot_sweep``) in ``out_dir``: their paths, None for a plot not drawn."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "sweep.json", out / "sweep.png"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    if not png:
        return json_path, None
    (plot or plot_sweep)(results, png_path, title)
    return json_path, png_path


def add_dask_args(group, what: str = "") -> None:
    """The options choosing where a sweep's tasks run: ``--scheduler`` and ``--workers``."""
    group.add_argument("--scheduler", metavar="tcp://HOST:8786",
                       help=f"{what}a running Dask scheduler (default: a LocalCluster on this machine)")
    group.add_argument("--workers", type=int_at_least(1),
                       help=f"{what}LocalCluster worker processes, one thread each (default: min(points, CPUs))")
