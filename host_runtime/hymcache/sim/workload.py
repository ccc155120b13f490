"""Multi-turn workloads: chat with LMSYS-Chat-1M statistics (Fig. 13) and AIPerf-style synthetic
conversations (Fig. 10, 12).

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
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

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


def conversations(n: int, turns: int, *, mean_prompt_tokens: float = LMSYS_PROMPT_TOKENS,
                  mean_response_tokens: float = LMSYS_RESPONSE_TOKENS, seed: int = 0) -> list[list[Turn]]:
    """``result[t - 1]``: turn t of every conversation, in conversation order."""
    rng = random.Random(seed)

    def tokens(mean: float) -> int:  # as ConversationGenerator.phases draws them
        return max(1, int(rng.lognormvariate(0.0, 1.0) / _LOGNORMAL_MEAN * mean))

    by_turn: list[list[Turn]] = [[] for _ in range(turns)]
    for c in range(n):
        history = prev = 0
        for t in range(1, turns + 1):
            history += tokens(mean_prompt_tokens)
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


def reusable_footprint_bytes(turns: list[list[Turn]], bytes_per_token: int) -> int:
    """KV the last turn can reuse: the previous turn's inputs (what a tier must hold for the last turn to hit)."""
    return sum(t.input_tokens for t in turns[-2]) * bytes_per_token if len(turns) > 1 else 0
