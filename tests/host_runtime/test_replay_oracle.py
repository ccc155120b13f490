"""Sequential replay against libCacheSim as the oracle: on the Mooncake conversation trace, with one 2 MiB
page per hash id and N pages of device DRAM, the device's misses (read misses plus first-touch writes) equal
libCacheSim's for the same policy, exactly.

The oracle's access sequence is built here from the JSONL itself (every hash id of every request, in file
order; each one object of size 1; a cache of N objects), not by the replay's reader."""

from __future__ import annotations

import json

import pytest

from emulator.config import load_profile
from emulator.errors import ConfigError
from emulator.shared_data import mooncake_conversation_trace
from host_runtime.replay import MooncakeTrace, Replay, replay_config
from host_runtime.replay.traces import MOONCAKE_TOKENS_PER_HASH
from tests.conftest import require_oracle

lcs = require_oracle("libcachesim")  # the oracle: missing, these tests fail with the install hint

PROFILE = "paper"
PAGE = load_profile(PROFILE).device.page_size_bytes  # 2 MiB: the block of one hash id
CACHE_PAGES = (1024, 4096, 16384, 65536)
# The policies below are checked against libCacheSim alone, at fewer sizes (each replay takes ~5 s):
# a small cache (many evictions, a fractional S3-FIFO small queue) and a large one (many hits).
FEW_CACHE_PAGES = (1024, 16384)

# libCacheSim's misses on the whole trace (issue 11's table): pins the oracle's access sequence.
MOONCAKE_MISSES = {
    "lru": {1024: 275_669, 4096: 263_241, 16384: 211_887, 65536: 184_799},
    "fifo": {1024: 275_921, 4096: 264_089, 16384: 218_203, 65536: 187_857},
}
S3FIFO_PARAMS = {"small_size_ratio": 0.1, "ghost_size_ratio": 0.9, "move_to_main_threshold": 2}
CLOCK_PARAMS = {"n_bit_counter": 1}
# device policy -> libCacheSim's cache of n objects, at the parameters the device's policy is given
LIBCACHESIM = {
    "lru": lambda n: lcs.LRU(n),
    "fifo": lambda n: lcs.FIFO(n),
    "s3fifo": lambda n: lcs.S3FIFO(n, **S3FIFO_PARAMS),
    "sieve": lambda n: lcs.Sieve(n),
    "clock": lambda n: lcs.Clock(n, **CLOCK_PARAMS),
}
# the device policy's own section ([policy.NAME]), set to the same parameters
DEVICE_PARAMS = {"s3fifo": S3FIFO_PARAMS, "clock": CLOCK_PARAMS}
CASES = [(policy, pages) for policy in MOONCAKE_MISSES for pages in CACHE_PAGES] + \
        [(policy, pages) for policy in LIBCACHESIM if policy not in MOONCAKE_MISSES for pages in FEW_CACHE_PAGES]


@pytest.fixture(scope="module")
def mooncake_hash_ids() -> list[int]:
    with mooncake_conversation_trace().open() as f:
        return [h for line in f if line.strip() for h in json.loads(line)["hash_ids"]]


@pytest.fixture(scope="module")
def mooncake_pages() -> MooncakeTrace:
    """The trace as the replay reads it: one block of one page per hash id."""
    return MooncakeTrace(mooncake_conversation_trace(), block_bytes=PAGE, tokens_per_block=MOONCAKE_TOKENS_PER_HASH)


def libcachesim_misses(cache, obj_ids) -> int:
    req = lcs.Request()
    req.obj_size = 1
    misses = 0
    for obj_id in obj_ids:
        req.obj_id = obj_id
        misses += not cache.get(req)
    return misses


def device_config(policy: str, pages: int):
    """The paper profile with ``pages`` pages of DRAM, all of them cache, under device policy ``policy``."""
    overrides = {"dram.size_bytes": pages * PAGE, "policy.prefetch_window_bytes": PAGE,
                 **{f"policy.{policy}.{key}": value for key, value in DEVICE_PARAMS.get(policy, {}).items()}}
    try:
        cfg = replay_config(PROFILE, "lru", overrides, device_policy=policy)
    except ConfigError as exc:
        pytest.fail(f"device policy {policy!r} is not available in the emulator (is it registered in "
                    f"emulator.policies?), or refuses {overrides}: {exc.message}")
    assert cfg.read_staging_frames == pages
    return cfg


def test_the_cases_cover_every_policy_and_the_whole_table():
    assert {policy for policy, _ in CASES} == set(LIBCACHESIM)
    assert all((policy, pages) in CASES for policy, row in MOONCAKE_MISSES.items() for pages in row)


@pytest.mark.parametrize("policy, pages", CASES)
def test_sequential_replay_misses_equal_libcachesim(policy, pages, mooncake_hash_ids, mooncake_pages):
    expected = libcachesim_misses(LIBCACHESIM[policy](pages), mooncake_hash_ids)
    if policy in MOONCAKE_MISSES:
        assert expected == MOONCAKE_MISSES[policy][pages]
    replay = Replay(device_config(policy, pages), "lru", mooncake_pages, progress=False, sequential=True)
    result = replay.run()
    cache = result["cache"]
    assert cache["accesses"] == len(mooncake_hash_ids)  # every hash id reached the DRAM exactly once
    assert cache["write_misses"] == len(set(mooncake_hash_ids))  # a first touch is a write
    assert result["device"]["merged_misses"] == 0  # no access overlapped another
    assert cache["misses"] == expected, f"{policy} with {pages} pages: device {cache['misses']}, libCacheSim {expected}"


def test_overlapping_replay_is_not_what_the_oracle_sees(mooncake_pages):
    """Without --sequential, requests overlap in virtual time (pinned frames, merged misses): the counts
    differ from the cache simulator's, which is why the oracle needs the sequential mode."""
    trace = MooncakeTrace(mooncake_conversation_trace(), block_bytes=PAGE, tokens_per_block=MOONCAKE_TOKENS_PER_HASH,
                          limit=2000, time_scale=0.001)
    ids = [h for _, hash_ids in trace.records for h in hash_ids]
    expected = libcachesim_misses(LIBCACHESIM["lru"](1024), ids)
    results = {sequential: Replay(device_config("lru", 1024), "lru", trace, progress=False,
                                  sequential=sequential).run() for sequential in (False, True)}
    assert results[True]["cache"]["misses"] == expected
    assert results[False]["device"]["merged_misses"] > 0
    assert results[False]["cache"]["misses"] != expected
