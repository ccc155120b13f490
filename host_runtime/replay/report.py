"""Replay reports: one table, the same as JSON, and a PNG plot (one line per policy)."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = (  # header, key, format
    ("read GB/s", "read_gbps", "{:.2f}"),
    ("write GB/s", "write_gbps", "{:.2f}"),
    ("hit %", "hit_rate", "{:.1%}"),
    ("blk read", "blocks_read", "{:d}"),
    ("blk written", "blocks_written", "{:d}"),
    ("refused", "refused_writes", "{:d}"),
    ("p50 ms", "read_p50_ms", "{:.1f}"),
    ("p99 ms", "read_p99_ms", "{:.1f}"),
    # the cost of what was not served (driver.py's docstring)
    ("recomp blk", "recomputed_blocks", "{:d}"),
    ("recomp s", "recompute_s", "{:.2f}"),
    ("read s", "read_s", "{:.2f}"),
    ("serve s", "serve_s", "{:.2f}"),
)


def run_label(result: dict) -> str:
    """The run's name in tables and plots (results saved before labels existed: their policy)."""
    return result.get("label", result["policy"])


def bucket_title(result: dict) -> str:
    return "window start (s)" if result["bucket_by"] == "time" else "turn"


def format_table(results: list[dict]) -> str:
    """Rows grouped by turn / time window, one line per policy; then the totals."""
    first = results[0]
    head = [bucket_title(first), "policy"] + [c[0] for c in COLUMNS]
    lines = []
    buckets = list(dict.fromkeys(row["bucket"] for r in results for row in r["rows"]))
    for bucket in buckets + ["total"]:
        for r in results:
            row = r["total"] if bucket == "total" else next((x for x in r["rows"] if x["bucket"] == bucket), None)
            if row is None:
                continue
            lines.append([bucket, run_label(r)] + [fmt.format(row[key]) if key in row else "-"
                                                   for _, key, fmt in COLUMNS])  # results saved before a column
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def format_recompute(result: dict) -> str:
    """How unserved blocks are costed: the model, tokens per block, the GPU and its sustained FLOP/s."""
    p = result.get("recompute")
    if p is None:
        return ""
    return (f"recomputation: {p['model']} prefill, {p['tokens_per_block']} tokens/block, on {p['gpus']} x {p['gpu']} "
            f"at {p['mfu']:.0%} of {p['peak_flops'] / 1e12:g} TFLOP/s ({p['gpu_profile']}); serve s = read s + "
            f"recomp s")


def format_summary(result: dict) -> str:
    s, d = result["speed"], result["dram"]
    parts = [f"{run_label(result)}: {s['block_accesses']} block accesses in {s['wall_s']:.1f} s wall "
             f"({s['block_accesses_per_s']:.0f} blocks/s, {s['page_accesses_per_s']:.0f} pages/s), "
             f"{result['virtual_s']:.1f} s virtual, peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB"]
    if result["window_blocks"]:
        parts.append(f"  prefetch window {result['window_blocks']} blocks/request; peak staged "
                     f"{d['peak_staged_bytes'] / 2**30:.2f} GiB (bound {d['window_bound_bytes'] / 2**30:.2f} GiB); "
                     f"peak write buffer {d['peak_write_buffer_bytes'] / 2**30:.2f} of {d['write_buffer_bytes'] / 2**30:.2f} GiB")
    c = result.get("cache")
    if c is not None:
        parts.append(f"  DRAM ({result['device_policy']}): {c['accesses']} page accesses, {c['misses']} misses "
                     f"({c['read_misses']} read + {c['write_misses']} write allocations), "
                     f"miss ratio {c['miss_ratio']:.4f}")
    return "\n".join(parts)


def save_json(results: list[dict], path: Path) -> None:
    path.write_text(json.dumps(results if len(results) > 1 else results[0], indent=1) + "\n")


def plot(results: list[dict], path: Path, title: str = "") -> None:
    """Read bandwidth (top) and DRAM hit rate (bottom) per turn or window, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_hit) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True)
    labels = list(dict.fromkeys(row["bucket"] for r in results for row in r["rows"]))
    x = {label: i for i, label in enumerate(labels)}
    for r in results:
        rows = [row for row in r["rows"] if row["blocks_read"]]  # a write-only turn has no read bandwidth
        xs = [x[row["bucket"]] for row in rows]
        ax_bw.plot(xs, [row["read_gbps"] for row in rows], marker="o", label=f"{run_label(r)} read")
        ax_hit.plot(xs, [100 * row["hit_rate"] for row in rows], marker="o", label=run_label(r))
    ax_bw.axhline(results[0]["link_gbps"], color="grey", linestyle="--", linewidth=1, label="host link")
    ax_bw.set_ylabel("read bandwidth (GB/s)")
    ax_bw.set_ylim(bottom=0)
    ax_bw.legend(fontsize=8)
    ax_bw.grid(alpha=0.3)
    ax_hit.set_ylabel("DRAM hit rate (%)")
    ax_hit.set_ylim(-2, 102)
    ax_hit.set_xlabel(bucket_title(results[0]))
    ax_hit.set_xticks(range(len(labels)), [str(label).replace("turn ", "") for label in labels])
    ax_hit.grid(alpha=0.3)
    fig.suptitle(title or f"{results[0]['workload']['name']} on {results[0]['profile']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: list[dict], out_dir: str | Path, stem: str, title: str = "",
                  png: bool = True) -> tuple[Path, Path | None]:
    """``STEM.json`` and (``png``) ``STEM.png`` in ``out_dir``: their paths, None for a plot not drawn."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    save_json(results, json_path)
    if not png:
        return json_path, None
    plot(results, png_path, title)
    return json_path, png_path


def wrote(*paths: Path | None) -> str:
    """The "wrote ..." line naming the files written (a None path: not written)."""
    return "wrote " + " and ".join(str(p) for p in paths if p is not None)
