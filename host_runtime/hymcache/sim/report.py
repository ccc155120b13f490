"""The table on stdout and the PNG (one line per tier, as the paper's figures)."""

from __future__ import annotations

COLUMNS = [("tier", "tier", 13, "s"), ("turn", "turn", 4, "d"), ("hit %", "hit_rate", 6, "%"),
           ("gpu hit %", "gpu_hit_rate", 9, "%"), ("TTFT p50 ms", "ttft_p50_ms", 11, ".0f"),
           ("TTFT p99 ms", "ttft_p99_ms", 11, ".0f"), ("e2e ms", "e2e_ms", 8, ".0f"),
           ("read GB/s", "read_gbps", 9, ".2f"), ("loading GB/s", "read_gbps_loading", 12, ".2f"),
           ("peak GB/s", "read_gbps_peak", 9, ".2f"), ("write GB/s", "write_gbps", 10, ".2f"),
           ("skipped", "skipped_inserts", 7, "d"), ("recomputed tok", "recomputed_tokens", 14, "d"),
           ("turn s", "turn_s", 7, ".1f")]


def _cell(value, fmt: str, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if fmt == "%":
        return f"{100 * value:>{width}.1f}"
    if fmt == "s":
        return f"{value:<{width}}"
    return f"{value:>{width}{fmt}}"


def table(result: dict) -> str:
    tw = max([13] + [len(r["tier"]) for r in result["rows"]])  # labels of a staging sweep: tier@SIZE
    columns = [(h, k, tw if k == "tier" else w, f) for h, k, w, f in COLUMNS]
    lines = ["  ".join(f"{h:<{w}}" if f == "s" else f"{h:>{w}}" for h, _, w, f in columns)]
    prev = None
    for row in result["rows"]:
        if prev is not None and row["tier"] != prev:
            lines.append("")
        prev = row["tier"]
        lines.append("  ".join(_cell(row[k], f, w) for _, k, w, f in columns))
    lines.append("")
    lines.append(f"{'tier':<{tw}}  {'makespan s':>10}  {'TTFT mean ms':>12}  {'TTFT p99 ms':>11}  {'skipped':>7}  "
                 f"{'recomputed tok':>14}  {'read GB/s loading':>17}  {'sim wall s':>10}")
    for name, sm in result["summary"].items():
        lines.append(f"{name:<{tw}}  {sm['makespan_s']:>10.1f}  {sm['ttft_mean_ms']:>12.0f}  {sm['ttft_p99_ms']:>11.0f}  "
                     f"{sm['skipped_inserts']:>7d}  {sm['recomputed_tokens']:>14d}  {sm.get('read_gbps_loading', 0):>17.2f}  "
                     f"{sm.get('wall_s', 0):>10.1f}")
    for name, x in result["speedups"].items():
        lines.append(f"speedup {name.replace('_', ' ')}: {x:.2f}x (makespan ratio)")
    w = result["workload"]
    if w.get("trace"):  # a Mooncake trace: rows are windows of arrival time
        lines.append(f"workload: {w['requests']} trace requests (a row per window of arrivals); KV of its distinct "
                     f"blocks {w['kv_footprint_bytes'] / 1e9:.1f} GB, reused by a later request "
                     f"{w['reusable_footprint_bytes'] / 1e9:.1f} GB")
    else:
        lines.append(f"workload: {w['requests']} requests; KV of the last turn's histories "
                     f"{w['kv_footprint_bytes'] / 1e9:.1f} GB, reused by the last turn "
                     f"{w['reusable_footprint_bytes'] / 1e9:.1f} GB")
    return "\n".join(lines)


def plot(result: dict, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = list(dict.fromkeys(r["tier"] for r in result["rows"]))
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    panels = [("ttft_mean_ms", "mean TTFT (s)", 1e-3), ("ttft_p99_ms", "p99 TTFT (s)", 1e-3),
              ("hit_rate", "hit rate (%): remote loads / requested beyond the GPU", 100),
              ("reuse_rate", "reuse (%): GPU hits + remote loads / reusable", 100)]
    for ax, (key, label, scale) in zip(axes, panels):
        for t in tiers:
            rows = [r for r in result["rows"] if r["tier"] == t]
            xs = [r["turn"] for r in rows if r[key] is not None]
            ys = [r[key] * scale for r in rows if r[key] is not None]
            ax.plot(xs, ys, marker="o", label=t)
        ax.set_xlabel("turn")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[2].set_ylim(-2, 102)
    axes[3].set_ylim(-2, 102)
    axes[0].legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
