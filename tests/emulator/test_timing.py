"""The timing model: each test compares modelled times that must differ if the model is wrong."""

import pytest

from emulator import Device, load_profile
from emulator.demo import read_in_order

MiB = 1 << 20
SMALL = load_profile("small")
LINK_NS = SMALL.host_link.latency_ns
LINK_GBPS = SMALL.host_link.bandwidth_gbps


@pytest.fixture
def open_dev(media_dir):
    opened = []

    def make(policy, overrides=None, name="d"):
        dev = Device.open("small", media_dir / name, policy=policy, overrides=overrides)
        opened.append(dev)
        return dev

    yield make
    for dev in opened:
        dev.close()


@pytest.mark.parametrize("nbytes", [4096, 1 * MiB, 8 * MiB])
def test_dram_hit_costs_link_latency_plus_transfer(open_dev, nbytes):
    dev = open_dev("lru")
    dev.write(0, bytes(nbytes))  # lru keeps written pages resident
    dev.read(0, nbytes)
    assert dev.stats()["page_misses"] == 0
    expected = LINK_NS + nbytes / LINK_GBPS
    # controller cycles, DRAM latency and one page of DRAM time ride on top: a few percent, never less
    assert expected <= dev.last_latency_ns <= expected * 1.12 + 500


def test_miss_costs_at_least_the_ssd_latency_more(open_dev):
    dev = open_dev("lru")
    dev.write(0, bytes(MiB))
    dev.read(0, MiB)
    hit = dev.last_latency_ns
    dev.read(64 * MiB, MiB)  # never written, never staged
    assert dev.stats()["page_misses"] == MiB // SMALL.device.page_size_bytes
    assert dev.last_latency_ns >= hit + SMALL.ssd.read_latency_ns


def _read_misses(dev, base, count, size):
    total = 0.0
    for i in range(count):
        dev.read(base + i * size, size)
        total += dev.last_latency_ns
    return total


def test_reads_during_flush_writes_are_slower(open_dev):
    quiet = open_dev("hymcache", name="quiet")
    alone = _read_misses(quiet, 512 * MiB, 8, 256 * 1024)
    busy = open_dev("hymcache", name="busy")
    for i in range(8):  # 8 MiB = one flush batch: the flusher starts while reads are idle
        busy.write(i * MiB, bytes(MiB))
    busy.idle(1)
    assert busy.stats()["flushes_in_flight"] > 0
    mixed = _read_misses(busy, 512 * MiB, 8, 256 * 1024)
    assert busy.stats()["slowed_reads"] > 0 and quiet.stats()["slowed_reads"] == 0
    assert mixed > alone * 1.2


def test_flusher_waits_for_reads_under_hymcache(open_dev):
    dev = open_dev("hymcache")
    for i in range(7):  # just under one batch: held back until the batch fills or the delay passes
        dev.write(i * MiB, bytes(MiB))
    h = dev.prefetch(512 * MiB, 16 * MiB)  # SSD reads in flight from now on
    dev.write(7 * MiB, bytes(MiB))  # the batch is full, but reads are in flight
    dev.idle(1)
    assert dev.stats()["flush_batches"] == 0
    dev.wait(h)
    dev.release(h)
    dev.idle(1)  # reads done: now the flusher may go
    assert dev.stats()["flush_batches"] == 1


def test_lru_writes_back_even_while_reads_run(open_dev):
    dev = open_dev("lru")
    h = dev.prefetch(512 * MiB, 16 * MiB)
    dev.write(0, bytes(MiB))
    dev.idle(SMALL.policy.lru_writeback_delay_ns)
    assert dev.stats()["flush_batches"] >= 1  # CMM-H-style: dirty data goes out at once
    dev.release(h)


SCAN = {"dram.size_bytes": 4 * MiB, "policy.prefetch_window_bytes": MiB, "policy.flush_batch_bytes": MiB}
OBJECT = 256 * 1024
OBJECTS = 32  # 8 MiB scanned: twice the DRAM


def _scan(dev, window):
    for _ in read_in_order(dev, OBJECTS, OBJECT, window):
        pass


def test_lru_sequential_scan_larger_than_dram_never_hits_on_second_pass(open_dev):
    dev = open_dev("lru", SCAN)
    _scan(dev, 0)
    first = dev.stats()
    _scan(dev, 0)
    second = dev.stats()
    assert second["page_hits"] - first["page_hits"] == 0
    assert second["page_misses"] - first["page_misses"] == OBJECTS * OBJECT // SMALL.device.page_size_bytes


def test_hymcache_prefetch_ahead_hits_on_second_pass(open_dev):
    dev = open_dev("hymcache", SCAN)
    _scan(dev, 3)
    first = dev.stats()
    _scan(dev, 3)
    second = dev.stats()
    pages = OBJECTS * OBJECT // SMALL.device.page_size_bytes
    assert second["page_misses"] - first["page_misses"] == 0
    assert second["merged_misses"] - first["merged_misses"] == 0
    assert second["page_hits"] - first["page_hits"] == pages


def test_concurrent_misses_to_a_page_share_one_ssd_read(open_dev):
    dev = open_dev("hymcache")
    h = dev.prefetch(0, MiB)
    staged = dev.stats()["ssd_read_bytes"]
    dev.read(0, MiB)  # before the prefetch has landed: waits on the same reads
    s = dev.stats()
    assert s["merged_misses"] == MiB // SMALL.device.page_size_bytes and s["page_misses"] == 0
    assert s["ssd_read_bytes"] == staged == MiB
    dev.release(h)


def test_prefetch_then_wait_costs_the_staging_time(open_dev):
    dev = open_dev("hymcache")
    h = dev.prefetch(0, 4 * MiB)
    ack = dev.last_latency_ns
    dev.wait(h)
    assert ack < SMALL.ssd.read_latency_ns < dev.last_latency_ns
    dev.read(0, 4 * MiB)
    assert dev.last_latency_ns <= LINK_NS + 4 * MiB / LINK_GBPS * 1.12 + 500  # now a DRAM hit
    dev.release(h)


class SteppedClock:
    """Pacing's clock in a test: time moves only when the device sleeps (and by ``step`` per reading)."""

    def __init__(self, step: float = 0.0):
        self.now, self.step, self.sleeps = 1000.0, step, []

    def monotonic(self) -> float:
        self.now += self.step
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_pacing_holds_each_call_until_its_modelled_finish(media_dir):
    slow_link = {"host_link.bandwidth_gbps": 0.02}  # 1 MiB takes ~52 ms of modelled time each way
    clock = SteppedClock()
    with Device.open("small", media_dir, policy="lru", overrides=slow_link, pacing=True, clock=clock) as dev:
        start = clock.now
        dev.write(0, bytes(MiB))
        after_write = dev.clock_ns
        assert clock.now - start == pytest.approx(after_write / 1e9)  # held until the write's modelled finish
        dev.read(0, MiB)
        assert dev.clock_ns > 100e6 and len(clock.sleeps) == 2
        assert clock.now - start == pytest.approx(dev.clock_ns / 1e9)


def test_pacing_does_not_wait_for_a_finish_already_past(media_dir):
    with Device.open("small", media_dir, policy="lru", pacing=True, clock=SteppedClock(step=10.0)) as dev:
        dev.write(0, bytes(MiB))  # the wall clock is 10 s on at each reading: far past any modelled finish
        assert dev.clock.sleeps == []


def test_without_pacing_a_call_never_sleeps(media_dir):
    clock = SteppedClock()
    with Device.open("small", media_dir, policy="lru", clock=clock) as dev:
        dev.write(0, bytes(MiB))
        assert clock.sleeps == [] and dev.clock_ns > 0
