"""``chm hybridgen generate|similarity|eval|model-perf|kmin``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import json
import sys
from pathlib import Path

from common.cli import ChmArgumentParser, UsageError, float_in, int_at_least

from .names import EVAL_ROWS, HOST_DRAM_BYTES, MAPPINGS, METHODS, STRATEGY_MODES, TIMINGS, V_TIERS
from .perfmodel import METHODS as PERF_METHODS
from .perfmodel import PAPER_SEQ_LEN, list_platforms, load_models

if TYPE_CHECKING:
    from .engine import EngineOptions


GENERATE_WINDOW = 64  # StreamingLLM's recent window in generate (eval matches it to the other rows' budget)


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
    g.add_argument("--prompt", required=True, action="append",
                   help="user prompt (wrapped in the chat template unless --raw); repeat for a batch of prompts")
    g.add_argument("--batch", type=int_at_least(1), default=None,
                   help="sequences decoded together (default: one per --prompt); the prompts are cycled to fill it")
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
                                  "full attention, passkey retrieval accuracy at several depths, the K each step "
                                  "used and the share of post-QKᵀ steps. Rows: every method; 'hybridgen' is "
                                  "post-QKᵀ pinned at K (accuracy), 'hybridgen-scheduled' runs Algorithm 1 on the "
                                  "platform's modelled times. Deterministic except decode_ms_per_token.")
    e.add_argument("--methods", default=list(EVAL_ROWS), type=_method_list, metavar="M1,M2",
                   help=f"comma-separated subset of {', '.join(EVAL_ROWS)}")
    e.add_argument("--context-tokens", type=int_at_least(2), default=1024)
    e.add_argument("--scored-tokens", type=int_at_least(2), default=64)
    e.add_argument("--passkey-tokens", type=int_at_least(2), default=1024)
    e.add_argument("--passkey-depths", default=(0.1, 0.5, 0.9), type=_fractions(zero_allowed=True), metavar="D1,D2",
                   help="comma-separated depths in [0, 1]")
    budget = e.add_mutually_exclusive_group()
    budget.add_argument("--budget-ratio", type=float_in(0, 1, lo_open=True), default=None,
                        help="K as a share of the context, (0, 1] (default: the paper's K_min ratio, 128/2048)")
    budget.add_argument("--k-min", type=int_at_least(1), default=None, help="K in tokens, instead of --budget-ratio")
    e.add_argument("--json", action="store_true", help="print the rows as JSON")
    _engine_args(e, with_method=False, with_k=False)
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
                                  "normalised to FlexGen, beside the paper's claimed speedups; sequence sweep "
                                  "(Llama-3.1-8B, Qwen2.5-7B), batch sweep (OPT-13B) and, on a platform with CXL, "
                                  "semantic-aware vs interleaved KV mapping where the KV exceeds host DRAM.")
    m.add_argument("--platform", default="A", help=f"{', '.join(platforms)} or a platform TOML path (default A)")
    m.add_argument("--seq-len", type=int_at_least(1), default=PAPER_SEQ_LEN)
    m.add_argument("--batch", type=int_at_least(1), default=1)
    m.add_argument("--k-min", type=int_at_least(1), default=None,
                   help="K_min of HybridGen and fixed K of the selective baselines (default: each model's, models.toml)")
    m.add_argument("--set", dest="overrides", action="append", default=[], type=_override, metavar="SECTION.FIELD=VALUE",
                   help="replace one number of the platform file (a sensitivity run); repeatable")
    m.add_argument("--plot", metavar="PNG", help="draw speedups over FlexGen into this PNG")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_model_perf)

    c = hs.add_parser("calibrate", help="measure this machine into a platform file (for generate --platform FILE)",
                      description="Measure this machine's rates and the engine's fixed costs into a platform TOML, "
                                  "so that the model's columns of generate describe this machine.")
    c.add_argument("--out", required=True, metavar="TOML", help="platform file to write")
    c.add_argument("--threads", type=int_at_least(1), default=1, help="torch CPU threads, as generate (default 1)")
    c.set_defaults(func=_calibrate)


def build_parser_for_tests() -> argparse.ArgumentParser:
    """The ``hybridgen`` parser alone (``chm`` builds the same one through its entry point)."""
    root = ChmArgumentParser(prog="chm")
    register(root.add_subparsers())
    return root._subparsers._group_actions[0].choices["hybridgen"]


def _method_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in EVAL_ROWS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: {','.join(bad) or 'no method'}; allowed: {', '.join(EVAL_ROWS)}")
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


def _override(text: str) -> tuple[str, float]:
    """An argparse ``type=``: SECTION.FIELD=NUMBER."""
    key, sep, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = None
    if not sep or "." not in key or number is None:
        raise argparse.ArgumentTypeError(f"{text!r} must be SECTION.FIELD=NUMBER, e.g. cpu.attention_gflops=150")
    return key.strip(), number


def _platform_name(name: str) -> str:
    """An argparse ``type=``: a shipped platform or an existing TOML path."""
    if name not in list_platforms() and not Path(name).is_file():
        raise argparse.ArgumentTypeError(f"{name!r} must be one of {', '.join(list_platforms())} or a TOML file")
    return name


def _platform(name: str, overrides=()):
    """A shipped platform or a TOML path: an unknown name is a usage error, a bad file a runtime one."""
    from .perfmodel import load_platform

    if name not in list_platforms() and not Path(name).is_file():
        raise UsageError(f"--platform {name!r} must be one of {', '.join(list_platforms())} or a TOML file")
    try:
        return load_platform(name, dict(overrides))
    except KeyError as exc:
        raise ValueError(f"platform file {name}: missing field {exc}") from None
    except (TypeError, ValueError) as exc:  # wrong types, not TOML
        raise ValueError(f"platform file {name}: {exc}") from None


def _engine_args(p, with_method: bool = True, with_k: bool = True) -> None:
    if with_method:
        p.add_argument("--method", default="hybridgen", choices=METHODS, help="attention method (default hybridgen)")
    p.add_argument("--resident-budget", type=int, default=32, help="tokens per layer on the accelerator (default 32)")
    if with_k:
        p.add_argument("--k-min", type=int, default=None,
                       help="K_min / fixed K of pinned strategies and selective baselines (default: SmolLM2's "
                            "profiled K_min, models.toml)")
    p.add_argument("--k-max", type=int, default=512)
    p.add_argument("--k-step", type=int, default=16)
    p.add_argument("--window", type=int, default=None,
                   help="StreamingLLM recent window (default: generate 64; eval the other rows' budget, K + resident)")
    p.add_argument("--no-selection", action="store_true", help="use every offloaded token (exact hybrid attention)")
    p.add_argument("--strategy", default="auto", choices=STRATEGY_MODES,
                   help="hybridgen's selection: auto (Algorithm 1 sets K and the strategy), or post / pre pinned "
                        "at K = --k-min (default auto)")
    p.add_argument("--exact", action="store_true", help="no layer-ahead speculation: the CPU uses the true query")
    p.add_argument("--exact-layers", type=int, default=2,
                   help="first layers whose CPU logits always use the true query (default 2)")
    p.add_argument("--mapping", default="semantic", choices=MAPPINGS, help="where V goes once host DRAM is full")
    p.add_argument("--host-dram-mib", type=float_in(0), default=HOST_DRAM_BYTES / 2**20,
                   help="host DRAM for offloaded KV, MiB: beyond it V moves to the CXL tier, then K (default "
                        f"{HOST_DRAM_BYTES / 2**20:g})")
    p.add_argument("--no-prefetch", action="store_true", help="read CXL-resident V rows on demand only")
    p.add_argument("--cxl-node", default=None, metavar="NODE",
                   help="the CXL tier is the `chm serve` device at NODE (default: a device in this process)")
    p.add_argument("--v-tier", default="read", choices=V_TIERS,
                   help="CXL-resident V rows by explicit reads, or mapped: loads through a mapping of the "
                        "--cxl-node device (e.g. chm serve --policy lru) (default read)")
    p.add_argument("--timing", default="measured", choices=TIMINGS, help="scheduler inputs")
    p.add_argument("--platform", default="A", type=_platform_name,
                   help=f"platform for the modelled times: {', '.join(list_platforms())} or a TOML path "
                        "(chm hybridgen calibrate writes one of this machine) (default A)")
    p.add_argument("--threads", type=int_at_least(1), default=1,
                   help="torch CPU threads (default 1: decode ops are tiny, more threads mostly add contention)")


def _options(args, method: str) -> "EngineOptions":
    from .engine import EngineOptions  # torch: only for the commands that run the model

    import torch

    torch.set_num_threads(args.threads)
    k_min = {"k_min": args.k_min} if getattr(args, "k_min", None) is not None else {}  # else EngineOptions' default
    opts = EngineOptions(method=method, resident_budget=args.resident_budget, **k_min, k_max=args.k_max,
                         k_step=args.k_step, selection=not args.no_selection, strategy=args.strategy,
                         layer_ahead=not args.exact, exact_layers=args.exact_layers, mapping=args.mapping,
                         host_dram_bytes=args.host_dram_mib * 2**20, prefetch=not args.no_prefetch,
                         timing=args.timing, platform=args.platform, batch=getattr(args, "batch", 1),
                         window=args.window or GENERATE_WINDOW, cxl_node=args.cxl_node, v_tier=args.v_tier)
    if opts.v_tier == "mapped" and opts.cxl_node is None:
        raise UsageError("--v-tier mapped needs --cxl-node NODE: a `chm serve --policy lru` device to map")
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

    args.batch = args.batch or len(args.prompt)
    opts = _options(args, args.method)
    model, tok = _load()
    prompts = [tok.encode(p if args.raw else tok.chat_prompt(p)) for p in args.prompt]
    prompts = [prompts[b % len(prompts)] for b in range(args.batch)]
    opts.capacity = max(map(len, prompts)) + args.max_new_tokens + 1
    with Engine(model, opts) as eng, tqdm(total=args.max_new_tokens, desc=args.method, file=sys.stderr,
                                          leave=False) as bar:
        outs = eng.generate_batch(prompts, args.max_new_tokens, eos_id=tok.eos_id, progress=bar)
        steps = [s.as_dict() for s in eng.steps]
    texts = [tok.decode(out) for out in outs]
    if args.json:
        result = {"method": args.method, "batch": args.batch, "texts": texts, "tokens": outs, "steps": steps}
        if args.batch == 1:
            result.update(text=texts[0])
        print(json.dumps(result, indent=1))
        return 0
    for b, text in enumerate(texts):
        print(f"[{b}] {text}" if args.batch > 1 else text)
    print()
    print(f"{'step':>4} {'ctx':>5} {'res':>4} {'off':>5} {'K':>4} {'strat':>5} {'cpu ms':>7} {'acc ms':>7} "
          f"{'tx ms':>6} | {'model cpu/tx/gpu us':>20} | {'DRAM rd':>8} {'CXL rd':>8} {'CXL wr':>7} {'PCIe':>8} "
          f"{'CXL us':>7} {'K@CXL':>6} branch")
    for s in steps:
        b = s["bytes"]
        print(f"{s['step']:>4} {s['n_tokens']:>5} {s['resident']:>4} {s['offloaded']:>5} {s['k']:>4} "
              f"{s['strategy']:>5} {s['t_cpu'] * 1e3:>7.2f} {s['t_gpu'] * 1e3:>7.2f} {s['t_tx'] * 1e3:>6.2f} | "
              f"{s['model_t_cpu'] * 1e6:>6.0f}/{s['model_t_tx'] * 1e6:>5.0f}/{s['model_t_gpu'] * 1e6:>6.0f} | "
              f"{b.get('dram_read', 0):>8} {b.get('cxl_read', 0):>8} {b.get('cxl_write', 0):>7} "
              f"{b.get('pcie_to_accel', 0):>8} {s['cxl_ns'] / 1e3:>7.1f} {s['k_in_cxl']:>6} {s['branch']}")
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


def _eval(args) -> int:
    from tqdm import tqdm

    from .evaluate import EvalSettings, evaluate_methods

    settings = EvalSettings(args.context_tokens, args.scored_tokens, args.passkey_tokens, args.passkey_depths,
                            budget_ratio=args.budget_ratio, k_min=args.k_min, window=args.window)
    try:
        settings.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args.k_min, args.k_max = settings.k, max(args.k_max, settings.k)  # the rows' K (row_options) in range
    base = _options(args, "full")
    model, tok = _load()
    with tqdm(total=len(args.methods), desc="methods", file=sys.stderr, leave=False) as bar:
        rows = evaluate_methods(model, tok, args.methods, base, settings, progress=bar)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    full = next((r for r in rows if r["method"] == "full"), None)
    print(f"{settings.context_tokens}-token context, {settings.scored_tokens} scored tokens, K = {settings.k}, "
          f"{args.resident_budget} resident tokens")
    print(f"{'method':<20} {'perplexity':>10} {'vs full':>8} {'agreement':>9} {'passkey':>8} {'post-QKᵀ':>8} {'K':>9}")
    for r in rows:
        gap = f"{r['perplexity'] / full['perplexity'] - 1:+8.1%}" if full else f"{'':>8}"
        post = "" if r["post_qkt_fraction"] is None else f"{r['post_qkt_fraction']:.2f}"
        print(f"{r['method']:<20} {r['perplexity']:>10.3f} {gap} {r['agreement']:>9.3f} {r['passkey_accuracy']:>8.3f} "
              f"{post:>8} {r['k_range'][0]:>4}-{r['k_range'][1]:<4}")
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
        switch = next((off for off, d in trace if d.branch == "switch-to-pre"), None)
        if switch is not None:
            ax.axvline(switch, color="gray", ls="--", label="switch to pre-QKᵀ")
        ax.set_xlabel("offloaded tokens")
        ax.set_ylabel("K")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


def _calibrate(args) -> int:
    import torch

    from .calibrate import measure, to_toml

    torch.set_num_threads(args.threads)
    model, _ = _load()
    text = to_toml(measure(model))
    Path(args.out).write_text(text)
    print(text, end="")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _model_perf(args) -> int:
    from .perfmodel import model_perf_report

    platform = _platform(args.platform, args.overrides)
    try:
        result = model_perf_report(platform, args.seq_len, args.batch, args.k_min)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    result["overrides"] = dict(args.overrides)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_model_perf(result)
    if args.plot:
        _plot_model_perf(result, args.plot)
    return 0


def _print_model_perf(r) -> None:
    meths = list(PERF_METHODS)
    k = "each model's K_min (models.toml)" if r["k_min"] is None else f"K_min {r['k_min']}"
    sets = "".join(f", {key}={v:g}" for key, v in r["overrides"].items())
    print(f"platform {r['platform']}{sets}; {r['seq_len']} tokens, batch {r['batch']}, {k}")
    print("decode latency per token, ms (speedup over FlexGen); hybridgen: share of post-QKᵀ steps, K range")
    print(f"{'model':<14}" + "".join(f"{m:>22}" for m in meths) + "  post  K")
    for row in r["models"]:
        hg = row["hybridgen"]
        print(f"{row['model']:<14}" + "".join(
            f"{row['latency_ms'][m]:>13.2f} ({row['speedup_vs_flexgen'][m]:>5.2f}x)" for m in meths)
            + f"  {hg['post_fraction']:.2f}  {hg['k_range'][0]}-{hg['k_range'][1]}")
    print(f"{'geomean':<14}" + "".join(f"{r['geomean_speedup_vs_flexgen'][m]:>21.2f}x" for m in meths))
    print("HybridGen over each baseline, geometric mean over the models (max over the models) [paper]:")
    for m, v in r["hybridgen_over"].items():
        paper = r["paper_speedup"].get(m)
        print(f"  {m:<15} {v['geomean']:5.2f}x  ({v['max']:.2f}x)" + (f"  [paper {paper:.2f}x]" if paper else ""))
    for sweep in r["seq_len_sweep"]:
        print(f"\nsequence-length sweep, {sweep['model']}, batch {r['batch']}: HybridGen's speedup over each baseline")
        for row in sweep["rows"]:
            print(f"  {row['seq_len']:>6} tokens: " + ", ".join(f"{m} {v:.2f}x" for m, v in row["hybridgen_over"].items()))
    b = r["batch_sweep"]
    print(f"\nbatch sweep, {b['model']}, {r['seq_len']} tokens: HybridGen's speedup over each baseline")
    for row in b["rows"]:
        print(f"  batch {row['batch']:>2}: " + ", ".join(f"{m} {v:.2f}x" for m, v in row["hybridgen_over"].items()))
    if r["mapping"]:
        print("\nKV mapping: semantic-aware (K in DRAM, only V beyond DRAM in CXL) vs interleaved pages; "
              "ms per token, semantic's speedup")
        for row in r["mapping"]:
            head = f"  {row['model']:<13} {row['seq_len']:>6} tok batch {row['batch']:>2}:"
            if not row["fits"]:
                print(f"{head} the KV exceeds host DRAM + CXL")
                continue
            print(f"{head} {row['offloaded_kv_gb']:4.0f} GB, V in CXL {row['v_cxl']:.2f}, K {row['k_cxl']:.2f};" + ";".join(
                f" {meth} {row[meth]['semantic_ms']:.1f} vs {row[meth]['interleaved_ms']:.1f}"
                f" ({row[meth]['semantic_speedup']:.2f}x)" for meth in ("hybridgen-fixed", "hybridgen")))


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
