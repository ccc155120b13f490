"""Tiered KV storage on a real emulated CXL device: the paper's mapping under a host-DRAM budget (V beyond it
to CXL, then K, oldest first), interleaving, prefetch, eviction, and the batch axis."""

import errno

import numpy as np
import pytest
import torch

from emulator import Device
from host_runtime.hybridgen.tiers import EvictionEngine, HostKV, ResidentKV, coalesce, pad_stack

L, HKV, D = 2, 3, 8
ROW = HKV * D * 4  # bytes of one K (or V) row


@pytest.fixture
def cxl(media_dir):
    with Device.open(profile="small", media_dir=media_dir, policy="hymcache") as dev:
        yield dev


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g)


def fill(host, seq, k, v, chunks=(12,)):
    """Append like eviction does: every layer, then the budget."""
    start = 0
    for n in (*chunks, k.shape[1] - sum(chunks)):
        for layer in range(host.n_layers):
            host.append(layer, seq, k[:, start:start + n], v[:, start:start + n])
        host.enforce_dram_budget()
        start += n


def test_coalesce_runs():
    assert coalesce(np.array([1, 2, 3, 7, 9, 10])) == [(1, 3), (7, 1), (9, 2)]
    assert coalesce(np.array([], dtype=np.int64)) == []


def test_everything_stays_in_dram_while_it_fits(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, dram_bytes=2 * L * 30 * ROW)
    k, v = rows(30, 0)
    fill(host, 0, k, v)
    assert host.counters.bytes["cxl_write"] == 0 and host.cxl_watermark["v"][0] == 0


def test_v_beyond_the_dram_budget_moves_to_cxl_oldest_first_and_k_stays(cxl):
    # room for 40 rows per layer: 30 K rows + 10 V rows; the 20 oldest V rows go to CXL
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, dram_bytes=L * 40 * ROW)
    k, v = rows(30, 0)
    fill(host, 0, k, v)
    assert host.cxl_watermark["v"][0] == 20 and host.cxl_watermark["k"][0] == 0
    assert host.counters.bytes["cxl_write"] == L * 20 * ROW
    assert host.dram_rows() * ROW <= host.dram_bytes
    host.counters.reset()
    assert torch.equal(host.keys(1), k)
    assert host.counters.bytes["cxl_read"] == 0  # the CPU's K scan never touches the CXL tier
    idx = torch.tensor([0, 3, 19, 20, 21, 29])
    assert torch.equal(host.values(1, idx), v[:, idx])
    assert host.counters.bytes["cxl_read"] == 3 * ROW and host.counters.cxl_reads == 3  # runs [0], [3], [19]


def test_past_dram_k_spills_too_oldest_first_and_nothing_raises(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, dram_bytes=L * 20 * ROW)  # less than the K alone
    k, v = rows(30, 1)
    fill(host, 0, k, v)
    assert host.cxl_watermark["v"][0] == 30 and host.cxl_watermark["k"][0] == 10
    assert host.counters.k_spilled_rows > 0
    host.counters.reset()
    assert torch.equal(host.keys(0), k)  # the scan reads its 10 oldest rows from the CXL tier
    assert host.counters.bytes["cxl_read"] == 10 * ROW
    assert host.placement().k_cxl == pytest.approx(10 / 30) and host.placement().v_cxl == 1


def test_interleaved_mapping_puts_half_the_k_pages_in_cxl(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, mapping="interleaved", page_tokens=4)
    k, v = rows(16, 1)
    for layer in range(L):
        host.append(layer, 0, k, v)
    host.counters.reset()
    assert torch.equal(host.keys(0), k)
    assert host.counters.bytes["cxl_read"] == 8 * ROW
    assert torch.equal(host.values(0, torch.arange(16)), v)


def test_prefetched_values_are_waited_for_and_released(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, dram_bytes=0)
    k, v = rows(30, 2)
    fill(host, 0, k, v)
    host.prefetch_values(1)
    assert host.counters.prefetches == 1
    assert torch.equal(host.values(1, torch.tensor([2, 5, 29])), v[:, [2, 5, 29]])
    host.release_values(1)
    assert cxl.stats()["releases"] == 1 and not host._prefetched
    host.prefetch_values(0)   # staged, never read: released all the same
    host.release_values(0)
    assert cxl.stats()["releases"] == 2


def test_a_busy_device_is_read_on_demand(cxl, monkeypatch):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, dram_bytes=0)
    k, v = rows(30, 3)
    fill(host, 0, k, v)

    def busy(addr, size):
        raise OSError(errno.EBUSY, "prefetch window full")
    monkeypatch.setattr(cxl, "prefetch", busy)
    host.prefetch_values(1)
    assert host.counters.prefetch_busy == 1 and host.counters.prefetches == 0
    assert torch.equal(host.values(1, torch.tensor([4, 7])), v[:, [4, 7]])
    host.release_values(1)  # nothing staged: nothing to release


def test_full_write_buffer_is_flushed_and_retried(media_dir):
    # a 1 MiB device DRAM: 4 frames of write buffer fill after 256 KiB of new pages
    with Device.open(profile="small", media_dir=media_dir, policy="hymcache",
                     overrides={"dram.size_bytes": 1 << 20, "policy.prefetch_window_bytes": 1 << 19,
                                "policy.flush_batch_bytes": 1 << 17}) as dev:
        host = HostKV(1, 64, 64, capacity=512, cxl=dev, dram_bytes=0)  # 16 KiB rows, all to the CXL tier
        written = []
        for i in range(8):
            k, v = torch.randn(64, 64, 64), torch.randn(64, 64, 64)
            host.append(0, 0, k, v)
            host.enforce_dram_budget()
            written.append(v)
        assert host.counters.refused_writes > 0
        v_all = torch.cat(written, 1)
        idx = torch.tensor([0, 100, 300, 511])
        assert torch.equal(host.values(0, idx), v_all[:, idx])


def test_sequences_of_a_batch_have_their_own_rows(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, dram_bytes=L * 30 * ROW, batch=3)
    data = [rows(n, 10 + n) for n in (5, 20, 12)]
    for b, (k, v) in enumerate(data):
        fill(host, b, k, v, chunks=())
    assert host.count[0].tolist() == [5, 20, 12]
    for b, (k, v) in enumerate(data):
        assert torch.equal(host.keys(1, b), k)
        assert torch.equal(host.values(1, torch.arange(k.shape[1]), b), v)
    assert host.cxl_watermark["v"][1] > 0  # the longest sequence gave up its oldest V rows first


def test_bad_arguments_are_named(cxl):
    with pytest.raises(ValueError, match="mapping='striped'"):
        HostKV(L, HKV, D, 8, cxl, mapping="striped")
    with pytest.raises(ValueError, match="CXL tier is needed"):
        HostKV(L, HKV, D, 8, None, dram_bytes=4)
    with pytest.raises(ValueError, match="dram_bytes=-1"):
        HostKV(L, HKV, D, 8, cxl, dram_bytes=-1)
    with pytest.raises(ValueError, match="resident budget=-1"):
        EvictionEngine(-1)


def test_eviction_moves_the_oldest_tokens_first(cxl):
    host = HostKV(L, HKV, D, capacity=64, cxl=cxl, dram_bytes=L * 6 * ROW)
    resident = [ResidentKV(1, HKV, D, 16, "cpu") for _ in range(L)]
    k, v = rows(10, 2)
    for r in resident:
        r.append(0, k, v, torch.arange(10))
    ev = EvictionEngine(budget=6)
    assert ev.enforce(resident, host, incoming=1) == [5]
    assert resident[0].rows(0)[2].tolist() == [5, 6, 7, 8, 9]
    assert host.count[:, 0].tolist() == [5, 5]
    assert torch.equal(host.keys(0), k[:, :5])
    assert torch.equal(host.values(1, torch.arange(5)), v[:, :5])
    assert host.cxl_watermark["v"][0] == 4  # 6 rows of DRAM per layer: 5 K + 1 V
    assert ev.enforce(resident, host, incoming=1) == [0]


def test_resident_rows_pad_to_the_longest_sequence():
    r = ResidentKV(2, HKV, D, 8, "cpu")
    k, v = rows(5, 4)
    r.append(0, k[:, :2], v[:, :2], torch.arange(2))
    r.append(1, k, v, torch.arange(5))
    rk, _, pos, mask = r.view()
    assert rk.shape == (2, HKV, 5, D) and mask.tolist() == [[True, True, False, False, False], [True] * 5]
    assert torch.equal(rk[1], k) and pos[1].tolist() == [0, 1, 2, 3, 4]
    stacked, m = pad_stack([torch.ones(3, 2), torch.ones(3, 4)], axis=1)
    assert stacked.shape == (2, 3, 4) and m.tolist() == [[True, True, False, False], [True] * 4]
    assert stacked[0, :, 2:].abs().sum() == 0
