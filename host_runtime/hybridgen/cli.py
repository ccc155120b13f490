"""``chm hybridgen generate|similarity|eval|model-perf|kmin``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import json
import sys
from pathlib import Path

from emulator.cli import ChmArgumentParser, UsageError, float_in, int_at_least

from .names import MAPPINGS, METHODS, TIMINGS
from .perfmodel import METHODS as PERF_METHODS
from .perfmodel import list_platforms, load_models

if TYPE_CHECKING:
    from .engine import EngineOptions


def register(sub) -> None:
    p = sub.add_parser("hybridgen", help="HybridGen: CPU-accelerator hybrid attention over tiered memory",
                       description="HybridGen on SmolLM2-135M: generation, accuracy evaluation, layer similarity, "
                                   "K_min profiling and the modelled performance on the paper's platforms.")
    hs = p.add_subparsers(dest="hybridgen_command", metavar="SUBCOMMAND", required=True)
    platforms = list_platforms()
    models = list(load_models())

    g = hs.add_parser("generate", help="greedy generation with per-step stats",
                      description="Generate text greedily with one method and print per-step statistics "
                                  "(K, strategy, CPU/accelerator/transfer times, bytes moved per tier).")
    g.add_argument("--prompt", required=True, help="user prompt (wrapped in the chat template unless --raw)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    g.add_argument("--max-new-tokens", type=int_at_least(1), default=32, help="tokens to generate (default 32)")
    g.add_argument("--json", action="store_true", help="print text and steps as JSON")
    _engine_args(g)
    g.set_defaults(func=_generate)

    s = hs.add_parser("similarity", help="cosine similarity of consecutive layers' inputs (paper Fig. 11)",
                      description="Cosine similarity of consecutive layers' attention inputs on SmolLM2, "
                                  "averaged over the tokens of a text.")
    s.add_argument("--tokens", type=int_at_least(1), default=256, help="tokens of the long English text to run (default 256)")
    s.add_argument("--plot", metavar="PNG", help="also draw the curve into this PNG")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_similarity)

    e = hs.add_parser("eval", help="perplexity, agreement with full attention and passkey accuracy per method",
                      description="One row per method: perplexity on a Debian license text, top-1 agreement with "
                                  "full attention, and passkey retrieval accuracy at several depths.")
    e.add_argument("--methods", default=list(METHODS), type=_method_list, metavar="M1,M2",
                   help=f"comma-separated subset of {', '.join(METHODS)}")
    e.add_argument("--context-tokens", type=int, default=384)
    e.add_argument("--scored-tokens", type=int, default=64)
    e.add_argument("--passkey-tokens", type=int, default=384)
    e.add_argument("--passkey-depths", default=(0.1, 0.5, 0.9), type=_fractions(zero_allowed=True), metavar="D1,D2",
                   help="comma-separated depths in [0, 1]")
    e.add_argument("--json", action="store_true", help="print the rows as JSON")
    _engine_args(e, with_method=False)
    e.set_defaults(func=_eval)

    k = hs.add_parser("kmin", help="profile K_min: accuracy vs retained-KV ratio, pick the knee (paper Fig. 14)",
                      description="Sweep the retained KV ratio, measure top-1 agreement with full attention, "
                                  "and report the inflection point as K_min.")
    k.add_argument("--ratios", default=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0), type=_fractions(zero_allowed=False),
                   metavar="R1,R2", help="comma-separated retained KV ratios in (0, 1]")
    k.add_argument("--context-tokens", type=int, default=384)
    k.add_argument("--scored-tokens", type=int, default=48)
    k.add_argument("--resident-budget", type=int, default=32)
    k.add_argument("--plot", metavar="PNG")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_kmin)

    t = hs.add_parser("schedule", help="Algorithm 1 on a growing sequence (modelled times): K up, down, switch",
                      description="Run the feedback scheduler on a sequence whose offloaded part grows each step, "
                                  "with T_cpu, T_tx, T_gpu from the platform model, and print where it changes course.")
    t.add_argument("--platform", default="A", help=f"{', '.join(platforms)} or a platform TOML path (default A)")
    t.add_argument("--model", default="llama-3.1-8b", choices=models)
    t.add_argument("--resident", type=int_at_least(1), default=1024, help="tokens held by the GPU")
    t.add_argument("--growth", type=int_at_least(1), default=64, help="offloaded tokens added per step")
    t.add_argument("--steps", type=int_at_least(1), default=120)
    t.add_argument("--k-min", type=int_at_least(1), default=64)
    t.add_argument("--k-max", type=int_at_least(1), default=2048)
    t.add_argument("--k-step", type=int_at_least(1), default=32)
    t.add_argument("--plot", metavar="PNG")
    t.set_defaults(func=_schedule)

    m = hs.add_parser("model-perf", help="modelled decode latency per method on platform A, B or C",
                      description="Modelled decode latency per method for the paper's models (no weights needed), "
                                  "normalised to FlexGen, with sequence-length and batch sweeps and "
                                  "semantic-aware vs interleaved KV mapping.")
    m.add_argument("--platform", default="A", help=f"{', '.join(platforms)} or a platform TOML path (default A)")
    m.add_argument("--seq-len", type=int_at_least(1), default=2048)
    m.add_argument("--batch", type=int_at_least(1), default=1)
    m.add_argument("--kv-ratio", type=float_in(0, 1, lo_open=True), default=0.1,
                   help="retained share of offloaded tokens (K_min), (0, 1]")
    m.add_argument("--sweep-model", default="llama-3.1-8b", choices=models,
                   help="model for the sequence-length and batch sweeps")
    m.add_argument("--plot", metavar="PNG", help="draw speedups over FlexGen into this PNG")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_model_perf)


def build_parser_for_tests() -> argparse.ArgumentParser:
    """The ``hybridgen`` parser alone (``chm`` builds the same one through its entry point)."""
    root = ChmArgumentParser(prog="chm")
    register(root.add_subparsers())
    return root._subparsers._group_actions[0].choices["hybridgen"]


def _method_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: {','.join(bad) or 'no method'}; allowed: {', '.join(METHODS)}")
    return names


def _fractions(zero_allowed: bool):
    """An argparse ``type=``: comma-separated numbers in [0, 1] (``zero_allowed``) or (0, 1]."""
    allowed = "[0, 1]" if zero_allowed else "(0, 1]"

    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated numbers in {allowed}") from None
        if any(not ((v >= 0 if zero_allowed else v > 0) and v <= 1) for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be in {allowed}")
        return values
    return parse


def _platform(name: str):
    """A shipped platform or a TOML path: an unknown name is a usage error, a bad file a runtime one."""
    from .perfmodel import load_platform

    if name not in list_platforms() and not Path(name).is_file():
        raise UsageError(f"--platform {name!r} must be one of {', '.join(list_platforms())} or a TOML file")
    try:
        return load_platform(name)
    except KeyError as exc:
        raise ValueError(f"platform file {name}: missing field {exc}") from None
    except (TypeError, ValueError) as exc:  # wrong types, not TOML
        raise ValueError(f"platform file {name}: {exc}") from None


def _engine_args(p, with_method: bool = True) -> None:
    if with_method:
        p.add_argument("--method", default="hybridgen", choices=METHODS, help="attention method (default hybridgen)")
    p.add_argument("--resident-budget", type=int, default=32, help="tokens per layer on the accelerator (default 32)")
    p.add_argument("--k-min", type=int, default=32, help="K_min / fixed K of selective baselines (default 32)")
    p.add_argument("--k-max", type=int, default=512)
    p.add_argument("--k-step", type=int, default=16)
    p.add_argument("--window", type=int, default=64, help="StreamingLLM recent window (default 64)")
    p.add_argument("--no-selection", action="store_true", help="use every offloaded token (exact hybrid attention)")
    p.add_argument("--exact", action="store_true", help="no layer-ahead speculation: the CPU uses the true query")
    p.add_argument("--exact-layers", type=int, default=2,
                   help="first layers whose CPU logits always use the true query (default 2)")
    p.add_argument("--mapping", default="semantic", choices=MAPPINGS, help="where V goes once host DRAM is full")
    p.add_argument("--v-dram-tokens", type=int, default=128, help="V rows per layer in DRAM before the CXL tier")
    p.add_argument("--timing", default="measured", choices=TIMINGS, help="scheduler inputs")
    p.add_argument("--platform", default="A", choices=list_platforms(), help="platform profile for modelled times")
    p.add_argument("--threads", type=int_at_least(1), default=1,
                   help="torch CPU threads (default 1: decode ops are tiny, more threads mostly add contention)")


def _options(args, method: str) -> "EngineOptions":
    from .engine import EngineOptions  # torch: only for the commands that run the model

    import torch

    torch.set_num_threads(args.threads)
    opts = EngineOptions(method=method, resident_budget=args.resident_budget, k_min=args.k_min, k_max=args.k_max,
                         k_step=args.k_step, selection=not args.no_selection, layer_ahead=not args.exact,
                         exact_layers=args.exact_layers,
                         mapping=args.mapping, v_dram_tokens=args.v_dram_tokens, timing=args.timing,
                         platform=args.platform, window=args.window)
    try:
        opts.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return opts


def _load():
    from .model import SmolLM2
    from .tokenizer import Tokenizer

    model = SmolLM2.load()
    return model, Tokenizer.from_gguf(model.tokenizer_reader)


def _generate(args) -> int:
    from tqdm import tqdm

    from .engine import Engine

    opts = _options(args, args.method)
    model, tok = _load()
    ids = tok.encode(args.prompt if args.raw else tok.chat_prompt(args.prompt))
    opts.capacity = len(ids) + args.max_new_tokens + 1
    with Engine(model, opts) as eng, tqdm(total=args.max_new_tokens, desc=args.method, file=sys.stderr,
                                          leave=False) as bar:
        out = eng.generate(ids, args.max_new_tokens, eos_id=tok.eos_id, progress=bar)
        steps = [s.as_dict() for s in eng.steps]
    text = tok.decode(out)
    if args.json:
        print(json.dumps({"method": args.method, "text": text, "tokens": out, "steps": steps}, indent=1))
        return 0
    print(text)
    print()
    print(f"{'step':>4} {'ctx':>5} {'res':>4} {'off':>5} {'K':>4} {'strat':>5} {'cpu ms':>7} {'acc ms':>7} "
          f"{'tx ms':>6} | {'model cpu/tx/gpu us':>20} | {'DRAM rd':>8} {'CXL rd':>8} {'CXL wr':>7} {'PCIe':>8} "
          f"{'CXL us':>7} branch")
    for s in steps:
        b = s["bytes"]
        print(f"{s['step']:>4} {s['n_tokens']:>5} {s['resident']:>4} {s['offloaded']:>5} {s['k']:>4} "
              f"{s['strategy']:>5} {s['t_cpu'] * 1e3:>7.2f} {s['t_gpu'] * 1e3:>7.2f} {s['t_tx'] * 1e3:>6.2f} | "
              f"{s['model_t_cpu'] * 1e6:>6.0f}/{s['model_t_tx'] * 1e6:>5.0f}/{s['model_t_gpu'] * 1e6:>6.0f} | "
              f"{b.get('dram_read', 0):>8} {b.get('cxl_read', 0):>8} {b.get('cxl_write', 0):>7} "
              f"{b.get('pcie_to_accel', 0):>8} {s['cxl_ns'] / 1e3:>7.1f} {s['branch']}")
    return 0


def _similarity(args) -> int:
    from .evaluate import layer_input_similarity, long_english_text

    model, tok = _load()
    sims = layer_input_similarity(model, tok.encode(long_english_text())[:args.tokens])
    if args.json:
        print(json.dumps([{"layer": i, "next": i + 1, "cosine": round(c, 5)} for i, c in enumerate(sims)]))
    else:
        print("layer pair   cosine similarity of attention inputs")
        for i, c in enumerate(sims):
            print(f"{i:>3} -> {i + 1:<3}  {c:.4f}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plt.figure(figsize=(6, 3))
        plt.plot(range(1, len(sims) + 1), sims, marker="o")
        plt.xlabel("layer i+1")
        plt.ylabel("cos(x_i, x_{i+1})")
        plt.title("SmolLM2-135M: consecutive layer inputs")
        plt.ylim(0, 1.02)
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def eval_method_options(args) -> dict[str, "EngineOptions"]:
    return {name: _options(args, name) for name in args.methods}


def _eval(args) -> int:
    from tqdm import tqdm

    from .evaluate import EvalSettings, evaluate_methods

    settings = EvalSettings(args.context_tokens, args.scored_tokens, args.passkey_tokens, args.passkey_depths)
    try:
        settings.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    methods = eval_method_options(args)
    model, tok = _load()
    with tqdm(total=len(methods), desc="methods", file=sys.stderr, leave=False) as bar:
        rows = evaluate_methods(model, tok, methods, settings, progress=bar)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'method':<14} {'perplexity':>10} {'agreement':>9} {'passkey':>8}")
        for r in rows:
            print(f"{r['method']:<14} {r['perplexity']:>10.3f} {r['agreement']:>9.3f} {r['passkey_accuracy']:>8.3f}")
    return 0


def _kmin(args) -> int:
    from tqdm import tqdm

    from .evaluate import EvalSettings, profile_kmin

    ratios = sorted(args.ratios)
    settings = EvalSettings(context_tokens=args.context_tokens, scored_tokens=args.scored_tokens)
    try:
        settings.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    model, tok = _load()
    from .engine import EngineOptions

    base = EngineOptions(method="hybridgen", resident_budget=args.resident_budget)
    with tqdm(total=len(ratios), desc="ratios", file=sys.stderr, leave=False) as bar:
        rows, knee = profile_kmin(model, tok, ratios, settings, base, progress=bar)
    if args.json:
        print(json.dumps({"rows": rows, "knee_ratio": rows[knee]["ratio"], "k_min": rows[knee]["k"]}, indent=1))
    else:
        for i, r in enumerate(rows):
            mark = "  <- K_min (knee)" if i == knee else ""
            print(f"ratio {r['ratio']:<5} K={r['k']:<4} agreement {r['agreement']:.3f} ppl {r['perplexity']:.3f}{mark}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plt.figure(figsize=(5, 3))
        plt.plot([r["ratio"] for r in rows], [r["agreement"] for r in rows], marker="o")
        plt.axvline(rows[knee]["ratio"], color="gray", ls="--", label=f"K_min ratio {rows[knee]['ratio']}")
        plt.xlabel("retained KV ratio")
        plt.ylabel("top-1 agreement with full")
        plt.legend()
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
    return 0


def _schedule(args) -> int:
    from .perfmodel import scheduler_trace

    models = load_models()
    platform = _platform(args.platform)
    try:
        trace = scheduler_trace(models[args.model], platform, args.resident, args.growth, args.growth, args.steps,
                                args.k_min, args.k_max, args.k_step)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"{args.model} on {platform.name}: {args.resident} tokens on the GPU, +{args.growth} offloaded per step")
    print(f"{'step':>5} {'offloaded':>9} {'K':>5} {'strategy':>8} branch")
    prev, after_switch = None, 0
    for i, (off, d) in enumerate(trace):
        last = i == len(trace) - 1
        if (d.branch != prev and after_switch < 3) or last:
            if last and after_switch >= 3:
                ks = [e.k for _, e in trace[-10:]]
                print(f"  ... K settles between {min(ks)} and {max(ks)}")
            print(f"{i:>5} {off:>9} {d.k:>5} {d.strategy:>8} {d.branch}")
            after_switch += d.strategy == "pre"
        prev = d.branch
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot([off for off, _ in trace], [d.k for _, d in trace], label="K")
        switch = next((off for off, d in trace if d.branch == "switch"), None)
        if switch is not None:
            ax.axvline(switch, color="gray", ls="--", label="switch to pre-QKᵀ")
        ax.set_xlabel("offloaded tokens")
        ax.set_ylabel("K")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


def _model_perf(args) -> int:
    from .perfmodel import PAPER_MODELS, decode_latency, geomean

    platform = _platform(args.platform)
    models = load_models()

    def speedups(model, seq, batch, mapping="semantic"):
        lat = {meth: decode_latency(meth, models[model], platform, seq, batch, args.kv_ratio, mapping)
               for meth in PERF_METHODS}
        return lat, {meth: lat["flexgen"] / t for meth, t in lat.items()}

    table = []
    for name in PAPER_MODELS:
        lat, sp = speedups(name, args.seq_len, args.batch)
        table.append({"model": name, "latency_ms": {k: v * 1e3 for k, v in lat.items()}, "speedup_vs_flexgen": sp})
    gmean = {meth: geomean(r["speedup_vs_flexgen"][meth] for r in table) for meth in PERF_METHODS}
    seq_sweep = [{"seq_len": n, **{m: round(speedups(args.sweep_model, n, args.batch)[1][m], 3) for m in PERF_METHODS}}
                 for n in (2048, 4096, 8192, 16384, 32768)]
    batch_sweep = [{"batch": b, **{m: round(speedups(args.sweep_model, args.seq_len, b)[1][m], 3) for m in PERF_METHODS}}
                   for b in (1, 2, 4, 8, 16)]
    mapping = []
    for name, seq in [(n, args.seq_len) for n in PAPER_MODELS] + [(args.sweep_model, 32768)]:
        sem, inter = (decode_latency("hybridgen-fixed", models[name], platform, seq, args.batch, args.kv_ratio, mp)
                      for mp in ("semantic", "interleaved"))
        mapping.append({"model": name, "seq_len": seq, "semantic_ms": sem * 1e3, "interleaved_ms": inter * 1e3,
                        "semantic_speedup": inter / sem})
    result = {"platform": platform.name, "seq_len": args.seq_len, "batch": args.batch, "kv_ratio": args.kv_ratio,
              "models": table, "geomean_speedup_vs_flexgen": gmean,
              "hybridgen_over": {m: gmean["hybridgen"] / gmean[m] for m in PERF_METHODS if m != "hybridgen"},
              "seq_len_sweep": seq_sweep, "batch_sweep": batch_sweep, "mapping": mapping,
              "mapping_geomean_speedup": geomean(r["semantic_speedup"] for r in mapping)}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_model_perf(result)
    if args.plot:
        _plot_model_perf(result, args.plot)
    return 0


def _print_model_perf(r) -> None:
    meths = list(PERF_METHODS)
    print(f"platform {r['platform']}; {r['seq_len']} tokens, batch {r['batch']}, K_min ratio {r['kv_ratio']}")
    print("decode latency per token, ms (speedup over FlexGen)")
    print(f"{'model':<14}" + "".join(f"{m:>22}" for m in meths))
    for row in r["models"]:
        print(f"{row['model']:<14}" + "".join(
            f"{row['latency_ms'][m]:>13.2f} ({row['speedup_vs_flexgen'][m]:>5.2f}x)" for m in meths))
    print(f"{'geomean':<14}" + "".join(f"{r['geomean_speedup_vs_flexgen'][m]:>21.2f}x" for m in meths))
    print("HybridGen over: " + ", ".join(f"{m} {v:.2f}x" for m, v in r["hybridgen_over"].items()))
    print("\nsequence-length sweep (speedup over FlexGen)")
    for row in r["seq_len_sweep"]:
        print(f"  {row['seq_len']:>6} tokens: " + ", ".join(f"{m} {row[m]:.2f}x" for m in meths))
    print("batch sweep (speedup over FlexGen)")
    for row in r["batch_sweep"]:
        print(f"  batch {row['batch']:>2}: " + ", ".join(f"{m} {row[m]:.2f}x" for m in meths))
    print("KV mapping for HybridGen at K = K_min, post-QKᵀ: semantic-aware (K in DRAM, V in CXL) vs interleaved pages")
    for row in r["mapping"]:
        print(f"  {row['model']:<14} {row['seq_len']:>6} tok  semantic {row['semantic_ms']:8.2f} ms  interleaved {row['interleaved_ms']:8.2f} ms"
              f"  ({row['semantic_speedup']:.2f}x)")
    print(f"  geomean semantic-aware speedup {r['mapping_geomean_speedup']:.2f}x")


def _plot_model_perf(r, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    meths = list(PERF_METHODS)
    names = [row["model"] for row in r["models"]]
    x = np.arange(len(names))
    w = 0.8 / len(meths)
    fig, ax = plt.subplots(figsize=(12, 4))
    for i, m in enumerate(meths):
        ax.bar(x + i * w, [row["speedup_vs_flexgen"][m] for row in r["models"]], w, label=m)
    ax.set_xticks(x + 0.4 - w / 2, names, rotation=30, ha="right")
    ax.set_ylabel("speedup over FlexGen")
    ax.set_title(f"modelled decode, platform {r['platform']}, {r['seq_len']} tokens, batch {r['batch']}")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)
