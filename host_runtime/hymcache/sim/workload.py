"""Workloads: multi-turn chat with LMSYS-Chat-1M statistics (Fig. 13, 15), AIPerf-style synthetic
conversations (Fig. 10, 12) and Mooncake JSONL traces (open loop, at the trace's timestamps).

LMSYS-style chat (``conversations``):

Token statistics are the replayer's ``ConversationGenerator``'s (``replay/traces.py``): its defaults
are LMSYS-Chat-1M's 69.5 prompt and 214.5 response tokens per turn (Zheng et al., 2023, Table 1),
each drawn lognormal with sigma 1 scaled to the mean, at least 1. The means are imported from
that class, so there is one definition of them.

What differs from the replay generator, and why (it cannot be used as is):

* every conversation runs ``turns`` turns (the figure's x axis is turn 1..10 over all 512
  conversations; the generator draws a geometric number of turns with mean 2);
* the simulation needs token counts (the partial last block is computed, the prefill FLOPs depend
  on positions), the generator gives block keys only;
* arrivals are closed-loop (a client with ``concurrency`` requests in flight, turn by turn), not
  Poisson sessions.

Turn t of a conversation sends its whole history: the prompts of turns 1..t and the recorded
responses of turns 1..t-1 (the responses come from the data set, not from the model: the model
decodes ``max_tokens``). The KV the previous turn computed is its input: the next turn can reuse
its full blocks.

``turn_tokens`` (Fig. 13, 15: the paper's workload characterization, "the prefix-read footprint added
between Turn 6 and Turn 7 alone exceeds 64 GB": 64 GB over 512 conversations at 128 KiB of KV a token is
953 tokens a turn) scales both means by one factor, so a turn adds that many tokens on average and
LMSYS's prompt-to-response split (69.5 : 214.5) stays; 0 leaves them as they are.

``min_prompt_tokens`` (Fig. 15: LMSYS requests with inputs over 2K characters, at 4 characters per
token) draws every user prompt from the same lognormal conditioned on at least that many tokens
(inverse CDF of the normal's upper tail: one draw per prompt, no rejection loop); 0 leaves the draws
exactly as they are without it.

Mooncake JSONL traces (``mooncake_requests``): the replayer's reader (``replay/traces.py``
``MooncakeTrace``: its checks, its 512-token hash ids mapped to model-sized blocks, its timestamps counted
from the first and scaled) gives each request's block keys and arrival. The trace has no sessions (its
requests share prefixes -- every one starts with hash 0 -- rather than extend one another: 12 of its
12,031 requests extend an earlier request whole), so it is not cut into conversations and turns: each
request is submitted at its timestamp (open loop, ``worker.open_client``), its block keys are its hash
ids' blocks (a key names its whole prefix, as a Mooncake hash does), and a report row is a window of
``window_s`` seconds of arrivals (``Turn.turn`` is the window's index; a window without arrivals has no row). A request's input is its ``input_length`` (its hash blocks in full where the record has none) and its output
its ``output_length`` (at least 1; the settings' ``max_tokens`` where the record has none). Its *reusable*
prefix is the leading whole blocks an earlier request (in arrival order) computed.

Recorded turns (``recorded_turns``, ``workload.kind = turns``): a JSON file (``TurnsFile``, written by
``write_turns``) of the tokens each turn of each conversation adds, as a client sent them -- ``bench/bench_vllm.py``
writes the one it sends to the real ``vllm serve``, so the simulator runs exactly that workload. History rule:
turn t sends every earlier turn's added tokens and answer (``output_tokens`` each, decoded live) and its own
added tokens. The turns are served as the turn-barrier client serves them: turn 1 of every conversation in
conversation order, then turn 2, ...; with ``concurrency`` 1, each request alone (bench_vllm's client).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from common.checks import Checks
from host_runtime.replay.traces import ConversationGenerator

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ConversationGenerator)}
LMSYS_PROMPT_TOKENS = _DEFAULTS["mean_prompt_tokens"]
LMSYS_RESPONSE_TOKENS = _DEFAULTS["mean_response_tokens"]
_LOGNORMAL_MEAN = 1.6487212707  # e^(1/2): the mean of lognormal(0, 1), as ConversationGenerator scales it


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int              # 1-based
    input_tokens: int      # the whole history sent this turn
    prev_input_tokens: int  # the previous turn's input (its KV was computed then); 0 on turn 1
    shared_tokens: int = 0  # the first tokens are a prefix every conversation shares (AIPerf's prefix prompt)
    worker: int = 0         # the prefill worker the router sends the conversation to
    keys: tuple = ()        # a trace's block keys (each names its whole prefix); () for the generated workloads
    arrival_ns: float = 0.0  # a trace's request: when it is submitted (open loop)
    output_tokens: int | None = None  # a trace's request, a recorded turn: its answer's tokens (None: max_tokens)


def scaled_means(mean_prompt_tokens: float, mean_response_tokens: float, turn_tokens: float) -> tuple[float, float]:
    """The prompt and response means scaled so that a turn adds ``turn_tokens`` on average, in their own split
    (0: as they are)."""
    if not turn_tokens:
        return mean_prompt_tokens, mean_response_tokens
    scale = turn_tokens / (mean_prompt_tokens + mean_response_tokens)
    return mean_prompt_tokens * scale, mean_response_tokens * scale


def conversations(n: int, turns: int, *, mean_prompt_tokens: float = LMSYS_PROMPT_TOKENS,
                  mean_response_tokens: float = LMSYS_RESPONSE_TOKENS, turn_tokens: float = 0.0,
                  min_prompt_tokens: int = 0, seed: int = 0) -> list[list[Turn]]:
    """``result[t - 1]``: turn t of every conversation, in conversation order. ``turn_tokens``: the mean tokens a
    turn adds to a conversation's history (prompt + response, in the means' split; 0: the means as given).
    ``min_prompt_tokens``: every prompt is drawn conditioned on at least that many tokens (module docstring)."""
    rng = random.Random(seed)
    mean_prompt_tokens, mean_response_tokens = scaled_means(mean_prompt_tokens, mean_response_tokens, turn_tokens)

    def tokens(mean: float) -> int:  # as ConversationGenerator.phases draws them
        return max(1, int(rng.lognormvariate(0.0, 1.0) / _LOGNORMAL_MEAN * mean))

    tail, inv = 0.0, NormalDist().inv_cdf
    if min_prompt_tokens > 0:
        # lognormal(0, 1) / e^(1/2) x mean >= m  <=>  z >= a = ln(m e^(1/2) / mean); z from the tail above a
        tail = NormalDist().cdf(-math.log(min_prompt_tokens * _LOGNORMAL_MEAN / mean_prompt_tokens))
        if tail <= 0.0:
            raise ValueError(f"min_prompt_tokens = {min_prompt_tokens} is beyond the prompt distribution of mean "
                             f"{mean_prompt_tokens} (its tail there is below the float's resolution)")

    def prompt(mean: float) -> int:
        if not min_prompt_tokens:
            return tokens(mean)
        z = -inv(tail * (1.0 - rng.random()))  # 1 - random() is in (0, 1]: z >= a
        return max(min_prompt_tokens, int(math.exp(z) / _LOGNORMAL_MEAN * mean))

    by_turn: list[list[Turn]] = [[] for _ in range(turns)]
    for c in range(n):
        history = prev = 0
        for t in range(1, turns + 1):
            history += prompt(mean_prompt_tokens)
            by_turn[t - 1].append(Turn(c, t, history, prev))
            prev = history
            history += tokens(mean_response_tokens)
    return by_turn


def aiperf_conversations(n: int, turns: int, *, input_tokens: float, input_tokens_stddev: float = 0.0,
                         output_tokens: int, prefix_ratio: float = 0.0, prefill_workers: int = 1,
                         seed: int = 0) -> list[list[Turn]]:
    """AIPerf-style synthetic multi-turn conversations (``aiperf profile --conversation-num N
    --conversation-turn-mean T --synthetic-input-tokens-mean ISL --synthetic-input-tokens-stddev S
    --output-tokens-mean OSL``), as AIPerf's default context mode for synthetic data
    (``deltas_without_responses``) replays them: turn t sends the whole history -- every earlier
    user delta and the model's live answers (``output_tokens`` each) -- and its own ISL tokens.

    * every turn's user delta: ``round(normal(ISL, S))`` tokens, at least 1 (AIPerf's synthetic
      prompt generator draws its length this way);
    * ``prefix_ratio``: the first ``round(prefix_ratio x ISL)`` tokens of every conversation's first turn
      are one prefix prompt all conversations share (AIPerf's ``--prompt-prefix-pool-size 1
      --prompt-prefix-length L`` with ``L = prefix_ratio x ISL``, counted inside the ISL);
    * ``prefill_workers``: the router's session affinity: conversation c goes to prefill worker
      ``c % prefill_workers`` every turn (a per-worker cache can only serve its own conversations).
    """
    if not 0.0 <= prefix_ratio <= 1.0:
        raise ValueError(f"prefix_ratio = {prefix_ratio} must be in [0, 1]")
    rng = random.Random(seed)
    shared = int(round(prefix_ratio * input_tokens))

    def delta() -> int:
        if input_tokens_stddev <= 0:
            return max(1, int(round(input_tokens)))
        return max(1, int(round(rng.gauss(input_tokens, input_tokens_stddev))))

    by_turn: list[list[Turn]] = [[] for _ in range(turns)]
    for c in range(n):
        history = prev = 0
        for t in range(1, turns + 1):
            d = delta()
            if t == 1:
                d = max(d, shared + 1)  # the shared prefix sits inside the first turn's input
            history += d
            by_turn[t - 1].append(Turn(c, t, history, prev, shared, c % prefill_workers))
            prev = history
            history += output_tokens
    return by_turn


def mooncake_requests(path, *, tokens_per_block: int, block_bytes: int, limit: int | None = None,
                      time_scale: float = 1.0, window_s: float = 600.0, prefill_workers: int = 1) -> list[list[Turn]]:
    """A Mooncake JSONL trace (module docstring): the requests of every window (``window_s`` seconds of scaled
    arrival time) that has any, window by window, each in arrival order; ``Turn.turn`` is the window's number
    (w: arrivals in [(w - 1) x window_s, w x window_s)), so empty windows cost nothing, as in ``chm replay``.
    Request i is ``Turn.conversation`` i, routed to prefill worker ``i % prefill_workers``. ValueError for a
    bad file (the reader's message)."""
    from host_runtime.replay.traces import MooncakeTrace

    if not window_s > 0:
        raise ValueError(f"window_s = {window_s!r} must be > 0")
    trace = MooncakeTrace(path, block_bytes, tokens_per_block, limit=limit, time_scale=time_scale)
    phase = next(iter(trace.phases()))  # one stream per request, started at its scaled timestamp (ns from the first)
    streams = sorted(enumerate(phase.streams), key=lambda s: (s[1].start_ns, s[0]))  # the trace's order on ties
    window_ns = window_s * 1e9
    seen: set[int] = set()
    by_window: list[list[Turn]] = []
    for i, (record, stream) in enumerate(streams):
        keys = tuple(stream.requests[0].keys)
        input_length, output_length = trace.lengths[record]
        input_tokens = len(keys) * tokens_per_block if input_length is None else input_length
        full = input_tokens // tokens_per_block  # the blocks it computes whole: what a later request can reuse
        reusable = 0
        while reusable < full and keys[reusable] in seen:
            reusable += 1
        seen.update(keys[:full])
        w = int(stream.start_ns // window_ns) + 1
        if not by_window or by_window[-1][0].turn != w:  # arrival order: a new window, the previous one done
            by_window.append([])
        by_window[-1].append(Turn(i, w, input_tokens, reusable * tokens_per_block, worker=i % prefill_workers,
                                     keys=keys, arrival_ns=stream.start_ns,
                                     output_tokens=None if output_length is None else max(1, output_length)))
    return by_window


TURNS_FORMAT = "chm-turns/1"
MAX_TURN_TOKENS = 1_000_000  # tokens one turn may add (or answer): the settings' per-turn bounds
_TurnTokens = Annotated[int, Meta(ge=1, le=MAX_TURN_TOKENS)]


class TurnsFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A recorded multi-turn workload (module docstring), typed with its ranges."""

    format: Literal["chm-turns/1"]
    source: Annotated[str, Meta(max_length=4096)] = ""  # what made it (a command), for the reader
    output_tokens: _TurnTokens  # each turn's answer: decoded, then part of the next turn's history
    # [conversation][turn - 1]: the tokens turn t adds (its user prompt)
    conversations: Annotated[list[Annotated[list[_TurnTokens], Meta(min_length=1, max_length=1000)]],
                             Meta(min_length=1, max_length=1_000_000)]


def write_turns(path, added: list[list[int]], output_tokens: int, source: str = "") -> Path:
    """Write a ``TurnsFile`` (checked as ``recorded_turns`` reads it) and return its path."""
    spec = Checks(ValueError).convert({"format": TURNS_FORMAT, "source": source, "output_tokens": output_tokens,
                                       "conversations": added}, TurnsFile, "turns: ")
    path = Path(path)
    path.write_bytes(msgspec.json.encode(spec) + b"\n")
    return path


def read_turns_file(path) -> TurnsFile:
    """The ``TurnsFile`` at ``path``; ValueError naming the file, the field, the value and the range."""
    path = Path(path)
    where = f"{path}: "
    try:
        data = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"{where}{exc.strerror}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"{where}not JSON ({exc})") from None
    return Checks(ValueError).convert(data, TurnsFile, where)


def recorded_turns(path) -> list[list[Turn]]:
    """``result[t - 1]``: turn t of every conversation that has one, in conversation order (module docstring)."""
    spec = read_turns_file(path)
    by_turn: list[list[Turn]] = [[] for _ in range(max(len(c) for c in spec.conversations))]
    for c, added in enumerate(spec.conversations):
        history = prev = 0
        for t, n in enumerate(added, 1):
            history += n
            by_turn[t - 1].append(Turn(c, t, history, prev, output_tokens=spec.output_tokens))
            prev = history
            history += spec.output_tokens
    return by_turn


def footprints(turns: list[list[Turn]], bytes_per_token: int, tokens_per_block: int) -> dict:
    """``kv_footprint_bytes``: KV of the last turn's histories (a trace: of its distinct blocks);
    ``reusable_footprint_bytes``: what the last turn can reuse, the previous turn's inputs (a trace: the
    distinct blocks some later request reuses)."""
    if any(t.keys for batch in turns for t in batch):
        distinct: set = set()
        reused: set = set()
        for batch in turns:
            for t in batch:
                distinct.update(t.keys)
                reused.update(t.keys[:t.prev_input_tokens // tokens_per_block])
        block = bytes_per_token * tokens_per_block
        return {"kv_footprint_bytes": len(distinct) * block, "reusable_footprint_bytes": len(reused) * block,
                "trace": True}
    return {"kv_footprint_bytes": sum(t.input_tokens for t in turns[-1]) * bytes_per_token,
            "reusable_footprint_bytes": reusable_footprint_bytes(turns, bytes_per_token),
            "prefix_growth_bytes": prefix_growth_bytes(turns, bytes_per_token)}


def prefix_growth_bytes(turns: list[list[Turn]], bytes_per_token: int) -> dict[str, int]:
    """``{"6-7": bytes}``: the prefix-read footprint (the history each turn can reuse) added from one turn to the
    next, over all conversations -- the paper's measure ("added between Turn 6 and Turn 7")."""
    reads = [sum(t.prev_input_tokens for t in batch) * bytes_per_token for batch in turns]
    return {f"{t}-{t + 1}": reads[t] - reads[t - 1] for t in range(1, len(reads))}


def reusable_footprint_bytes(turns: list[list[Turn]], bytes_per_token: int) -> int:
    """KV the last turn can reuse: the previous turn's inputs (what a tier must hold for the last turn to hit)."""
    return sum(t.input_tokens for t in turns[-2]) * bytes_per_token if len(turns) > 1 else 0
