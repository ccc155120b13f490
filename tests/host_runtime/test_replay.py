"""Trace replay: readers, golden counts, the LRU reference, and the paper mechanisms at small scale."""

from __future__ import annotations

import json
import subprocess
from itertools import islice
from pathlib import Path

import pytest

from emulator.cli import main as chm_main
from host_runtime.replay import (ConversationGenerator, HymcacheMicrobench, MooncakeTrace, RandomReadBench,
                                 Replay, get_model, master_key, replay_config, window_blocks)
from host_runtime.replay.models import parse_bytes
from host_runtime.replay.reference import ordered_dict_lru
from emulator.shared_data import mooncake_conversation_trace

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "replay_golden.jsonl"
CHM = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "chm"
MOONCAKE_REQUESTS = 1000  # the tests read the first requests of the shared trace, a cut made at run time

# The golden setting: small profile shrunk to 4 MiB of DRAM (64 frames of 64 KiB = 16 blocks of 256 KiB),
# so the 47 blocks of the golden trace are evicted and refused along the way.
GOLDEN_OVERRIDES = {"dram.size_bytes": 4 * MiB, "policy.prefetch_window_bytes": 1 * MiB,
                    "policy.flush_batch_bytes": 512 * KiB}


def golden_trace(**kw):
    return MooncakeTrace(GOLDEN, block_bytes=256 * KiB, tokens_per_block=512, time_scale=0.01, **kw)


def replay(workload, variant, profile="small", overrides=None, **kw):
    rp = Replay(replay_config(profile, variant, overrides), variant, workload, progress=False, **kw)
    return rp, rp.run()


# ---- models ----------------------------------------------------------------------------------
def test_block_sizes_follow_the_model_shapes():
    llama = get_model("Llama-3.1-8B")
    assert llama.bytes_per_token == 128 * KiB
    assert llama.block_bytes(128) == 16 * MiB
    assert get_model("qwen2.5-32b").block_bytes() == 32 * MiB
    assert get_model("llama-2-7b").block_bytes() == 64 * MiB  # the paper's 64 MB blocks
    assert get_model("opt-30b").block_bytes() == 168 * MiB  # the paper's 168 MB blocks
    with pytest.raises(ValueError, match="not in the model table"):
        get_model("gpt-9")


def test_window_is_about_128_mb_and_never_below_two_blocks():
    assert [window_blocks(128 * MiB, b * MiB) for b in (16, 32, 64, 168)] == [8, 4, 2, 2]


def test_byte_sizes_parse_and_name_the_parameter():
    assert parse_bytes("64MiB") == 64 * MiB and parse_bytes("1.5GiB") == 3 * GiB // 2
    with pytest.raises(ValueError, match="--block-bytes"):
        parse_bytes("64MB", "--block-bytes")
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes("0KiB")


# ---- readers and generators ------------------------------------------------------------------
def test_mooncake_reader_expands_hash_ids_into_model_blocks():
    path = mooncake_conversation_trace()
    trace = MooncakeTrace(path, block_bytes=16 * MiB, tokens_per_block=128, limit=MOONCAKE_REQUESTS)
    assert trace.describe()["requests"] == MOONCAKE_REQUESTS
    with path.open() as f:
        head = [json.loads(line) for line in islice(f, MOONCAKE_REQUESTS)]
    refs = sum(len(rec["hash_ids"]) for rec in head)
    assert trace.describe()["block_references"] == refs
    (phase,) = trace.phases()
    first = phase.streams[0].requests[0].keys
    assert first[:8] == [0, 1, 2, 3, 4, 5, 6, 7]  # hash 0 -> blocks 0..3, hash 1 -> 4..7
    assert sum(len(s.requests[0].keys) for s in phase.streams) == 4 * refs
    assert phase.streams[-1].start_ns == head[-1]["timestamp"] * 1e6


def test_mooncake_reader_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        MooncakeTrace(bad, MiB)
    with pytest.raises(ValueError, match="does not exist"):
        MooncakeTrace(tmp_path / "none.jsonl", MiB)
    with pytest.raises(ValueError, match="tokens_per_block = 100"):
        MooncakeTrace(GOLDEN, MiB, tokens_per_block=100)


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_mooncake_reader_rejects_a_trace_without_requests(tmp_path, text):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    with pytest.raises(ValueError, match=f"{empty}: no requests"):
        MooncakeTrace(empty, MiB)


@pytest.mark.parametrize("line, problem", [
    ('{"timestamp": 1, "hash_', "JSONDecodeError"),                      # truncated line
    ('{"timestamp": 1, "hash_ids": "123"}', "hash_ids = '123'"),         # not a list
    ('{"timestamp": 1, "hash_ids": [1, -2]}', "hash_ids = [1, -2]"),     # negative id
    ('{"timestamp": 1, "hash_ids": [1.5]}', "hash_ids = [1.5]"),         # not an integer
    # no coercion: [1.7, true, "3"] must not become [1, 1, 3]
    ('{"timestamp": 1, "hash_ids": [1.7, true, "3"]}', "element 0 is 1.7 (float)"),
    ('{"timestamp": 1, "hash_ids": [2, true]}', "element 1 is True (bool)"),  # a bool is not an integer
    ('{"timestamp": 1, "hash_ids": [2, 3, "3"]}', "element 2 is '3' (str)"),
    ('{"timestamp": 1, "hash_ids": [2.0]}', "element 0 is 2.0 (float)"),
    ('{"timestamp": -1, "hash_ids": [1]}', "timestamp = -1"),
    ('{"timestamp": NaN, "hash_ids": [1]}', "timestamp = nan must be a finite number"),
    ('{"timestamp": Infinity, "hash_ids": [1]}', "timestamp = inf must be a finite number"),
    ('{"timestamp": 1e400, "hash_ids": [1]}', "timestamp = inf must be a finite number"),  # overflows to inf
    ('{"timestamp": true, "hash_ids": [1]}', "timestamp = True"),
    ('{"timestamp": "soon", "hash_ids": [1]}', "timestamp = 'soon'"),
    ('{"time": 1, "hash_ids": [1]}', "KeyError: 'timestamp'"),           # wrong field name
    ('[1, 2]', "TypeError"),
    ('\udcff', "not a Mooncake record"),                                 # not UTF-8
])
def test_mooncake_reader_names_file_and_line_of_a_bad_record(tmp_path, line, problem):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"timestamp": 0, "hash_ids": [1]}\n\n' + line.encode("utf-8", "surrogateescape") + b"\n")
    with pytest.raises(ValueError, match=f"{bad}:3: ") as info:
        MooncakeTrace(bad, MiB)
    assert problem in str(info.value)


def test_microbench_turns_grow_the_prefix():
    phases = list(HymcacheMicrobench(MiB, concurrency=3, blocks_per_turn=2, turns=3).phases())
    assert [p.label for p in phases] == ["turn 1", "turn 2", "turn 3"]
    assert [list(s.requests[0].keys) for s in phases[2].streams][1] == [6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="concurrency = 0"):
        HymcacheMicrobench(MiB, concurrency=0)


def test_conversations_are_growing_prefixes_and_seeded():
    gen = ConversationGenerator(MiB, sessions=30, mean_turns=3, mean_prompt_tokens=300, system_prompt_tokens=256)
    (phase,) = gen.phases()
    (again,) = ConversationGenerator(MiB, sessions=30, mean_turns=3, mean_prompt_tokens=300,
                                     system_prompt_tokens=256).phases()
    assert [r.keys for s in phase.streams for r in s.requests] == [r.keys for s in again.streams for r in s.requests]
    multi = [s for s in phase.streams if len(s.requests) > 1]
    assert multi, "mean_turns=3 must give some multi-turn sessions"
    for s in multi:
        for a, b in zip(s.requests, s.requests[1:]):
            assert list(b.keys[:len(a.keys)]) == list(a.keys) and b.think_ns > 0
    assert all(list(s.requests[0].keys[:2]) == [0, 1] for s in phase.streams)  # the shared system prompt


# ---- the host side: the runtime's Master ---------------------------------------------------------
class _Phases:
    """A workload of phases, each one stream of requests (key lists) starting ``start_s`` into its phase."""

    name, bucket_by = "phases", "phase"

    def __init__(self, block_bytes, *phases):
        self.block_bytes, self.spec = block_bytes, phases

    def phases(self):
        from host_runtime.replay.traces import Phase, Request, Stream
        for label, start_s, requests in self.spec:
            yield Phase(label, [Stream(start_s * 1e9, [Request(list(keys)) for keys in requests])])

    def populate_keys(self):
        return ()

    def describe(self):
        return {}


def _stored(rp, keys):
    """The keys the Master holds (a lookup each, after the run), and their addresses."""
    return {key: locs[0].offset for key in keys if (locs := rp.master.lookup([master_key(key)]))}


@pytest.mark.parametrize("gap_s, stored, evicted", [(0.0, {0, 3, 4, 5, 6, 7}, [1, 2]),
                                                    (60.0, {2, 3, 4, 5, 6, 7}, [0, 1])])
def test_stored_set_and_evictions_follow_the_masters_rules(gap_s, stored, evicted):
    """A device of 8 blocks (2 SSDs x 1 MiB, 256 KiB blocks). Block 0 is written, then read (a read lease of
    the Master's lease_s = 10 s, on the replay's virtual clock); 1-6 are written after it (more recent, not
    leased); writing 7 fills the device (8/8 > the 90 % high watermark), so the Master evicts least recently
    used complete blocks down to 85 % (6.8 blocks): two. Right away, 0 is leased and skipped: 1 and 2 go;
    60 s later (virtual) its lease has ended: 0 and 1 go. (The old host index, LRU at 100 %, evicted none.)"""
    w = _Phases(256 * KiB, ("write 0", 0, [[0]]), ("read 0", 0, [[0]]), ("write 1-6", 0, [range(1, 7)]),
                ("write 7", gap_s, [[7]]))
    rp, result = replay(w, "lru", overrides={**GOLDEN_OVERRIDES, "ssd.capacity_bytes": 1 * MiB}, record_ops=True)
    addr_of = _stored(rp, range(8))
    assert set(addr_of) == stored
    assert result["host_index_evictions"] == result["master"]["evictions"] == len(evicted) == 2
    assert result["master"]["settings"]["lease_s"] == 10.0 and result["master"]["settings"]["high_watermark"] == 0.9
    # addresses are the Master's placement: append-only, block after block from 0; the read went to block 0's
    assert [(kind, addr) for kind, addr, _ in rp.ops[:2]] == [("write", 0), ("read", 0)]
    assert [addr for _, addr, _ in rp.ops[2:]] == [k * 256 * KiB for k in range(1, 8)]
    assert all(addr_of[k] == k * 256 * KiB for k in stored)


def test_a_block_is_visible_only_after_its_writers_put_end():
    """Two requests on the same chain at once: the second looks up while the first still writes (its
    put_start made the blocks PENDING, put_end comes after its last write), so it reads nothing, recomputes
    the known blocks, and writes none of them (put_start answers None for blocks in flight)."""
    from host_runtime.replay.traces import Phase, Request, Stream

    class TwoAtOnce(_Phases):
        def phases(self):
            yield Phase("first", [Stream(0.0, [Request([0])])])
            yield Phase("both", [Stream(0.0, [Request([0, 1, 2, 3])]), Stream(1e3, [Request([0, 1, 2, 3])])])
            yield Phase("after", [Stream(0.0, [Request([0, 1, 2, 3])])])

    rp, result = replay(TwoAtOnce(256 * KiB), "lru", record_ops=True)
    first, both, after = result["rows"]
    assert (both["blocks_read"], both["blocks_written"]) == (2, 3)  # each read block 0; 1-3 written once
    assert both["recomputed_blocks"] == 3  # the second knew 1-3 (the first's lookup) but could not read them
    assert (after["blocks_read"], after["blocks_written"], after["recomputed_blocks"]) == (4, 0, 0)
    assert result["master"]["registered_blocks"] == 4 and result["host_index_evictions"] == 0


# ---- golden counts ---------------------------------------------------------------------------
# Pinned from a run and cross-checked: lru against the OrderedDict reference below; the hymcache
# variants by their invariants (every read page is either staged or found; refusals are counted).
GOLDEN_COUNTS = {
    "lru": {"hit_pages": 88, "miss_pages": 52, "refused_writes": 0, "blocks_read": 35, "blocks_written": 47},
    "hymcache": {"hit_pages": 92, "miss_pages": 16, "refused_writes": 62, "blocks_read": 27, "blocks_written": 12},
    "hymcache-noprefetch": {"hit_pages": 92, "miss_pages": 16, "refused_writes": 75, "blocks_read": 27,
                            "blocks_written": 10},
}

@pytest.mark.parametrize("variant", list(GOLDEN_COUNTS))
def test_golden_trace_counts(variant):
    _, result = replay(golden_trace(), variant, overrides=GOLDEN_OVERRIDES, window_bytes=512 * KiB)
    got = {k: result["total"][k] for k in GOLDEN_COUNTS[variant]}
    assert got == GOLDEN_COUNTS[variant]
    # every block read is 4 pages, each counted once as a hit or a miss
    assert result["total"]["hit_pages"] + result["total"]["miss_pages"] == 4 * result["total"]["blocks_read"]


def test_lru_matches_ordered_dict_reference_but_for_one_pinned_victim_on_golden_trace():
    """The device's LRU skips a pinned frame where it stands (a dirty page whose flush is in flight) and evicts
    the next least recent one: the reference knows no pinning. In this overlapped run (the golden trace 100x
    compressed) that happens once: one written block's 4 pages take the place of 4 pinned ones, and one later
    read of them misses where the reference hits. (Before the Master, blocks were readable as soon as a
    request allocated them, and the run met no pinned victim; the mooncake test below still meets none.)"""
    rp, result = replay(golden_trace(), "lru", overrides=GOLDEN_OVERRIDES, record_ops=True)
    hits, misses, _, _ = ordered_dict_lru(rp.ops, rp.cfg.device.page_size_bytes, rp.cfg.dram_frames)
    total = result["total"]
    assert total["hit_pages"] + total["miss_pages"] == hits + misses  # the same read pages
    assert (hits, misses) == (92, 48) and (total["hit_pages"], total["miss_pages"]) == (hits - 4, misses + 4)
    assert misses > 0 and hits > 0 and result["device"]["evictions"] > 0


def test_lru_equals_ordered_dict_reference_on_mooncake_trace():
    """The first 400 requests of the Mooncake conversation trace
    (the whole trace is a benchmark: bench/repro_hymcache.py mooncake)."""
    trace = MooncakeTrace(mooncake_conversation_trace(), block_bytes=256 * KiB, tokens_per_block=512, limit=400)
    rp, result = replay(trace, "lru", overrides={"dram.size_bytes": 64 * MiB, "policy.prefetch_window_bytes": 8 * MiB},
                        record_ops=True)
    hits, misses, _, _ = ordered_dict_lru(rp.ops, rp.cfg.device.page_size_bytes, rp.cfg.dram_frames)
    assert (result["total"]["hit_pages"], result["total"]["miss_pages"]) == (hits, misses)
    assert hits > 1000 and result["device"]["evictions"] > 0 and result["device"]["merged_misses"] > 0


# ---- device policy and sequential replay --------------------------------------------------------
def test_device_policy_is_chosen_apart_from_the_request_behaviour():
    assert replay_config("small", "hymcache").policy.name == "hymcache"  # the variant's own
    assert replay_config("small", "hymcache", device_policy="lru").policy.name == "lru"
    assert replay_config("small", "lru", {"policy.name": "hymcache"}).policy.name == "hymcache"
    _, result = replay(golden_trace(), "lru", overrides={**GOLDEN_OVERRIDES, "policy.name": "hymcache"})
    assert (result["policy"], result["device_policy"], result["label"]) == ("lru", "hymcache", "lru on hymcache")
    assert result["total"]["refused_writes"] > 0  # hymcache's write buffer refuses, whatever the requests do


def test_sequential_replay_runs_requests_in_file_order_one_at_a_time():
    """Compressed 100x in time, the golden trace's requests overlap; sequential, they run in file order,
    one block at a time, with write-back drained: the LRU reference then holds for reads and writes."""
    trace = golden_trace()
    rp, result = replay(trace, "lru", overrides=GOLDEN_OVERRIDES, record_ops=True, sequential=True)
    keys = [key for _, ids in trace.records for key in trace.keys_of(ids)]
    assert result["host_index_evictions"] == 0  # so the Master still knows every block's address
    addr_of = _stored(rp, set(keys))
    assert [addr for _, addr, _ in rp.ops] == [addr_of[key] for key in keys]  # every block, in file order
    hits, misses, pages, write_misses = ordered_dict_lru(rp.ops, rp.cfg.device.page_size_bytes, rp.cfg.dram_frames)
    cache = result["cache"]
    assert (result["total"]["hit_pages"], result["total"]["miss_pages"]) == (hits, misses)
    assert (cache["accesses"], cache["write_misses"], cache["misses"]) == (pages, write_misses, misses + write_misses)
    assert result["device"]["merged_misses"] == 0 and not rp.ctl.dirty and not rp.ctl.flights
    _, overlapped = replay(trace, "lru", overrides=GOLDEN_OVERRIDES)
    assert overlapped["device"]["merged_misses"] > 0  # what sequential takes away


def test_a_write_to_a_page_still_in_dram_is_a_write_hit():
    """A device of 8 blocks (2 x 1 MiB of SSD) behind 16 blocks of DRAM: the Master hands out the extents of
    blocks it evicted again, some of whose pages are still cached, so those writes find their frame; the LRU
    reference counts the same."""
    overrides = {**GOLDEN_OVERRIDES, "ssd.capacity_bytes": 1 * MiB}
    rp, result = replay(golden_trace(), "lru", overrides=overrides, record_ops=True, sequential=True)
    _, _, pages, write_misses = ordered_dict_lru(rp.ops, rp.cfg.device.page_size_bytes, rp.cfg.dram_frames)
    total = result["total"]
    assert result["host_index_evictions"] > 0 and total["write_hit_pages"] > 0
    assert total["write_miss_pages"] == write_misses
    assert result["cache"]["accesses"] == pages


def test_sequential_hymcache_prefetches_one_block_at_a_time():
    rp, result = replay(golden_trace(), "hymcache", overrides=GOLDEN_OVERRIDES, window_bytes=512 * KiB, sequential=True)
    assert result["window_blocks"] == 1 and result["device"]["merged_misses"] == 0
    assert result["dram"]["peak_staged_bytes"] == golden_trace().block_bytes


# ---- the paper's mechanisms at small scale --------------------------------------------------
# cmmh (LRU, one NAND back end) shrunk to 512 MiB of DRAM; 4 requests x 4 blocks of 16 MiB per turn
# = 256 MiB per turn: the footprint fits through turn 2 (512 MiB), exceeds DRAM from turn 3's reads on.
def _fig5(block_mib=16, dram_mib=512, turns=6):
    bench = HymcacheMicrobench(block_mib * MiB, concurrency=4, blocks_per_turn=4, turns=turns)
    _, result = replay(bench, "lru", "cmmh", {"dram.size_bytes": dram_mib * MiB,
                                             "policy.prefetch_window_bytes": 64 * MiB})
    return result["rows"]


def _collapse_turn(rows):
    return next(i + 1 for i, row in enumerate(rows) if i and row["hit_rate"] < 0.5)


def test_lru_collapses_once_the_footprint_exceeds_dram():
    rows = _fig5()
    link = 25.0
    assert [round(r["hit_rate"], 2) for r in rows[1:3]] == [1.0, 1.0]
    assert all(r["read_gbps"] > 0.9 * link for r in rows[1:3])
    assert all(r["hit_rate"] < 0.1 for r in rows[3:])  # LRU refills: a scan longer than DRAM never hits
    assert all(r["read_gbps"] < 0.6 * link for r in rows[3:])  # SSD-backed, reads slowed by dirty write-back


def test_collapse_moves_with_dram_and_block_size_not_turn_number():
    base = _collapse_turn(_fig5())
    assert _collapse_turn(_fig5(dram_mib=1024)) > base  # twice the DRAM: later
    assert _collapse_turn(_fig5(block_mib=32)) < base  # twice the block: earlier


def test_hymcache_keeps_reads_near_link_rate_with_bounded_staging():
    bench = HymcacheMicrobench(16 * MiB, concurrency=32, blocks_per_turn=16, turns=4)
    _, result = replay(bench, "hymcache", "paper", {"dram.size_bytes": 8 * GiB, "policy.prefetch_window_bytes": 4 * GiB,
                                                   "policy.flush_batch_bytes": 64 * MiB}, window_bytes=64 * MiB)
    rows = result["rows"]
    assert all(r["read_gbps"] > 0.85 * result["link_gbps"] for r in rows[1:])
    dram = result["dram"]
    assert 0 < dram["peak_staged_bytes"] <= dram["window_bound_bytes"] == 32 * 4 * 16 * MiB
    assert dram["peak_write_buffer_bytes"] <= dram["write_buffer_bytes"]
    assert result["total"]["refused_writes"] == sum(r["refused_writes"] for r in rows) > 0


def test_prefetch_beats_demand_reads_on_random_objects():
    bench = RandomReadBench(16 * MiB, 4 * GiB, concurrency=1, reads_per_client=64)
    overrides = {"dram.size_bytes": 1 * GiB, "policy.prefetch_window_bytes": 512 * MiB}
    _, on = replay(bench, "hymcache", "paper", overrides)
    _, off = replay(bench, "hymcache-noprefetch", "paper", overrides)
    assert on["total"]["blocks_read"] == off["total"]["blocks_read"] == 64
    assert on["total"]["read_gbps"] > 1.1 * off["total"]["read_gbps"]


# ---- the device-side fixes replay depends on ---------------------------------------------------
def test_refused_write_moves_no_payload_over_the_link():
    rp = Replay(replay_config("small", "hymcache"), "hymcache", golden_trace(), window_bytes=512 * KiB, progress=False)
    ctl, page = rp.ctl, rp.cfg.device.page_size_bytes
    wb = rp.cfg.write_buffer_frames * page
    ctl.write(0, None, wb, 0.0)  # fills the write buffer
    before = ctl.timing.link_to_device.bytes
    with pytest.raises(Exception, match="no room"):
        ctl.write(wb, None, page, 1.0)
    assert ctl.timing.link_to_device.bytes == before


def test_hymcache_flusher_keeps_one_batch_in_flight():
    rp = Replay(replay_config("small", "hymcache"), "hymcache", golden_trace(), window_bytes=512 * KiB, progress=False)
    ctl, cfg = rp.ctl, rp.cfg
    batch = cfg.policy.flush_batch_bytes
    ctl.write(0, None, 3 * batch, 0.0)  # three batches' worth of dirty pages, no reads
    ctl.tick(1.0)
    ctl.tick(2.0)
    assert ctl.stats["flush_batches"] == 1  # the second waits until the first has landed
    ctl.tick(max(finish for finish, _, _ in ctl.flights))
    assert ctl.stats["flush_batches"] == 2


class _WriterThenReader:
    """Stream 1 writes 1.5 flush batches at t=0; stream 2 reads the first block back 50 ms later."""

    name, block_bytes, bucket_by = "writer-then-reader", 4 * MiB, "phase"

    def phases(self):
        from host_runtime.replay.traces import Phase, Request, Stream
        yield Phase("only", [Stream(0.0, [Request(range(3))]), Stream(50e6, [Request([0])])])

    def populate_keys(self):
        return ()

    def describe(self):
        return {}


def test_the_device_flushes_while_no_request_calls_in():
    """Background work runs on the device's own clock: the partial batch goes out once its oldest page
    is policy.flush_max_delay_ns old, not when the next request happens to call in (50 ms later)."""
    rp, result = replay(_WriterThenReader(), "hymcache", window_bytes=16 * MiB)
    assert result["total"]["blocks_written"] == 3 and result["total"]["blocks_read"] == 1
    last_flush_ms = max(ssd.write_media.free_at for ssd in rp.ctl.timing.ssds) / 1e6
    assert last_flush_ms < 5
    # each flush write landing, the partial batch falling due: a handful, where a tick per ms would be 50
    assert 0 < result["speed"]["background_events"] < 20


# ---- the command line --------------------------------------------------------------------------
def test_chm_replay_compare_writes_table_json_and_plot(tmp_path, capsys):
    rc = chm_main(["replay", str(GOLDEN), "--profile", "small", "--compare", "lru,hymcache", "--block-bytes", "256KiB",
                   "--tokens-per-block", "512", "--window-bytes", "512KiB", "--window-s", "0.00001", "--time-scale",
                   "0.01", "--no-progress", "--out", str(tmp_path),
                   "--set", "dram.size_bytes=4194304", "--set", "policy.prefetch_window_bytes=1048576",
                   "--set", "policy.flush_batch_bytes=524288"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "read GB/s" in out and " lru " in out and " hymcache " in out and "total" in out
    results = json.loads((tmp_path / "replay.json").read_text())
    assert [r["policy"] for r in results] == ["lru", "hymcache"]
    assert results[0]["total"]["hit_pages"] == GOLDEN_COUNTS["lru"]["hit_pages"]
    assert len(results[0]["rows"]) > 1  # several time windows
    assert (tmp_path / "replay.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    (["nosuchgen"], "neither a file nor one of"),
    (["microbench", "--compare", "lru,fifo"], "'fifo' is not one of"),
    (["microbench", "--block-bytes", "12MB"], "--block-bytes"),
    (["microbench", "--window-s", "0"], "--window-s"),
    (["microbench", "--turns", "0"], "--turns: 0 must be >= 1"),
    (["microbench", "--device-policy", "nosuch"], "argument --device-policy: policy.name = 'nosuch' is not one of"),
    (["microbench", "--device-policy", "lru", "--set", "policy.name=lru"], "--device-policy and --set policy.name"),
])
def test_chm_replay_bad_arguments_name_the_parameter(argv, message, capsys):
    assert chm_main(["replay", *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def _chm_replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHM), "replay", *args, "--no-progress"], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_chm_replay_of_a_trace_without_requests_is_an_error_naming_the_file(tmp_path, text):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    run = _chm_replay(str(empty))
    assert run.returncode == 1, run.stdout
    assert run.stderr.startswith(f"chm replay: error: {empty}: no requests"), run.stderr
    assert run.stdout == ""  # no all-zero table


def test_chm_replay_of_a_bad_trace_line_is_a_runtime_error_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 5, "hash_ids": [2, 3\n')
    run = _chm_replay(str(bad))
    assert run.returncode == 1 and run.stderr.startswith(f"chm replay: error: {bad}:2: "), run.stderr
