"""The simulation's settings, declared once: a table of fields (section, kind, allowed range, command-line flag),
from which the typed sections a preset is converted into are built (``msgspec`` Structs with the ranges, through
``common.checks``); a command-line value is checked against the same field.

A value out of range is an error naming the field (or flag), the value and the range, whether it came from a file
or a flag (``common.checks``' wording). Presets live in ``presets/figNN.toml``; every number there names its source.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import msgspec
from msgspec import Meta

from common.checks import Checks
from common.units import parse_bytes
from host_runtime.replay.models import MODELS
from host_runtime.replay.prefill import read_toml
from host_runtime.replay.traces import TIME_SCALE_RANGE, WINDOW_S_RANGE

from .tiers import TIERS

PRESET_DIR = Path(__file__).with_name("presets")
TiB = 1 << 40
CHECK = Checks(ValueError)  # the simulation's settings errors are ValueErrors (the CLI makes them usage errors)


@dataclass(frozen=True)
class Field:
    key: str            # section.name
    kind: str           # a key of KINDS
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

    @property
    def type(self) -> Any:
        """The type a checked value has, with the field's range (what ``msgspec.convert`` enforces)."""
        return KINDS[self.kind].type(self)

    @property
    def allowed(self) -> str:
        """The range, as an error states it."""
        return KINDS[self.kind].allowed(self)


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
          "multi-turn; mooncake: a Mooncake JSONL trace, each request at its timestamp (--trace); turns: recorded "
          "turns, a JSON file of the tokens each turn adds (--trace; bench_vllm writes the one it sends to vLLM)",
          choices=("lmsys", "aiperf", "mooncake", "turns")),
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
    Field("workload.turn_tokens", "float", 0, 1e6, "--turn-tokens",
          "lmsys: mean tokens a turn adds (prompt + response, the two means scaled in their split; 0: as given)"),
    Field("workload.input_tokens", "float", 1, 1e6, "--isl", "aiperf: user tokens per turn (ISL mean)"),
    Field("workload.input_tokens_stddev", "float", 0, 1e6, "--isl-stddev", "aiperf: ISL standard deviation"),
    Field("workload.prefix_ratio", "float", 0, 1, "--prefix-ratio",
          "aiperf: share of the first turn's ISL that is a prefix every conversation shares"),
    Field("workload.min_prompt_tokens", "int", 0, 1_000_000, "--min-prompt-tokens",
          "lmsys: every user prompt drawn from LMSYS's distribution conditioned on at least this many tokens (0: all)"),
    Field("workload.trace", "path", flag="--trace", help="mooncake: the JSONL trace (\"\": the shared Mooncake "
          "conversation trace, ../shared/data/traces/mooncake_conversation_trace.jsonl or $CHM_MOONCAKE_TRACE); "
          "turns: the recorded turns' JSON file (sim/workload.py TurnsFile; no default)"),
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


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{int(n // size)}{unit}"
    return str(int(n))


def _byte_count(value: Any) -> int:
    """An integer, or a count with a unit (``"64GiB"``); 0 is a count (its range decides)."""
    if isinstance(value, bool):
        raise TypeError(value)
    return value if isinstance(value, int) else parse_bytes(value)


def _byte_counts(value: Any) -> Any:
    """A command line's comma-separated byte counts, or a preset's list of them."""
    items = [t.strip() for t in value.split(",") if t.strip()] if isinstance(value, str) else value
    return [parse_bytes(item) for item in items] if isinstance(items, list) else items


def _as_is(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Kind:
    type: Callable[[Field], Any]          # the checked value's type, with the field's range
    allowed: Callable[[Field], str]       # that range as an error states it
    read: Callable[[Any], Any] = _as_is   # the written forms it accepts beyond the type (command-line text,
    #                                       units, comma lists, any case); ValueError / TypeError if none fits


_UNITS = "(an integer, or with a unit: KiB, MiB, GiB, TiB)"
KINDS = {
    "int": Kind(lambda f: Annotated[int, Meta(ge=int(f.lo), le=int(f.hi))],
                lambda f: f"an integer in [{int(f.lo)}, {int(f.hi)}]", lambda v: int(v) if isinstance(v, str) else v),
    "float": Kind(lambda f: Annotated[float, Meta(ge=f.lo, le=f.hi)], lambda f: f"a number in [{f.lo:g}, {f.hi:g}]",
                  lambda v: float(v) if isinstance(v, str) else v),
    "bytes": Kind(lambda f: Annotated[int, Meta(ge=int(f.lo), le=int(f.hi))],
                  lambda f: f"a byte count in [{_bytes(f.lo)}, {_bytes(f.hi)}] {_UNITS}", _byte_count),
    "choice": Kind(lambda f: Literal[f.choices], lambda f: f"one of {', '.join(f.choices)}",
                   lambda v: v.lower() if isinstance(v, str) else v),
    "str": Kind(lambda f: Annotated[str, Meta(min_length=1)], lambda f: "a non-empty string"),
    "path": Kind(lambda f: str, lambda f: "a file path, or \"\" for the default"),
    "tiers": Kind(lambda f: Annotated[list[Literal[TIERS]], Meta(min_length=1)],
                  lambda f: f"a non-empty list of distinct tiers from {', '.join(TIERS)}",
                  lambda v: [t.strip() for t in v.split(",")] if isinstance(v, str) else v),
    "byteslist": Kind(lambda f: list[Annotated[int, Meta(ge=1)]],
                      lambda f: "a list of byte counts (integers, or with a unit: KiB, MiB, GiB, TiB), possibly empty",
                      _byte_counts),
}


def check(f: Field, value: Any, where: str | None = None) -> Any:
    """``value`` (a flag's text, a sweep's value, a preset's entry) as the field's type, or ValueError naming the
    field (or ``where``), the value and the range."""
    where = where or f.key
    try:
        typed = KINDS[f.kind].read(value)
    except (ValueError, TypeError):
        raise CHECK.fail(where, value, f.allowed) from None
    try:
        checked = msgspec.convert(typed, f.type, strict=True)
    except msgspec.ValidationError:
        raise CHECK.fail(where, typed if f.kind in ("int", "float") else value, f.allowed) from None
    if f.kind == "tiers" and len(set(checked)) != len(checked):
        raise CHECK.fail(where, value, f.allowed)
    return checked


def _attr(name: str) -> str:
    return name.replace("-", "_")  # a TOML name that is not a Python one (the section cmm-h)


class Figure(msgspec.Struct):
    """A preset's [figure]: which of the paper's figures it sets up (any other key is a comment)."""

    number: int | None = None
    title: str = ""


@functools.cache
def preset_type() -> type[msgspec.Struct]:
    """A preset, typed: a Struct per section, a field per setting, each with its range (built from FIELDS)."""
    sections: dict[str, list[Field]] = {}
    for f in FIELDS:
        sections.setdefault(f.section, []).append(f)
    parts = []
    for section, fields in sections.items():
        struct = msgspec.defstruct(f"Section_{_attr(section)}", [(_attr(f.name), f.type) for f in fields],
                                   rename={_attr(f.name): f.name for f in fields}, forbid_unknown_fields=True,
                                   kw_only=True)
        parts.append((_attr(section), struct))
    return msgspec.defstruct("Preset", [("figure", Figure, msgspec.field(default_factory=Figure)), *parts],
                             rename={_attr(s): s for s in sections}, forbid_unknown_fields=True, kw_only=True)


def _checked_entries(table: dict, where: str) -> dict:
    """A preset's tables with every setting checked (``check``: typed, units read, in range); the rest (unknown
    names, missing ones, a section that is no table) is for the preset's type to refuse."""
    out = {}
    for section, fields in table.items():
        if section == "figure" or not isinstance(fields, dict):
            out[section] = fields
            continue
        out[section] = {name: value if (f := BY_KEY.get(f"{section}.{name}")) is None
                        else check(f, value, f"{where}{f.key}") for name, value in fields.items()}
    return out


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
    if s["workload.kind"] == "turns":  # the recorded turns' file, read and checked before anything runs
        from .workload import read_turns_file

        read_turns_file(trace_path(s))


def trace_path(s: dict[str, Any]) -> Path:
    """The trace of ``workload.trace``: the path given, or the shared Mooncake conversation trace (``turns``: no
    default). ValueError saying where it was looked for when it is not there."""
    from emulator.shared_data import mooncake_conversation_trace

    if s["workload.kind"] == "turns" and not s["workload.trace"]:
        raise CHECK.fail("--trace", "", "the recorded turns' JSON file (--workload turns has no default)")
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
    where = f"{path.name}: "
    preset = CHECK.convert(_checked_entries(read_toml(path), where), preset_type(), where)
    out: dict[str, Any] = {"figure.number": preset.figure.number, "figure.title": preset.figure.title}
    for f in FIELDS:
        out[f.key] = getattr(getattr(preset, _attr(f.section)), _attr(f.name))
    return out
