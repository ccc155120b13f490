"""The simulation's settings: one table of fields, read from a preset TOML and overridden from the command line.

Every field has a section, a kind, an allowed range and a command-line flag; a value out of range is an
error naming the field (or flag), the value and the range, whether it came from a file or a flag.
Presets live in ``presets/figNN.toml``; every number there names its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.units import parse_bytes
from host_runtime.replay.models import MODELS
from host_runtime.replay.prefill import read_toml
from host_runtime.replay.traces import TIME_SCALE_RANGE, WINDOW_S_RANGE

from .tiers import TIERS

PRESET_DIR = Path(__file__).with_name("presets")
TiB = 1 << 40


@dataclass(frozen=True)
class Field:
    key: str            # section.name
    kind: str           # int, float, bytes, str, tiers, choice
    lo: float = -math.inf
    hi: float = math.inf
    flag: str = ""
    help: str = ""
    choices: tuple = ()

    @property
    def section(self) -> str:
        return self.key.split(".")[0]

    @property
    def name(self) -> str:
        return self.key.split(".")[1]


FIELDS = [
    Field("topology.kind", "choice", flag="--topology", help="single: one serving node; pd: prefill workers, one "
          "decode worker, one storage node", choices=("single", "pd")),
    Field("topology.prefill_workers", "int", 1, 1024, "--prefill-workers", "PD: prefill workers (one GPU, one node each)"),
    Field("topology.decode_tp", "int", 1, 64, "--decode-tp", "PD: GPUs of the decode worker (tensor parallel)"),
    Field("topology.kv_port_gbps", "float", 0.001, 1e5, "--kv-port-gbps",
          "PD: each prefill node's port for the remote KV tier (Gbit/s)"),
    Field("topology.pd_port_gbps", "float", 0.001, 1e5, "--pd-port-gbps", "PD: each prefill node's P->D port (Gbit/s)"),
    Field("topology.decode_gbps", "float", 0.001, 1e5, "--decode-gbps", "PD: the decode node's aggregate link (Gbit/s)"),
    Field("topology.storage_gbps", "float", 0.001, 1e5, "--storage-gbps",
          "the storage node's aggregate link (Gbit/s): the HyMCache / CMM-H device's RDMA link"),
    Field("topology.rdma_latency_ns", "float", 0, 1e9, "--rdma-latency-ns", "one RDMA transfer's latency (ns)"),
    Field("workload.kind", "choice", flag="--workload", help="lmsys: LMSYS-style chat; aiperf: AIPerf-style synthetic "
          "multi-turn; mooncake: a Mooncake JSONL trace, each request at its timestamp (--trace)",
          choices=("lmsys", "aiperf", "mooncake")),
    Field("workload.conversations", "int", 1, 1_000_000, "--conversations", "conversations (the workload's size)"),
    Field("workload.turns", "int", 1, 1000, "--turns", "turns per conversation"),
    Field("workload.concurrency", "int", 1, 100_000, "--concurrency",
          "the client's limit: requests in flight (turn-barrier), sessions in flight (per-session)"),
    Field("workload.client", "choice", flag="--client", help="turn-barrier: every conversation's turn t before any "
          "turn t+1; per-session: AIPerf's multi-turn mode, each session sends its next turn when the previous one "
          "is answered, no barrier", choices=("turn-barrier", "per-session")),
    Field("workload.turn_delay_ms", "float", 0, 1e9, "--turn-delay-ms",
          "per-session: delay before a conversation's next turn (AIPerf --conversation-turn-delay-mean, ms)"),
    Field("workload.max_tokens", "int", 1, 1_000_000, "--max-tokens", "tokens decoded per request"),
    Field("workload.mean_prompt_tokens", "float", 1, 1e6, "--mean-prompt-tokens", "mean user prompt per turn"),
    Field("workload.mean_response_tokens", "float", 1, 1e6, "--mean-response-tokens",
          "mean recorded response per turn (part of the next turn's history)"),
    Field("workload.input_tokens", "float", 1, 1e6, "--isl", "aiperf: user tokens per turn (ISL mean)"),
    Field("workload.input_tokens_stddev", "float", 0, 1e6, "--isl-stddev", "aiperf: ISL standard deviation"),
    Field("workload.prefix_ratio", "float", 0, 1, "--prefix-ratio",
          "aiperf: share of the first turn's ISL that is a prefix every conversation shares"),
    Field("workload.min_prompt_tokens", "int", 0, 1_000_000, "--min-prompt-tokens",
          "lmsys: every user prompt drawn from LMSYS's distribution conditioned on at least this many tokens (0: all)"),
    Field("workload.trace", "path", flag="--trace", help="mooncake: the JSONL trace (\"\": the shared Mooncake "
          "conversation trace, ../shared/data/traces/mooncake_conversation_trace.jsonl or $CHM_MOONCAKE_TRACE)"),
    Field("workload.trace_limit", "int", 0, 1 << 40, "--trace-limit", "mooncake: only the trace's first N requests (0: all)"),
    Field("workload.time_scale", "float", *TIME_SCALE_RANGE, "--time-scale",
          "mooncake: multiply the trace's timestamps (< 1: more load)"),
    Field("workload.window_s", "float", *WINDOW_S_RANGE, "--window-s",
          "mooncake: a report row per window of this many seconds of arrivals (instead of per turn)"),
    Field("workload.seed", "int", 0, 2**63 - 1, "--seed", "random seed of the token lengths"),
    Field("model.name", "choice", flag="--model", help="model (replay/models.py)", choices=tuple(MODELS)),
    Field("model.tokens_per_block", "int", 1, 1 << 20, "--tokens-per-block", "tokens per KV block"),
    Field("gpu.profile", "str", flag="--gpu", help="GPU profile (sim/gpus/NAME.toml)"),
    Field("gpu.gpu_memory_utilization", "float", 0.01, 1.0, "--gpu-memory-utilization",
          "share of HBM vLLM may use (weights, activations, KV cache)"),
    Field("gpu.activation_bytes", "bytes", 0, TiB, "--activation-bytes", "activation peak vLLM reserves"),
    Field("gpu.max_num_batched_tokens", "int", 1, 1 << 24, "--max-num-batched-tokens", "token budget per step"),
    Field("gpu.max_num_seqs", "int", 1, 1 << 20, "--max-num-seqs", "requests running at once"),
    Field("tiers.run", "tiers", flag="--tiers", help=f"comma-separated tiers to run, of {', '.join(TIERS)}"),
    Field("tiers.dram", "bytes", 1 << 20, 64 * TiB, "--dram",
          "the DRAM budget: LMCache's local DRAM per worker, the HyMCache / CMM-H device's DRAM"),
    Field("tiers.staging", "bytes", 1 << 20, 64 * TiB, "--staging", "host staging buffer per node"),
    Field("tiers.load_timeout_s", "float", 1e-6, 3600, "--timeout",
          "a remote load not done by then is recomputed (seconds)"),
    Field("sweep.staging", "byteslist", flag="--staging-sweep",
          help="comma-separated staging sizes: each tier that uses a staging buffer runs once per size (empty: none)"),
    Field("mooncake.capacity", "bytes", 1 << 20, 1 << 50, "--mooncake-capacity",
          "Mooncake's DRAM pool, in all (split evenly over the prefill nodes)"),
    Field("mooncake.insert_timeout_s", "float", 1e-6, 3600, "--insert-timeout",
          "Mooncake: an insert not done by then is dropped (seconds)"),
    Field("mooncake.high_watermark", "float", 0.01, 1.0, "--mooncake-high-watermark",
          "Mooncake master: evict when a put takes the pool past this share"),
    Field("mooncake.eviction_ratio", "float", 0.0001, 1.0, "--mooncake-eviction-ratio",
          "Mooncake master: share of objects evicted per eviction"),
    Field("mooncake.lease_s", "float", 0, 3600, "--mooncake-lease", "Mooncake master: read lease of an object (s)"),
    Field("nvmeof.capacity", "bytes", 1 << 20, 1 << 50, "--nvmeof-capacity",
          "mooncake-nvmeof: the SSDs' capacity, in all (one private volume per prefill node, split evenly)"),
    Field("nvmeof.fs_gb_per_s", "float", 0.001, 1e4, "--nvmeof-fs-gb-per-s",
          "mooncake-nvmeof: the file system's sequential ceiling per prefill node (GB/s, reads and writes)"),
    Field("nvmeof.fs_op_us", "float", 0, 1e7, "--nvmeof-fs-op-us",
          "mooncake-nvmeof: software cost of one file operation (one chunk) on the file-system path (us)"),
    Field("redis.capacity", "bytes", 1 << 20, 1 << 50, "--redis-capacity", "lmcache-redis: Redis's maxmemory"),
    Field("redis.policy", "choice", flag="--redis-policy", help="lmcache-redis: Redis's maxmemory-policy",
          choices=("noeviction", "allkeys-lru")),
    Field("redis.gbps", "float", 0.001, 1e5, "--redis-gbps",
          "lmcache-redis: Redis's TCP throughput, GETs and SETs together (Gbit/s)"),
    Field("redis.latency_us", "float", 0, 1e7, "--redis-latency-us", "lmcache-redis: one command's TCP latency (us)"),
    Field("lmcache.chunk_tokens", "int", 1, 1 << 20, "--chunk-tokens", "LMCache chunk size in tokens"),
    Field("hymcache.profile", "str", flag="--hymcache-profile", help="device profile of the hymcache tier"),
    Field("hymcache.window_bytes", "bytes", 1, TiB, "--window", "KV Manager prefetch window per request"),
    Field("cmm-h.profile", "str", flag="--cmmh-profile", help="device profile of the cmm-h tier"),
    Field("report.peak_window_ms", "float", 1e-3, 1e9, "--peak-window-ms",
          "peak read bandwidth: the most bytes read in one window of this many ms (aligned at time 0), per ms"),
]
BY_KEY = {f.key: f for f in FIELDS}


def _range(f: Field) -> str:
    if f.kind == "choice":
        return f"one of {', '.join(f.choices)}"
    if f.kind == "byteslist":
        return "a list of byte counts (integers, or with a unit: KiB, MiB, GiB, TiB), possibly empty"
    if f.kind == "tiers":
        return f"a non-empty list of distinct tiers from {', '.join(TIERS)}"
    if f.kind == "str":
        return "a non-empty string"
    if f.kind == "path":
        return "a file path, or \"\" for the default"
    if f.kind == "int":
        return f"an integer in [{int(f.lo)}, {int(f.hi)}]"
    if f.kind == "bytes":
        return f"a byte count in [{_bytes(f.lo)}, {_bytes(f.hi)}] (an integer, or with a unit: KiB, MiB, GiB, TiB)"
    return f"a number in [{f.lo:g}, {f.hi:g}]"


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{int(n // size)}{unit}"
    return str(int(n))


def check(f: Field, value: Any, where: str | None = None) -> Any:
    """``value`` as the field's type, or ValueError naming the field (or ``where``), the value and the range."""
    name = where or f.key

    def bad():
        return ValueError(f"{name} = {value!r} is outside the allowed range: {_range(f)}")

    if f.kind == "int":
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, int) or not f.lo <= value <= f.hi:
            raise bad()
        return value
    if f.kind == "float":
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not f.lo <= value <= f.hi:
            raise bad()  # NaN fails too
        return float(value)
    if f.kind == "bytes":
        try:
            n = parse_bytes(value, name) if not (isinstance(value, int) and value == 0) else 0
        except (ValueError, TypeError):
            raise bad() from None
        if isinstance(value, bool) or not f.lo <= n <= f.hi:
            raise bad()
        return n
    if f.kind == "choice":
        if not isinstance(value, str) or value.lower() not in f.choices:
            raise bad()
        return value.lower()
    if f.kind == "str":
        if not isinstance(value, str) or not value:
            raise bad()
        return value
    if f.kind == "path":
        if not isinstance(value, str):
            raise bad()
        return value
    if f.kind == "byteslist":
        items = [t.strip() for t in value.split(",") if t.strip()] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise bad()
        out = []
        for item in items:
            try:
                out.append(parse_bytes(item, name))
            except (ValueError, TypeError):
                raise bad() from None
        return out
    if f.kind == "tiers":
        items = [t.strip() for t in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or any(t not in TIERS for t in items) \
                or len(set(items)) != len(items):
            raise bad()
        return list(items)
    raise AssertionError(f.kind)


def check_settings(s: dict[str, Any]) -> None:
    """What no single field's range says: ValueError naming the fields and their values."""
    from host_runtime.replay.traces import MOONCAKE_TOKENS_PER_HASH

    B, chunk = s["model.tokens_per_block"], s["lmcache.chunk_tokens"]
    if chunk % B:
        raise ValueError(f"--chunk-tokens {chunk} must be a multiple of --tokens-per-block {B}")
    if s["workload.kind"] == "mooncake":
        # a block key, and an LMCache / Mooncake chunk key, names its prefix: each must lie inside one hash block
        for flag, n in (("--tokens-per-block", B), ("--chunk-tokens", chunk)):
            if MOONCAKE_TOKENS_PER_HASH % n:
                raise ValueError(f"{flag} {n} must divide the Mooncake trace's hash block of "
                                 f"{MOONCAKE_TOKENS_PER_HASH} tokens (--workload mooncake)")


def trace_path(s: dict[str, Any]) -> Path:
    """The trace of ``workload.trace``: the path given, or the shared Mooncake conversation trace. ValueError
    saying where it was looked for when it is not there."""
    from emulator.shared_data import mooncake_conversation_trace

    if s["workload.trace"]:
        path = Path(s["workload.trace"])
        if not path.is_file():
            raise ValueError(f"--trace {s['workload.trace']!r}: no such file")
        return path
    try:
        return mooncake_conversation_trace()
    except FileNotFoundError as exc:
        raise ValueError(f"--trace \"\" (the shared trace): {exc.strerror}") from None


def preset_path(figure: str | int) -> Path:
    path = PRESET_DIR / f"fig{figure}.toml"
    if not path.is_file():
        known = sorted(p.stem[3:] for p in PRESET_DIR.glob("fig*.toml"))
        raise ValueError(f"--figure {figure}: no preset; presets: {', '.join(known)}")
    return path


def load_settings(path: str | Path) -> dict[str, Any]:
    """A preset: {section.name: value}, every field present and in range."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"preset {str(path)!r} does not exist")
    table = read_toml(path)
    out: dict[str, Any] = {}
    for section, fields in table.items():
        if section == "figure":
            out["figure.number"] = fields.get("number")
            out["figure.title"] = fields.get("title", "")
            continue
        if not isinstance(fields, dict):
            raise ValueError(f"{path}: {section} must be a table")
        for name, value in fields.items():
            f = BY_KEY.get(f"{section}.{name}")
            if f is None:
                raise ValueError(f"{path}: {section}.{name} is not a setting; settings: {', '.join(BY_KEY)}")
            out[f.key] = check(f, value, f"{path.name}: {f.key}")
    missing = [k for k in BY_KEY if k not in out]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return out
