"""Workloads for replay, each behind one small interface.

A workload is a sequence of *phases*; the driver starts every stream of a
phase at the phase's start (plus the stream's own offset) and starts the next
phase when all of them have finished (a barrier, as between the turns of the
HyMCache microbenchmark). A stream is one client: its requests run one after
another, each ``think_ns`` after the previous one finished. A request names
the KV blocks of its whole context, in order (``keys``); what the device
already holds of that chain is read, the rest is written (see driver.py).

Keys are plain ints, unique per KV block, so memory stays small.
"""

from __future__ import annotations

import json
import math
import random
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol, Sequence

MOONCAKE_TOKENS_PER_HASH = 512  # Mooncake traces: one hash id per 512-token block
KEY_BITS = 64  # a KV block key (hash id x blocks per hash + block) fits 64 bits: the simulation packs it so
# Virtual time is float nanoseconds from the trace's first request. A trace's scaled span is bounded by the
# range of int64 nanoseconds (~292 years): there a float still resolves 2 us, the device's latencies stay
# visible, and the Master's millisecond clock stays far from its int64 end. Past it, time stops adding up.
MAX_SPAN_NS = float(1 << 63)
TIME_SCALE_RANGE = (1e-9, 1e9)  # --time-scale, replay and simulation alike
WINDOW_S_RANGE = (1e-6, 1e9)  # --window-s: a report row's seconds of virtual time
# A generated workload is built in memory before it runs (about 40 bytes per block reference) and replayed at
# tens of microseconds per block: past this many block references it would not fit, nor finish.
MAX_GENERATED_BLOCKS = 10**8
MAX_MEAN_TURNS = 10**4  # conversation: a geometric number of turns with this mean
MAX_MEAN_TOKENS = 10**9  # conversation: mean prompt / response tokens of a turn
_short = reprlib.Repr()  # error messages quote a bad value, never a whole 10^7-element list
_short.maxstring, _short.maxother, _short.maxlong, _short.maxlist = 40, 40, 40, 8


@dataclass(frozen=True)
class Request:
    keys: Sequence[int]  # KV block keys of the whole context, in consumption order
    think_ns: float = 0.0  # wait after the stream's previous request (or the stream's start)


@dataclass
class Stream:
    start_ns: float  # offset from the phase's start
    requests: list[Request]


@dataclass
class Phase:
    label: str
    streams: list[Stream]


class Workload(Protocol):
    """What a trace reader or generator provides."""

    name: str
    block_bytes: int
    bucket_by: str  # "phase": one report row per phase; "time": one row per time window

    def phases(self) -> Iterator[Phase]: ...

    def populate_keys(self) -> Sequence[int]:
        """Blocks that must be on the device before the run (written, flushed, not reported)."""
        ...

    def describe(self) -> dict: ...


def _positive(name: str, value, lo=1):
    if value < lo:
        raise ValueError(f"{name} = {value!r} must be >= {lo}")
    return value


def _check_generated(what: str, blocks: int) -> None:
    if blocks > MAX_GENERATED_BLOCKS:
        raise ValueError(f"{what} is {blocks:.3g} block references; a generated workload may have at most "
                         f"{MAX_GENERATED_BLOCKS:.0e} (it is built in memory before it runs)")


def check_time_scale(time_scale) -> float:
    lo, hi = TIME_SCALE_RANGE
    if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not lo <= time_scale <= hi:
        raise ValueError(f"time_scale = {_short.repr(time_scale)} must be a number in [{lo:g}, {hi:g}]")
    return float(time_scale)


def check_span(path, span_ns: float, line: str, first: str, time_scale: float, unit: str) -> None:
    """The trace's scaled span (``span_ns``, from its first request ``first`` to its last ``line``) within
    ``MAX_SPAN_NS``; ValueError naming the two requests otherwise."""
    if not span_ns <= MAX_SPAN_NS:  # inf and NaN too
        raise ValueError(f"{path}: {line} comes {span_ns / 1e9:.6g} s of virtual time after {first} (timestamps "
                         f"in {unit}, times time_scale {time_scale:g}): a trace may span at most "
                         f"{MAX_SPAN_NS / 1e9:.4g} s (2^63 ns, ~292 years); "
                         f"use a smaller --time-scale")


# ---- Mooncake JSONL ------------------------------------------------------------------
@dataclass
class MooncakeTrace:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids`` (one per 512-token block; shared leading ids = shared prefix).

    Each hash id becomes ``512 / tokens_per_block`` KV blocks (4 with 128-token
    blocks), so a request reads and writes model-sized blocks. Every request is
    its own stream, started at its timestamp (open loop), counted from the
    trace's first timestamp: epoch-millisecond timestamps (1.7e12) replay like
    ones from 0, and virtual time keeps its nanosecond resolution (a float
    near 1.7e18 ns has a 256 ns step).
    """

    path: str | Path
    block_bytes: int
    tokens_per_block: int = 128
    limit: int | None = None
    time_scale: float = 1.0  # < 1 compresses time (more load)
    name: str = "mooncake"
    bucket_by: str = "time"
    records: list[tuple[float, list[int]]] = field(init=False, repr=False)
    # (input_length, output_length) of each record, None where the record has no such field: the replay uses
    # only the hash ids; the serving simulation sizes its prompts and answers by them
    lengths: list[tuple[int | None, int | None]] = field(init=False, repr=False)

    def __post_init__(self):
        check_mooncake_tokens_per_block(self.tokens_per_block)
        if self.limit is not None:
            _positive("limit", self.limit)
        self.time_scale = check_time_scale(self.time_scale)
        self.records, self.lengths = [], []
        path = Path(self.path)
        if not path.is_file():
            raise ValueError(f"trace file {str(path)!r} does not exist")
        lo = hi = None  # (timestamp, line) of the earliest and the latest request
        parse = _mooncake_line_parser(self.blocks_per_hash)
        records, lengths, limit = self.records, self.lengths, self.limit
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(records) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    record, length = parse(line)
                except (ValueError, KeyError, TypeError, RecursionError) as exc:
                    raise ValueError(f"{path}:{lineno}: not a Mooncake record (need an object with timestamp "
                                     f">= 0 and hash_ids, a non-empty list of distinct integers whose KV block keys fit 64 bits; "
                                     f"input_length >= 1 and output_length >= 0, where given, integers, the input "
                                     f"within its hash blocks): {type(exc).__name__}: {exc}") from None
                records.append(record)
                lengths.append(length)
                ts = record[0]
                if lo is None or ts < lo[0]:
                    lo = (ts, lineno)
                if hi is None or ts > hi[0]:
                    hi = (ts, lineno)
        if not self.records:
            raise ValueError(f"{path}: no requests in the trace (the file is empty or holds only blank lines)")
        check_span(path, (hi[0] - lo[0]) * 1e6 * self.time_scale, f"line {hi[1]} (timestamp {hi[0]:g})",
                   f"line {lo[1]} (timestamp {lo[0]:g})", self.time_scale, "ms")

    @property
    def blocks_per_hash(self) -> int:
        return MOONCAKE_TOKENS_PER_HASH // self.tokens_per_block

    def keys_of(self, hash_ids: Sequence[int]) -> list[int]:
        n = self.blocks_per_hash
        return [h * n + j for h in hash_ids for j in range(n)]

    def phases(self) -> Iterator[Phase]:
        first = min(ts for ts, _ in self.records)
        yield Phase("trace", [Stream((ts - first) * 1e6 * self.time_scale, [Request(self.keys_of(ids))])
                              for ts, ids in self.records])

    def native_batches(self, whole: bool = False):
        """The native replay loop's feed (driver.Replay._feed_native): ("streams", (start_ns, None, None, keys per
        request, keys)) batches, each request its own stream, timed as ``phases`` times them (``whole`` changes
        nothing: the records are in memory)."""
        import numpy as np

        from .blocks import key_array

        first, n = min(ts for ts, _ in self.records), self.blocks_per_hash
        step = 1 << 16
        for i in range(0, len(self.records), step):
            chunk = self.records[i:i + step]
            starts = (np.array([ts for ts, _ in chunk], dtype=np.float64) - first) * 1e6 * self.time_scale
            ids = np.fromiter((h for _, hs in chunk for h in hs), dtype=np.uint64)
            keys = (ids[:, None] * np.uint64(n) + np.arange(n, dtype=np.uint64)).ravel()
            per_request = np.fromiter((len(hs) * n for _, hs in chunk), dtype=np.uint64, count=len(chunk))
            yield "streams", (starts, None, None, per_request, key_array(keys))

    def populate_keys(self):
        return ()

    def describe(self) -> dict:
        return {"trace": str(self.path), "requests": len(self.records),
                "block_references": sum(len(ids) for _, ids in self.records),
                "kv_blocks_per_hash": self.blocks_per_hash, "time_scale": self.time_scale}


def check_mooncake_tokens_per_block(tokens_per_block: int) -> None:
    if tokens_per_block < 1 or MOONCAKE_TOKENS_PER_HASH % tokens_per_block:
        raise ValueError(f"tokens_per_block = {tokens_per_block} must divide the Mooncake hash block "
                         f"of {MOONCAKE_TOKENS_PER_HASH} tokens")


def _is_plain_int(value) -> bool:
    """An integer, not a bool (JSON ``true`` is a Python ``True``, which ``isinstance(x, int)`` accepts)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _mooncake_record(rec: dict, blocks_per_hash: int = 1) -> tuple[float, list[int]]:
    ts, ids = rec["timestamp"], rec["hash_ids"]
    bits = KEY_BITS - (blocks_per_hash.bit_length() - 1)  # blocks_per_hash divides 512: a power of two
    bound = 1 << bits
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or (isinstance(ts, int) and ts > 1e300) \
            or not math.isfinite(ts) or ts < 0:  # a JSON integer of 400 digits is no float
        raise ValueError(f"timestamp = {_short.repr(ts)} must be a finite number >= 0")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"hash_ids = {_short.repr(ids)} must be a non-empty list of integers in [0, 2^{bits})")
    for i, h in enumerate(ids):
        if not _is_plain_int(h) or not 0 <= h < bound:  # no coercion: 1.7, true and "3" are errors
            raise ValueError(f"hash_ids = {_short.repr(ids)} must be a list of integers in [0, 2^{bits}): element {i} "
                             f"is {_short.repr(h)} ({type(h).__name__})")
    if len(set(ids)) != len(ids):  # a hash id names its whole prefix: it cannot come twice in one request
        seen: dict[int, int] = {}
        for i, h in enumerate(ids):
            if h in seen:
                raise ValueError(f"hash_ids = {_short.repr(ids)}: element {i} repeats element {seen[h]}, {h} (a "
                                 f"hash id names its whole prefix: a request holds each once)")
            seen[h] = i
    return float(ts), ids


def _mooncake_lengths(rec: dict) -> tuple[int | None, int | None]:
    out = []
    for name, low in (("input_length", 1), ("output_length", 0)):
        value = rec.get(name)
        if value is not None and (not _is_plain_int(value) or value < low):
            raise ValueError(f"{name} = {_short.repr(value)} must be an integer >= {low}")
        out.append(value)
    covered = len(rec["hash_ids"]) * MOONCAKE_TOKENS_PER_HASH
    if out[0] is not None and out[0] > covered:
        raise ValueError(f"input_length = {_short.repr(out[0])} is more than its {len(rec['hash_ids'])} hash blocks cover "
                         f"({covered} tokens)")
    return out[0], out[1]


_Parsed = tuple[tuple[float, list[int]], tuple[int | None, int | None]]  # (timestamp, hash ids), (input, output length)


def _parse_line_reference(line: bytes, blocks_per_hash: int = 1) -> _Parsed:
    """One Mooncake line, the specification: json.loads and the checks element by element (slow). The fast
    parser (``_mooncake_line_parser``) takes this path for every line it does not accept itself, so its
    errors are these, word for word."""
    rec = json.loads(line)
    if not isinstance(rec, dict):
        raise TypeError(f"the line is a JSON {type(rec).__name__}, not an object")
    record = _mooncake_record(rec, blocks_per_hash)
    return record, _mooncake_lengths(rec)


_LINE_PARSERS: dict = {}  # blocks per hash -> parse(line) -> _Parsed


def _mooncake_line_parser(blocks_per_hash: int = 1):
    """``parse(line)``, equal to ``_parse_line_reference(line, blocks_per_hash)`` (the same record and lengths,
    the same exception and message), several times faster on a plain Mooncake line.

    msgspec decodes the line into a Struct that admits only what the reference would accept unchanged: an
    object of exactly the four known fields (``forbid_unknown_fields``: the value of an extra field is never
    judged by msgspec, whose JSON is not json's: NaN, integers past 4300 digits, deep nesting, the bytes it
    accepts in strings), the timestamp a JSON number (``int | float``, so ``-0`` stays the integer 0 and no
    bool passes), the hash ids integers in [0, min(2^bits, 2^63)) (msgspec bounds fit an int64), the lengths
    integers or null. A duplicate key keeps its last value in both (where any one does not fit the Struct,
    msgspec refuses the line). What is left, in Python at C speed: the timestamp below 2^63 (so neither an
    integer beyond 64 bits nor a float msgspec rounded from one), a non-empty list of distinct ids, the input
    within its hash blocks. Anything else -- an error, an extra field, a UTF-8 BOM, a line msgspec refuses
    that json may take (NaN, 1e400) -- goes through the reference, which accepts or words the error."""
    parse = _LINE_PARSERS.get(blocks_per_hash)
    if parse is not None:
        return parse
    from typing import Annotated

    import msgspec

    bits = KEY_BITS - (blocks_per_hash.bit_length() - 1)
    hash_id = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(bits, 63)) - 1)]
    line_type = msgspec.defstruct(
        "MooncakeLine", [("timestamp", int | float), ("hash_ids", list[hash_id]),
                         ("input_length", Annotated[int, msgspec.Meta(ge=1)] | None, None),
                         ("output_length", Annotated[int, msgspec.Meta(ge=0)] | None, None)],
        forbid_unknown_fields=True, gc=False)
    decode = msgspec.json.Decoder(line_type).decode
    DecodeError = msgspec.DecodeError  # ValidationError is one
    ts_end, per_hash = float(1 << 63), MOONCAKE_TOKENS_PER_HASH

    def parse(line: bytes) -> _Parsed:
        try:
            rec = decode(line)
        except DecodeError:
            return _parse_line_reference(line, blocks_per_hash)
        ts, ids, n_in = rec.timestamp, rec.hash_ids, rec.input_length
        if 0 <= ts < ts_end and ids and len(set(ids)) == len(ids) \
                and (n_in is None or n_in <= len(ids) * per_hash):
            return (float(ts), ids), (n_in, rec.output_length)
        return _parse_line_reference(line, blocks_per_hash)

    _LINE_PARSERS[blocks_per_hash] = parse
    return parse


# ---- HyMCache microbenchmark ----------------------------------------------------------
@dataclass
class HymcacheMicrobench:
    """C concurrent requests, each appending B new KV blocks per turn. Turn 1
    only writes; from turn 2 each request first reads its whole prefix in
    order, then appends. Paper setting: C=64, B=32, 16/64/168 MB blocks."""

    block_bytes: int
    concurrency: int = 64
    blocks_per_turn: int = 32
    turns: int = 6
    name: str = "microbench"
    bucket_by: str = "phase"

    def __post_init__(self):
        _positive("concurrency", self.concurrency)
        _positive("blocks_per_turn", self.blocks_per_turn)
        _positive("turns", self.turns)
        _check_generated(f"concurrency x blocks_per_turn x turns x (turns + 1) / 2 = {self.concurrency} x "
                         f"{self.blocks_per_turn} x {self.turns} x {self.turns + 1} / 2",
                         self.concurrency * self.blocks_per_turn * self.turns * (self.turns + 1) // 2)

    def phases(self) -> Iterator[Phase]:
        per_request = self.turns * self.blocks_per_turn
        for turn in range(1, self.turns + 1):
            upto = turn * self.blocks_per_turn
            yield Phase(f"turn {turn}", [Stream(0.0, [Request(range(r * per_request, r * per_request + upto))])
                                         for r in range(self.concurrency)])

    def populate_keys(self):
        return ()

    def describe(self) -> dict:
        return {"concurrency": self.concurrency, "blocks_per_turn": self.blocks_per_turn, "turns": self.turns,
                "footprint_bytes": self.concurrency * self.blocks_per_turn * self.turns * self.block_bytes}


# ---- multi-turn conversations ----------------------------------------------------------
@dataclass
class ConversationGenerator:
    """Multi-turn chat sessions, parameterised like LMSYS-Chat-1M replays.

    Sessions arrive as a Poisson process; each has a geometric number of turns;
    a turn adds a user prompt and a model response to the context (both
    lognormal token counts), and the next turn comes after an exponential think
    time. A turn's request is the whole context so far (a growing prefix).
    Defaults: LMSYS-Chat-1M (Zheng et al., 2023, Table 1) reports 2.0 turns,
    69.5 prompt and 214.5 response tokens on average per conversation turn.
    """

    block_bytes: int
    tokens_per_block: int = 128
    sessions: int = 200
    mean_turns: float = 2.0
    mean_prompt_tokens: float = 69.5
    mean_response_tokens: float = 214.5
    system_prompt_tokens: int = 0  # a shared leading prefix (same keys in every session)
    mean_think_s: float = 30.0
    sessions_per_s: float = 1.0
    seed: int = 0
    name: str = "conversation"
    bucket_by: str = "time"
    KEY_STRIDE = 1 << 24  # keys of session s: s * stride + block index (session 0 = the shared prefix)

    def __post_init__(self):
        _positive("sessions", self.sessions)
        _positive("tokens_per_block", self.tokens_per_block)
        if not 1 <= self.mean_turns <= MAX_MEAN_TURNS:
            raise ValueError(f"mean_turns = {self.mean_turns!r} must be in [1, {MAX_MEAN_TURNS}]")
        for name in ("mean_prompt_tokens", "mean_response_tokens"):
            if not 0 < getattr(self, name) <= MAX_MEAN_TOKENS:
                raise ValueError(f"{name} = {getattr(self, name)!r} must be in (0, {MAX_MEAN_TOKENS:.0e}]")
        if not 0 < self.sessions_per_s < math.inf:
            raise ValueError(f"sessions_per_s = {self.sessions_per_s!r} must be > 0 and finite")
        if not 0 <= self.mean_think_s < math.inf:
            raise ValueError(f"mean_think_s = {self.mean_think_s!r} must be >= 0 and finite")
        if not 0 <= self.system_prompt_tokens < self.KEY_STRIDE * self.tokens_per_block:
            raise ValueError(f"system_prompt_tokens = {self.system_prompt_tokens} must be in [0, "
                             f"{self.KEY_STRIDE * self.tokens_per_block}) (2^24 blocks of {self.tokens_per_block} "
                             f"tokens: the keys of one session)")
        # Expected size and span, before anything is drawn: the draw itself could take forever.
        turns = self.sessions * self.mean_turns
        _check_generated(f"sessions x mean_turns x (system prompt blocks + 1) = {self.sessions} x {self.mean_turns:g}"
                         f" x {self.system_prompt_tokens // self.tokens_per_block + 1}",
                         int(turns * (self.system_prompt_tokens // self.tokens_per_block + 1)))
        span_ns = (self.sessions / self.sessions_per_s + self.mean_turns * self.mean_think_s) * 1e9
        if not span_ns <= MAX_SPAN_NS:
            raise ValueError(f"sessions / sessions_per_s + mean_turns x mean_think_s = {span_ns / 1e9:.4g} s of "
                             f"virtual time; a workload may span at most {MAX_SPAN_NS / 1e9:.4g} s (2^63 ns)")

    def phases(self) -> Iterator[Phase]:
        rng = random.Random(self.seed)
        sys_blocks = self.system_prompt_tokens // self.tokens_per_block
        key_stride = self.KEY_STRIDE
        drawn = 0  # block references so far: the draw may exceed the expectation checked up front
        streams, start = [], 0.0

        def tokens(mean: float) -> int:  # lognormal with sigma 1, scaled to the given mean
            return max(1, int(rng.lognormvariate(0.0, 1.0) / 1.6487212707 * mean))

        for s in range(1, self.sessions + 1):
            start += rng.expovariate(self.sessions_per_s) * 1e9
            turns = 1
            while rng.random() > 1.0 / self.mean_turns:
                turns += 1
            context, requests = 0, []
            for t in range(turns):
                context += tokens(self.mean_prompt_tokens)
                blocks = context // self.tokens_per_block  # full blocks of the prompt are looked up / stored
                drawn += sys_blocks + blocks
                if blocks >= key_stride or drawn > MAX_GENERATED_BLOCKS:
                    raise ValueError(f"session {s} turn {t + 1}: its context of {context} tokens ({blocks} blocks) "
                                     f"brings the workload to {drawn:.3g} block references; at most "
                                     f"{key_stride} blocks per session and {MAX_GENERATED_BLOCKS:.0e} in all "
                                     f"(smaller mean_prompt_tokens / mean_response_tokens / mean_turns / sessions)")
                keys = list(range(sys_blocks)) + list(range(s * key_stride, s * key_stride + blocks))
                think = 0.0 if t == 0 else rng.expovariate(1.0 / self.mean_think_s) * 1e9 if self.mean_think_s else 0.0
                requests.append(Request(keys, think))
                context += tokens(self.mean_response_tokens)
            streams.append(Stream(start, requests))
        yield Phase("conversations", streams)

    def populate_keys(self):
        return ()

    def describe(self) -> dict:
        return {k: getattr(self, k) for k in ("sessions", "mean_turns", "mean_prompt_tokens", "mean_response_tokens",
                                              "system_prompt_tokens", "mean_think_s", "sessions_per_s", "seed")}


# ---- random reads ----------------------------------------------------------------------
@dataclass
class RandomReadBench:
    """Heavy random reads of whole objects from a populated region: C clients,
    each reading ``reads_per_client`` objects chosen uniformly at random."""

    block_bytes: int
    region_bytes: int
    concurrency: int = 8
    reads_per_client: int = 256
    seed: int = 0
    name: str = "randread"
    bucket_by: str = "phase"

    def __post_init__(self):
        _positive("concurrency", self.concurrency)
        _positive("reads_per_client", self.reads_per_client)
        if self.region_bytes < self.block_bytes:
            raise ValueError(f"region_bytes = {self.region_bytes} must hold at least one object of {self.block_bytes} bytes")
        _check_generated(f"region_bytes / block_bytes = {self.region_bytes} / {self.block_bytes} objects to populate",
                         self.objects)
        _check_generated(f"concurrency x reads_per_client = {self.concurrency} x {self.reads_per_client}",
                         self.concurrency * self.reads_per_client)

    @property
    def objects(self) -> int:
        return self.region_bytes // self.block_bytes

    def phases(self) -> Iterator[Phase]:
        rng = random.Random(self.seed)
        # Each client reads a list of objects it "has": a one-request stream whose
        # keys are all resident on the device, so the whole list is read in order.
        yield Phase("random reads", [Stream(0.0, [Request([rng.randrange(self.objects) for _ in range(self.reads_per_client)])])
                                     for _ in range(self.concurrency)])

    def populate_keys(self):
        return range(self.objects)

    def describe(self) -> dict:
        return {"region_bytes": self.region_bytes, "objects": self.objects, "concurrency": self.concurrency,
                "reads_per_client": self.reads_per_client, "seed": self.seed}
