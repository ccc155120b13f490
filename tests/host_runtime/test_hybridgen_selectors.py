"""Token selectors behind one interface."""

import torch

from host_runtime.hybridgen.selectors import (AccumulatedScore, AllTokens, InfiniGenSpeculation, Keyformer,
                                              RecentWithSinks, SelectionRequest, StreamingLLM, TopKLogits)
from host_runtime.hybridgen.attention import attention_logits


def request(k, s=20, logits=None, **kw):
    return SelectionRequest(layer=0, k=k, positions=torch.arange(s), n_tokens=s + 8, logits=logits, **kw)


def test_all_tokens_keeps_everything():
    assert AllTokens().select(request(3)).tolist() == list(range(20))


def test_topk_picks_the_highest_logits_in_order():
    logits = torch.full((9, 20), -5.0)
    logits[:, [17, 2, 9]] = 5.0
    assert TopKLogits().select(request(3, logits=logits)).tolist() == [2, 9, 17]


def test_recent_with_sinks():
    assert RecentWithSinks(sinks=4).select(request(7)).tolist() == [0, 1, 2, 3, 17, 18, 19]
    assert RecentWithSinks(sinks=4).select(request(50)).tolist() == list(range(20))


def test_streamingllm_window_counts_the_whole_context():
    # 28 tokens in context, window 12 -> positions >= 16 kept, plus 4 sinks
    assert StreamingLLM(sinks=4, window=12).select(request(1)).tolist() == [0, 1, 2, 3, 16, 17, 18, 19]


def test_h2o_evicts_permanently_and_keeps_heavy_hitters():
    h2o = AccumulatedScore()
    h2o.observe(0, torch.arange(20), torch.eye(20)[[5, 5, 11]].T.T.repeat(3, 1)[:9] * 0 + torch.nn.functional.one_hot(
        torch.tensor([5] * 5 + [11] * 4), 20).float())
    flat = torch.zeros(9, 20)
    first = h2o.select(request(2, logits=flat))
    assert first.tolist() == [5, 11]
    logits = torch.zeros(9, 20)
    logits[:, 7] = 20.0  # token 7 becomes important, but H2O dropped it already
    assert 7 not in h2o.select(request(2, logits=logits)).tolist()
    assert 7 in TopKLogits().select(request(2, logits=logits)).tolist()


def test_keyformer_is_reproducible_and_differs_from_h2o_noise_free():
    logits = torch.randn(9, 20, generator=torch.Generator().manual_seed(0))
    a = Keyformer(seed=3).select(request(6, logits=logits))
    b = Keyformer(seed=3).select(request(6, logits=logits))
    assert a.tolist() == b.tolist() and len(a) == 6


def test_infinigen_with_all_channels_equals_topk():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(9, 64, generator=g)
    keys = torch.randn(3, 20, 64, generator=g)
    sel = InfiniGenSpeculation(channel_fraction=1.0)
    sel.prepare(0, torch.randn(9, 5, 64, generator=g), torch.randn(3, 5, 64, generator=g))
    logits = attention_logits(q[None], keys[None])[0]
    spec = sel.select(request(5, query=q, keys=lambda: keys))
    assert spec.tolist() == TopKLogits().select(request(5, logits=logits)).tolist()


def test_infinigen_partial_channels_use_fewer_channels():
    sel = InfiniGenSpeculation(channel_fraction=0.25)
    sel.prepare(3, torch.randn(9, 5, 64), torch.randn(3, 5, 64))
    assert sel.channels[(0, 3)].shape == (3, 16)
