"""HybridGen's performance model against this machine: calibrate (``chm hybridgen calibrate``), then the model's
CPU and transfer times of a generation against what the engine measures (median over 32 steps of per-step
ratios; goal: within +-25 %).

Wall-clock times on a shared 2-core box: other processes' work lands in the measured times, never in the
model, and only as an excess. So the calibration takes best cases (``calibrate``) and the check likewise
repeats the generation and takes, step by step, the fastest of the runs (a burst of load slows one run's
steps, rarely the same step of every run). Without a GPU, T_cpu and T_tx are thread CPU times (``Engine``),
which leave out the time other processes hold the CPUs. Checked: ``generate --strategy post --k-min 64`` on
1000 tokens. Not checked: Algorithm 1's own run, where K grows to ~300; there the measured CPU time exceeds
the model by 25-40 % (the accelerator's thread does more transfer work beside the CPU job, and the two threads
share the machine's two vCPUs, an interference the model does not describe).

A wall-clock comparison, so it is a bench, not a test (``make test`` keeps the calibration's own tests).
Results: ``bench/results/bench_hybridgen_model.json`` and ``.md``.

    .venv/bin/python -m bench bench_hybridgen_model
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import median

from bench import result_files
from host_runtime.hybridgen import calibrate
from host_runtime.hybridgen.engine import Engine, EngineOptions
from host_runtime.hybridgen.evaluate import PrefillCache, long_english_text

CHECK_PROMPT_TOKENS = 1000  # ~4x the calibration's offloaded tokens (calibrate.IN_SITU_PROMPT)
CHECK_STEPS = 32
CHECK_RUNS = 3    # the generation is repeated; each step's measured time is its fastest run's
TOLERANCE = 0.25
ATTEMPTS = 2      # a second calibration if the first was skewed by a burst no minimum could drop


def calibrated(model, path):
    path.write_text(calibrate.to_toml(calibrate.measure(model)))
    return path


def model_over_measured(model, tok, platform, strategy, prefill) -> dict[str, float]:
    """Median over CHECK_STEPS steps of the per-step ratio of modelled to measured time, for T_cpu and T_tx;
    a step's measured time is the fastest of CHECK_RUNS runs (``generate --strategy post --k-min 64``)."""
    ids = tok.encode(long_english_text())[:CHECK_PROMPT_TOKENS]
    opts = EngineOptions(method="hybridgen", strategy=strategy, resident_budget=32, k_min=64, k_max=512,
                         platform=str(platform), capacity=CHECK_PROMPT_TOKENS + CHECK_STEPS + 4)
    runs = []
    for _ in range(CHECK_RUNS):
        with Engine(model, opts) as eng:
            eng.generate(ids, CHECK_STEPS + 2, prefilled=prefill(eng, ids))
            runs.append(eng.steps[1:CHECK_STEPS + 1])  # the first step is cold (the scheduler ignores it too)
    if any(len(r) != CHECK_STEPS for r in runs):
        raise RuntimeError(f"a run made {[len(r) for r in runs]} steps, not {CHECK_STEPS}")
    fields = ("t_cpu", "t_tx", "model_t_cpu", "model_t_tx")
    # the model's times depend on the placement, never on timing: every run models the same steps
    if not all([getattr(s, f) for s in r for f in fields[2:]] == [getattr(s, f) for s in runs[0] for f in fields[2:]]
               for r in runs):
        raise RuntimeError("the model's times differ between runs of the same placement")
    steps = calibrate.fastest_runs(runs, fields)
    return {name: median(s[f"model_t_{name}"] / s[f"t_{name}"] for s in steps) for name in ("cpu", "tx")}



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_hybridgen_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--attempts", type=int, default=ATTEMPTS, help=f"calibrations tried (default {ATTEMPTS})")
    args = p.parse_args(argv)
    if args.attempts < 1:
        p.error(f"--attempts {args.attempts} is outside the allowed range: an integer >= 1")
    from host_runtime.hybridgen.cli import _load

    model, tok = _load()
    prefill, seen = PrefillCache(model), []
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.attempts):
            ratios = model_over_measured(model, tok, calibrated(model, Path(work) / "here.toml"), "post", prefill)
            seen.append({k: round(v, 3) for k, v in ratios.items()})
            if all(1 - TOLERANCE <= r <= 1 + TOLERANCE for r in ratios.values()):
                break
    last = seen[-1]
    within = all(1 - TOLERANCE <= r <= 1 + TOLERANCE for r in last.values())
    print(f"model / measured per attempt: {seen}; within 1 +- {TOLERANCE}: {within}")
    result_files.write("bench_hybridgen_model", [
        ("HybridGen model / measured, T_cpu", f"{last['cpu']:.3f}", f"attempts {seen}", f"1 ± {TOLERANCE}"),
        ("HybridGen model / measured, T_tx", f"{last['tx']:.3f}", f"attempts {seen}", f"1 ± {TOLERANCE}")],
        {"attempts": seen, "tolerance": TOLERANCE, "within": within}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
