"""The paged SmolLM2 engine: the reference it is, the order it drives a connector in, and why loaded KV
gives the same tokens (chunks on block boundaries). Connectors here are in-test fakes; the real one is
tested in test_connector.py."""

import pytest
import torch

from driver.errors import ChmError
from host_runtime.hymcache.engine import KVCacheBlocks, PagedEngine, layer_name

BS = 16


def prompt(tok, text="What is the capital of France?"):
    return tok.encode(tok.chat_prompt(text))


class MemoryConnector:
    """Both roles of a connector in one object, storing block KV in a dict (keyed by the token prefix).
    Records every call, so the test can check vLLM's order; ``fail_block`` makes that block index of a
    load an error."""

    def __init__(self, fail_block=None):
        self.store, self.calls, self.fail_block = {}, [], fail_block
        self.matched, self.loads, self.errors = {}, {}, set()

    def _rec(self, name):
        self.calls.append(name)

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._rec("get_num_new_matched_tokens")
        ids, n = request.prompt_token_ids, 0
        while (n + 1) * BS <= len(ids) - 1 and tuple(ids[:(n + 1) * BS]) in self.store:
            n += 1
        self.matched[request.request_id] = n
        return n * BS, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._rec("update_state_after_alloc")
        if num_external_tokens:
            self.loads[request.request_id] = (list(request.prompt_token_ids),
                                              blocks.get_block_ids()[0][:num_external_tokens // BS])

    def build_connector_meta(self, scheduler_output):
        self._rec("build_connector_meta")
        meta = {"load": {}, "save": {}}
        for s in scheduler_output.scheduled:
            if s.request_id in self.loads:
                meta["load"][s.request_id] = self.loads.pop(s.request_id)
            if s.num_computed_tokens < len(s.prompt_token_ids) <= s.num_computed_tokens + s.num_scheduled_tokens:
                meta["save"][s.request_id] = (list(s.prompt_token_ids), list(s.block_ids))
        return meta

    def request_finished(self, request, block_ids):
        self._rec("request_finished")
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches):
        self._rec("register_kv_caches")
        self.kv = list(kv_caches.values())

    def bind_connector_metadata(self, meta):
        self._rec("bind_connector_metadata")
        self.meta = meta

    def start_load_kv(self, forward_context):
        self._rec("start_load_kv")
        for rid, (ids, blocks) in self.meta["load"].items():
            for i, b in enumerate(blocks):
                if i == self.fail_block:
                    self.errors.update(blocks[i:])
                    break
                data = self.store[tuple(ids[:(i + 1) * BS])]
                for layer, kv in enumerate(self.kv):
                    kv[b].copy_(data[layer])

    def wait_for_layer_load(self, name):
        self._rec("wait_for_layer_load")

    def save_kv_layer(self, name, kv_layer, attn_metadata):
        self._rec("save_kv_layer")

    def wait_for_save(self):
        self._rec("wait_for_save")
        for rid, (ids, blocks) in self.meta["save"].items():
            for i in range(len(ids) // BS):
                key = tuple(ids[:(i + 1) * BS])
                self.store.setdefault(key, [kv[blocks[i]].clone() for kv in self.kv])

    def get_finished(self, finished):
        self._rec("get_finished")
        return None, None

    def get_block_ids_with_load_errors(self):
        self._rec("get_block_ids_with_load_errors")
        errors, self.errors = self.errors, set()
        return errors

    def clear_connector_metadata(self):
        self._rec("clear_connector_metadata")

    def shutdown(self):
        self._rec("shutdown")


def test_reference_engine_matches_a_whole_prompt_prefill(smol):
    """Chunked prefill over the paged cache and greedy decode give the model's own next tokens."""
    model, tok = smol
    ids = prompt(tok)
    eng = PagedEngine(model, chunk_size=BS, num_blocks=16)
    req = eng.generate("r", ids, 4)
    full = model.prefill(torch.tensor(ids + req.output_token_ids[:-1]))[0]
    assert full[len(ids) - 1:].argmax(-1).tolist() == req.output_token_ids
    assert (full[len(ids) - 1] - req.first_token_logits).abs().max().item() < 1e-3
    assert req.recomputed_tokens == len(ids) and req.reused_tokens == 0
    assert req.steps == -(-len(ids) // BS) + 3  # one chunk per step, then one token per step
    assert sorted(eng.free_blocks) == list(range(16))  # every block back


def test_loaded_blocks_give_identical_logits_and_calls_follow_vllms_order(smol):
    model, tok = smol
    turn1 = prompt(tok)
    conn = MemoryConnector()
    eng = PagedEngine(model, chunk_size=BS, num_blocks=32, connector=(conn, conn))
    assert conn.calls == ["register_kv_caches"]
    first = eng.generate("t1", turn1, 3)
    assert first.reused_tokens == 0 and len(conn.store) == len(turn1) // BS
    turn2 = turn1 + first.output_token_ids + tok.encode("<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>\n"
                                                       "<|im_start|>assistant\n")
    conn.calls = []
    second = eng.generate("t2", turn2, 3)
    ref = PagedEngine(model, chunk_size=BS, num_blocks=32).generate("ref", turn2, 3)
    assert second.reused_tokens == len(turn1) // BS * BS > 0
    assert second.recomputed_tokens == len(turn2) - second.reused_tokens
    assert second.output_token_ids == ref.output_token_ids
    assert torch.equal(second.first_token_logits, ref.first_token_logits)  # bit for bit, not just close
    layers = model.cfg.n_layers
    step = (["build_connector_meta", "bind_connector_metadata", "start_load_kv"]
            + ["wait_for_layer_load", "save_kv_layer"] * layers
            + ["wait_for_save", "get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata"])
    first_step = ["get_num_new_matched_tokens", "update_state_after_alloc"] + step
    assert conn.calls[:len(first_step)] == first_step
    rest = conn.calls[len(first_step):]
    assert rest[-1] == "request_finished" and rest[:-1] == step * (second.steps - 1)
    eng.shutdown()
    assert conn.calls[-1] == "shutdown"


def test_a_load_error_keeps_the_prefix_before_it_and_recomputes_the_rest(smol):
    model, tok = smol
    ids = prompt(tok, "Name three colours of the rainbow, please, in the order they appear, and say why the sky "
                      "is blue.")
    assert len(ids) > 3 * BS
    conn = MemoryConnector(fail_block=1)
    eng = PagedEngine(model, chunk_size=BS, num_blocks=32, connector=(conn, conn))
    eng.generate("a", ids, 2)
    again = eng.generate("b", ids, 2)  # every full block is stored; block 1 fails to load
    ref = PagedEngine(model, chunk_size=BS, num_blocks=32).generate("ref", ids, 2)
    assert again.reused_tokens == BS and again.recomputed_tokens == len(ids) - BS
    assert again.output_token_ids == ref.output_token_ids
    assert torch.equal(again.first_token_logits, ref.first_token_logits)


def test_inputs_and_connector_answers_are_checked(smol):
    model, tok = smol
    with pytest.raises(ChmError, match="chunk_size 0 is outside the allowed range"):
        PagedEngine(model, chunk_size=0)
    eng = PagedEngine(model, chunk_size=BS, num_blocks=4)
    with pytest.raises(ChmError, match=r"prompt_token_ids holds -1, outside the allowed range \[0, 49151\]"):
        eng.add_request("x", [1, -1], 2)
    with pytest.raises(ChmError, match="needs 5 blocks; the engine has num_blocks 4"):
        eng.add_request("x", list(range(70)), 2)
    with pytest.raises(ChmError, match="max_tokens 0 is outside"):
        eng.add_request("x", [1], 0)

    class Greedy(MemoryConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return len(request.prompt_token_ids), False  # the whole prompt: nothing left to compute

    conn = Greedy()
    eng = PagedEngine(model, chunk_size=BS, num_blocks=8, connector=(conn, conn))
    eng.add_request("y", list(range(32)), 1)
    with pytest.raises(ChmError, match=r"connector matched 32 tokens .* allowed: a multiple of 16 in \[0, 31\]"):
        eng.step()
    assert KVCacheBlocks([3, 4]).get_block_ids() == ([3, 4],) and layer_name(2) == "model.layers.2.self_attn.attn"
