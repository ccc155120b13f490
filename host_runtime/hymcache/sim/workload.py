"""Multi-turn chat with LMSYS-Chat-1M statistics, as the paper's Fig. 13 runs it.

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
