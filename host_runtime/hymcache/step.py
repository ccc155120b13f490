"""What a KV connector sees of one engine step, as connector.py's classes take it: vLLM v1's scheduler output
folded into plain records, and vLLM's attention layer names. vllm_connector.py builds these from vLLM's own
objects; engine.py (the test fixture engine) from its scheduler. A module of its own, so that the vLLM path
imports nothing of engine.py."""

from __future__ import annotations

from dataclasses import dataclass

LAYER_NAME = "model.layers.{}.self_attn.attn"  # vLLM's attention layer names


def layer_name(layer: int) -> str:
    return LAYER_NAME.format(layer)


@dataclass
class ScheduledRequest:
    """One request in a step: NewRequestData / CachedRequestData of vLLM folded into one."""

    request_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int       # before this step
    num_scheduled_tokens: int
    is_new: bool                   # first time scheduled (or scheduled again after a load error)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    finished_req_ids: set[str]     # finished since the last step (vLLM passes them to get_finished)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}
