"""Logit parallelism: hybrid attention equals monolithic attention when every token is used."""

import pytest
import torch

from host_runtime.hybridgen.attention import (attention_logits, concatenate_in_order, cpu_logits_rows, hybrid_attention, map_tokens,
                                              monolithic_attention)

B, HQ, HKV, D, T = 3, 9, 3, 64, 37  # batch > 1 and SmolLM2's GQA (9 query heads over 3 KV heads)


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(B, HQ, D, generator=g), torch.randn(B, HKV, T, D, generator=g),
            torch.randn(B, HKV, T, D, generator=g))


def split_run(q, k, v, resident_pos, offloaded_pos):
    """CPU logits for offloaded tokens, accelerator for resident ones, then the concatenator."""
    cpu_logits = attention_logits(q, k[:, :, offloaded_pos])
    return hybrid_attention(q, k[:, :, resident_pos], v[:, :, resident_pos], resident_pos,
                            cpu_logits, v[:, :, offloaded_pos], offloaded_pos)


@pytest.mark.parametrize("split", range(T + 1))
def test_every_split_point_matches_monolithic(qkv, split):
    q, k, v = qkv
    tm = map_tokens(T, T - split)
    assert tm.offloaded.tolist() == list(range(split))
    out = split_run(q, k, v, tm.resident, tm.offloaded)
    assert (out - monolithic_attention(q, k, v)).abs().max().item() <= 1e-5


def test_scattered_mapping_matches_monolithic(qkv):
    q, k, v = qkv
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(3))
    resident, offloaded = perm[:15].sort().values, perm[15:].sort().values
    out = split_run(q, k, v, resident, offloaded)
    assert (out - monolithic_attention(q, k, v)).abs().max().item() <= 1e-5


def test_gqa_logits_match_repeated_heads(qkv):
    q, k, _ = qkv
    ref = torch.einsum("bhd,bhtd->bht", q, k.repeat_interleave(HQ // HKV, dim=1)) / D ** 0.5
    assert torch.allclose(attention_logits(q, k), ref, atol=1e-5)


def test_concatenator_restores_token_order():
    res_pos, off_pos = torch.tensor([1, 4, 5]), torch.tensor([0, 2, 3])
    res = res_pos.float().view(1, 1, 3).expand(2, 2, 3)
    off = off_pos.float().view(1, 1, 3).expand(2, 2, 3)
    pos, merged = concatenate_in_order(res_pos, res, off_pos, off)
    assert pos.tolist() == [0, 1, 2, 3, 4, 5]
    assert merged[1, 1].tolist() == [0, 1, 2, 3, 4, 5]


def test_mislabelled_positions_break_equivalence(qkv):
    """The check above can fail: pairing logits with the wrong V rows changes the output."""
    q, k, v = qkv
    tm = map_tokens(T, 10)
    cpu_logits = attention_logits(q, k[:, :, tm.offloaded])
    wrong = hybrid_attention(q, k[:, :, tm.resident], v[:, :, tm.resident], tm.resident,
                             cpu_logits.flip(-1), v[:, :, tm.offloaded], tm.offloaded)
    assert (wrong - monolithic_attention(q, k, v)).abs().max().item() > 1e-3


def test_token_mapper_rejects_negative_budget():
    with pytest.raises(ValueError, match="n_resident"):
        map_tokens(10, -1)


def test_cpu_kernel_on_token_major_rows_matches_attention_logits(qkv):
    q, k, _ = qkv
    rows = k[1].transpose(0, 1).reshape(T, HKV * D)  # host DRAM layout: one row per token
    assert (cpu_logits_rows(q[1], rows) - attention_logits(q[1:2], k[1:2])[0]).abs().max().item() <= 1e-5


def test_compiled_kernel_and_torch_fallback_agree(qkv):
    """float64 input takes the torch (block-diagonal GEMM) path; float32 the compiled kernel when built."""
    q, k, _ = qkv
    rows = k[0].transpose(0, 1).reshape(T, HKV * D)
    fast = cpu_logits_rows(q[0], rows)
    slow = cpu_logits_rows(q[0].double(), rows.double())
    assert fast.shape == (HQ, T) and (fast.double() - slow).abs().max().item() <= 1e-5


def test_kernel_handles_head_dims_off_the_vector_width():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(4, 24, generator=g), torch.randn(1, 2, 11, 24, generator=g)
    rows = k[0].transpose(0, 1).reshape(11, 48)
    assert (cpu_logits_rows(q, rows) - attention_logits(q[None], k)[0]).abs().max().item() <= 1e-5
