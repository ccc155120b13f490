"""Per-operation outcomes: what ``Controller.read``, ``write`` and ``prefetch`` return says what the call did to
the device's counters, so a caller (the replayer) never diffs ``stats`` or looks into the policy or the
prefetch engine. Checked against the stats deltas over random operation sequences, with the native DRAM-hit
read on and off."""

from __future__ import annotations

import errno
import random

import pytest

from emulator import ChmError, WriteBufferFull, load_profile
from emulator.controller import Controller, PrefetchOutcome, ReadOutcome, WriteOutcome

from .conftest import TINY

READ_COUNTERS = ("page_hits", "page_misses", "merged_misses")
PREFETCH_COUNTERS = ("prefetch_staged_pages", "prefetch_resident_pages")


def make_controller(policy: str, data: bool, media_dir) -> Controller:
    cfg = load_profile("small").with_overrides({**TINY, "policy.name": policy, "emulation.data": data})
    return Controller(cfg, media_dir if data else None, log=lambda _: None, format_media=True)


def deltas(before: dict, after: dict, names) -> tuple[int, ...]:
    return tuple(after[name] - before[name] for name in names)


def check_workload(ctl: Controller, seed: int, ops: int = 600) -> dict[str, int]:
    """A random mix of reads (mostly of recent ranges), writes, prefetches, waits, releases, flushes and
    background work; each outcome is checked against the stats it moved. Returns totals of what was seen."""
    rng = random.Random(seed)
    cap, page = ctl.capacity, ctl.page
    stats, policy = ctl.stats, ctl.policy
    now, handles, recent = 0.0, [], [0]
    seen = dict.fromkeys(("hit", "missed", "merged", "new", "overwritten", "refused", "staged", "resident",
                          "busy", "write_buffer"), 0)
    for _ in range(ops):
        now += rng.choice((0.0, 10.0, 500.0, 20_000.0, 2e6))
        kind = rng.random()
        before = dict(stats)
        if kind < 0.5:
            base = rng.choice(recent) if rng.random() < 0.8 else rng.randrange(cap)
            addr = min(base + rng.randrange(2 * page), cap - 1)
            length = min(rng.choice((1, 100, page, page + 7, 3 * page)), cap - addr)
            out = memoryview(bytearray(length)) if ctl.data else None
            got = ctl.read(addr, length, now, out)
            assert type(got) is ReadOutcome and isinstance(got.finish, float) and got.finish >= now
            pages = (addr + length - 1) // page - addr // page + 1
            assert got.hit_pages + got.missed_pages + got.merged_pages == pages
            assert (got.hit_pages, got.missed_pages, got.merged_pages) == deltas(before, stats, READ_COUNTERS)
            assert stats["reads"] - before["reads"] == 1 and stats["read_bytes"] - before["read_bytes"] == length
            seen["hit"] += got.hit_pages
            seen["missed"] += got.missed_pages
            seen["merged"] += got.merged_pages
        elif kind < 0.75:
            addr = rng.randrange(0, cap - 3 * page, 512)
            length = rng.choice((page, 2 * page, 100))
            span = range(addr // page, (addr + length - 1) // page + 1)
            new = sum(1 for p in span if policy.write_lookup(p) is None)
            data = memoryview(bytes(rng.randrange(256) for _ in range(length))) if ctl.data else None
            try:
                got = ctl.write(addr, data, length, now)
            except WriteBufferFull as exc:
                assert exc.new_pages == new
                assert stats["refused_writes"] - before["refused_writes"] == 1
                assert stats["write_bytes"] == before["write_bytes"]
                seen["refused"] += 1
            else:
                assert type(got) is WriteOutcome and isinstance(got.finish, float) and got.finish >= now
                assert (got.new_pages, got.overwritten_pages) == (new, len(span) - new)
                admission = getattr(policy, "admission", None)
                assert got.write_buffer_pages == (0 if admission is None else admission.used_pages)
                assert stats["write_bytes"] - before["write_bytes"] == length
                recent = (recent + [addr])[-8:]
                seen["new"] += got.new_pages
                seen["overwritten"] += got.overwritten_pages
                seen["write_buffer"] = max(seen["write_buffer"], got.write_buffer_pages)
        elif kind < 0.87:
            base = rng.choice(recent) if rng.random() < 0.5 else rng.randrange(cap)
            addr = min(base, cap - 2 * page)  # recent ranges: pages resident (read, or in the write buffer)
            size = rng.choice((page, 2 * page))
            try:
                got = ctl.prefetch(addr, size, now)
            except ChmError as exc:
                assert exc.errno == errno.EBUSY  # the device-wide window or handles are full
                assert deltas(before, stats, PREFETCH_COUNTERS) == (0, 0)
                seen["busy"] += 1
            else:
                assert type(got) is PrefetchOutcome and isinstance(got.ack, float)
                pages = (addr + size - 1) // page - addr // page + 1
                assert got.staged_pages + got.resident_pages == pages
                assert (got.staged_pages, got.resident_pages) == deltas(before, stats, PREFETCH_COUNTERS)
                assert got.window_pages_held == ctl.snapshot()["prefetch_pages_held"] <= ctl.prefetch_window_pages
                handles.append(got.handle)
                recent = (recent + [addr])[-8:]
                seen["staged"] += got.staged_pages
                seen["resident"] += got.resident_pages
        elif kind < 0.94 and handles:
            handle = handles.pop(rng.randrange(len(handles)))
            now = ctl.wait(handle, now)
            if rng.random() < 0.7:
                ctl.release(handle, now)
            else:
                handles.append(handle)
        elif kind < 0.97:
            ctl.flush(now)
        else:
            ctl.run_until(now)
    for handle in handles:
        ctl.release(handle, now)
    return seen


@pytest.mark.parametrize("native", [True, False], ids=["native-hits", "python-hits"])
@pytest.mark.parametrize("data", [True, False], ids=["data", "timing-only"])
@pytest.mark.parametrize("policy", ["lru", "hymcache"])
def test_outcomes_equal_the_stats_they_moved(tmp_path, native_hits_served, policy, data, native):
    served = native_hits_served
    ctl = make_controller(policy, data, tmp_path)
    try:
        assert ctl.native_read
        ctl.native_read = native
        seen = check_workload(ctl, seed=11)
    finally:
        ctl.close(1e13)
    # the sequence reached every kind of outcome it checks
    assert seen["hit"] and seen["missed"] and seen["merged"] and seen["new"] and seen["overwritten"]
    assert seen["staged"] and seen["resident"] and seen["busy"]
    assert (seen["refused"] > 0 and seen["write_buffer"] > 0) == (policy == "hymcache")
    assert (sum(1 for pages in served if pages) >= 20) == native, "native hits must be served (only) when on"


def test_prefetch_limits_are_the_configs(tmp_path):
    ctl = make_controller("hymcache", False, tmp_path)
    page = ctl.page
    assert ctl.prefetch_window_pages == TINY["policy.prefetch_window_bytes"] // page
    assert ctl.prefetch_max_handles == TINY["policy.prefetch_max_handles"]
    got = ctl.prefetch(0, 3 * page, 0.0)
    assert got.window_pages_held == 3
    with pytest.raises(ChmError) as exc:
        ctl.prefetch(8 * page, 2 * page, 0.0)  # 5 of 4 window pages
    assert exc.value.errno == errno.EBUSY
    ctl.close(1e9)
