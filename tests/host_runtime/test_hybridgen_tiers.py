"""Tiered KV storage on a real emulated CXL device: semantic-aware vs interleaved mapping, eviction."""

import numpy as np
import pytest
import torch

from emulator import Device
from host_runtime.hybridgen.tiers import EvictionEngine, HostKV, ResidentKV, coalesce

L, HKV, D = 2, 3, 8


@pytest.fixture
def cxl(media_dir):
    with Device.open(profile="small", media_dir=media_dir, policy="hymcache") as dev:
        yield dev


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g)


def test_coalesce_runs():
    assert coalesce(np.array([1, 2, 3, 7, 9, 10])) == [(1, 3), (7, 1), (9, 2)]
    assert coalesce(np.array([], dtype=np.int64)) == []


def test_semantic_mapping_keeps_k_in_dram_and_spills_v_to_cxl(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, mapping="semantic", v_dram_tokens=10)
    k, v = rows(30, 0)
    host.append(1, k[:, :12], v[:, :12])
    host.append(1, k[:, 12:], v[:, 12:])  # appended in two batches, like eviction does
    assert host.counters.bytes["cxl_write"] == 20 * host.row_bytes  # V rows 10..29
    host.counters.reset()
    assert torch.equal(host.keys(1), k)
    assert host.counters.bytes["cxl_read"] == 0  # the CPU's K scan never touches the CXL tier
    idx = torch.tensor([0, 3, 9, 10, 11, 25])
    assert torch.equal(host.values(1, idx), v[:, idx])
    assert host.counters.bytes["cxl_read"] == 3 * host.row_bytes


def test_interleaved_mapping_puts_half_the_k_pages_in_cxl(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, mapping="interleaved", page_tokens=4)
    k, v = rows(16, 1)
    host.append(0, k, v)
    host.counters.reset()
    assert torch.equal(host.keys(0), k)
    assert host.counters.bytes["cxl_read"] == 8 * host.row_bytes
    assert torch.equal(host.values(0, torch.arange(16)), v)


def test_full_write_buffer_is_flushed_and_retried(media_dir):
    # a 1 MiB device DRAM: 4 frames of write buffer fill after 256 KiB of new pages
    with Device.open(profile="small", media_dir=media_dir, policy="hymcache",
                     overrides={"dram.size_bytes": 1 << 20, "policy.prefetch_window_bytes": 1 << 19,
                                "policy.flush_batch_bytes": 1 << 17}) as dev:
        host = HostKV(1, 64, 64, capacity=512, cxl=dev, mapping="semantic", v_dram_tokens=0)  # 16 KiB rows
        written = []
        for i in range(8):
            k, v = torch.randn(64, 64, 64), torch.randn(64, 64, 64)
            host.append(0, k, v)
            written.append(v)
        assert host.counters.refused_writes > 0
        v_all = torch.cat(written, 1)
        idx = torch.tensor([0, 100, 300, 511])
        assert torch.equal(host.values(0, idx), v_all[:, idx])


def test_bad_arguments_are_named(cxl):
    with pytest.raises(ValueError, match="mapping 'striped'"):
        HostKV(L, HKV, D, 8, cxl, mapping="striped")
    with pytest.raises(ValueError, match="CXL tier is needed"):
        HostKV(L, HKV, D, 8, None, v_dram_tokens=4)
    with pytest.raises(ValueError, match="resident budget -1"):
        EvictionEngine(-1)


def test_eviction_moves_the_oldest_tokens_first(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, v_dram_tokens=4)
    resident = [ResidentKV(HKV, D, "cpu") for _ in range(L)]
    k, v = rows(10, 2)
    for r in resident:
        r.append(k, v, torch.arange(10))
    ev = EvictionEngine(budget=6)
    assert ev.enforce(resident, host, incoming=1) == 5
    assert resident[0].pos.tolist() == [5, 6, 7, 8, 9]
    assert host.count == [5, 5]
    assert torch.equal(host.keys(0), k[:, :5])
    assert torch.equal(host.values(1, torch.arange(5)), v[:, :5])
    assert ev.enforce(resident, host, incoming=1) == 0
