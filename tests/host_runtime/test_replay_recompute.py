"""The cost of what the device did not serve: recomputed blocks, their prefill time, serve time (issue 12)."""

from __future__ import annotations

import pytest

from host_runtime.replay import HymcacheMicrobench, Replay, get_model, replay_config
from host_runtime.replay.prefill import PrefillModel, load_gpu, prefill_for_block

MiB, GiB = 1 << 20, 1 << 30
BLOCK = 16 * MiB  # Llama-3.1-8B, 128 tokens

# small profile: a 64 MiB write buffer (4 blocks) whose flush never lands within the run (one batch the size of
# the buffer, SSDs writing 1 MB/s), so a request writing 8 blocks has exactly 4 accepted and 4 refused
NO_FLUSH = {"policy.flush_batch_bytes": 64 * MiB, "ssd.write_bandwidth_gbps": 0.001}


def run(variant, workload, overrides=None, **kw):
    return Replay(replay_config("small", variant, overrides), variant, workload, progress=False,
                  window_bytes=32 * MiB, **kw).run()


def test_blocks_whose_writes_were_refused_are_recomputed_next_turn():
    # one request, 8 new blocks per turn: turn 1 stores keys 0-3, refuses 4-7
    r = run("hymcache", HymcacheMicrobench(BLOCK, concurrency=1, blocks_per_turn=8, turns=3), NO_FLUSH)
    t1, t2, t3 = r["rows"]
    assert (t1["blocks_written"], t1["refused_writes"], t1["recomputed_blocks"]) == (4, 4, 0)
    # turn 2: context 0-15; 0-7 were in turn 1's context; 0-3 read; 4-7 recomputed; 8-15 are new, not counted
    assert (t2["blocks_read"], t2["recomputed_blocks"]) == (4, 4)
    # turn 3: context 0-23; 0-15 known; 0-3 read; 4-15 recomputed (the buffer, full, refused all of turn 2's offers)
    assert (t3["blocks_read"], t3["recomputed_blocks"]) == (4, 12)
    assert r["total"]["recomputed_blocks"] == 16
    prefill = prefill_for_block(BLOCK)
    assert prefill.model.name == "llama-3.1-8b" and prefill.tokens_per_block == 128
    # each block at its own position in the context: positions 4..7, then 4..15
    assert t2["recompute_s"] == pytest.approx(prefill.seconds(sum(prefill.block_flops(p) for p in range(4, 8))))
    assert t3["recompute_s"] == pytest.approx(prefill.seconds(sum(prefill.block_flops(p) for p in range(4, 16))))
    for row in (t2, t3):
        assert row["read_s"] > 0 and row["serve_s"] == pytest.approx(row["read_s"] + row["recompute_s"])
    assert r["total"]["serve_s"] == pytest.approx(sum(row["serve_s"] for row in r["rows"]))
    assert r["recompute"]["model"] == "llama-3.1-8b" and r["recompute"]["mfu"] == 0.52


def test_lru_with_everything_stored_recomputes_nothing():
    r = run("lru", HymcacheMicrobench(BLOCK, concurrency=2, blocks_per_turn=4, turns=4))
    assert r["total"]["refused_writes"] == 0 and r["host_index_evictions"] == 0
    assert [row["recomputed_blocks"] for row in r["rows"]] == [0, 0, 0, 0]
    assert [row["blocks_read"] for row in r["rows"]] == [0, 8, 16, 24]  # every earlier block, read
    assert all(row["recompute_s"] == 0 and row["serve_s"] == row["read_s"] for row in r["rows"] + [r["total"]])


def test_blocks_the_host_index_forgot_are_recomputed_even_if_stored_after_the_gap():
    # 2 SSDs x 64 MiB = 8 blocks of 16 MiB: turn 1's keys 0-7 fill the device, past the Master's 90 % high
    # watermark, so before turn 2 looks up it evicts the least recent (0 and 1) down to 85 %
    r = run("lru", HymcacheMicrobench(BLOCK, concurrency=1, blocks_per_turn=8, turns=3), {"ssd.capacity_bytes": 64 * MiB})
    t1, t2, t3 = r["rows"]
    # turn 2: key 0 is gone, so nothing is read; 0-7 recomputed; its 10 new blocks (0, 1, 8-15) exceed the device
    # (ENOSPC): none is stored
    assert (t2["blocks_read"], t2["recomputed_blocks"], t2["blocks_written"]) == (0, 8, 0)
    # turn 3: key 0 is still gone, so nothing is read; 2-7 are still stored, but after the gap: recomputed too
    assert (t3["blocks_read"], t3["recomputed_blocks"]) == (0, 16)
    assert r["host_index_evictions"] == 2 and r["master"]["no_space_puts"] == 2


def test_prefill_time_of_a_known_block():
    llama = get_model("llama-3.1-8b")
    # weights a token multiplies: 32 x (Q, O 2 x 4096^2 + K, V 2 x 4096 x 1024 + MLP 3 x 4096 x 14336);
    # with the 2 x 128256 x 4096 embedding / LM-head weights and the 2 x 32 + 1 RMSNorm vectors of 4096 that is
    # the published 8,030,261,248
    assert llama.matmul_params == 6_979_321_856
    assert llama.matmul_params + 2 * 128256 * 4096 + 65 * 4096 == 8_030_261_248
    gpu = load_gpu("a100-80gb")
    assert (gpu.peak_flops, gpu.mfu, gpu.count) == (312e12, 0.52, 1)
    p = PrefillModel(llama, 128, gpu)
    # block 0 (tokens 0-127): 2 N T + 4 L d T (T + 1) / 2, d = 32 heads x 128
    first = 2 * 6_979_321_856 * 128 + 4 * 32 * 4096 * 128 * 129 // 2
    assert first == 1_791_034_916_864
    assert p.block_flops(0) == first
    # block 3: its 128 tokens attend to 384 earlier positions more each; per token, summed
    assert p.block_flops(3) == sum(2 * llama.matmul_params + 4 * 32 * 4096 * (t + 1) for t in range(384, 512))
    assert p.seconds(first) == pytest.approx(first / (312e12 * 0.52))  # ~11.0 ms on one A100
    assert p.flops(2, 0 + 3) == p.block_flops(0) + p.block_flops(3)


def test_block_size_names_the_model_that_recomputes_it():
    assert prefill_for_block(64 * MiB).model.name == "llama-2-7b"
    assert prefill_for_block(168 * MiB).model.name == "opt-30b"
    assert prefill_for_block(64 * MiB, "llama-3.1-8b").tokens_per_block == 512
    fallback = prefill_for_block(2 * MiB)  # no model's 128-token block: Llama-3.1-8B's 16 tokens
    assert (fallback.model.name, fallback.tokens_per_block) == ("llama-3.1-8b", 16)


def test_a_bad_gpu_profile_names_the_field(tmp_path):
    bad = tmp_path / "g.toml"
    bad.write_text('name = "x"\npeak_flops = 1e12\nmfu = 1.5\ncount = 1\n')
    with pytest.raises(ValueError, match=r"mfu = 1.5 must be in \(0, 1\]"):
        load_gpu(str(bad))
    with pytest.raises(ValueError, match="neither a TOML file nor one of a100-80gb"):
        load_gpu("h900")


def test_populated_blocks_count_as_known():
    # 16 objects populated on a device of 8 slots: the host index keeps the last 8, so a client's chain of random
    # objects stops at its first forgotten one, and every populated block it does not read is recomputed
    from host_runtime.replay import RandomReadBench

    w = RandomReadBench(BLOCK, 16 * BLOCK, concurrency=1, reads_per_client=12, seed=0)
    (phase,) = w.phases()
    assert list(phase.streams[0].requests[0].keys[:3]) == [12, 13, 1]  # 1 was forgotten: the chain stops there
    r = run("lru", w, {"ssd.capacity_bytes": 64 * MiB})
    assert (r["total"]["blocks_read"], r["total"]["recomputed_blocks"]) == (2, 10)
