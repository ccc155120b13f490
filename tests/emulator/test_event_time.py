"""Event-driven virtual time: the controller says when its background work is next due, exactly.

Each deadline is checked both ways: a tick one float step before it starts no flush, a tick at it does.
"""

from __future__ import annotations

import math
import random

import pytest

from emulator import load_profile
from emulator.controller import Controller
from emulator.policies import Policy, make_policy
from emulator.timing import TimingModel, earliest_time

from .conftest import TINY

KiB = 1 << 10
PAGE = TINY["device.page_size_bytes"]
BATCH_PAGES = TINY["policy.flush_batch_bytes"] // PAGE
READ_STAGING_ADDR = 256 * KiB  # a page nothing wrote: reading it stages it from an SSD


POLICIES = ["hymcache", "lru", "fifo", "clock", "sieve", "s3fifo"]
ROOMY = {"dram.size_bytes": 256 * KiB}  # 64 frames: enough for every policy's queues (s3fifo's small queue)


def controller(policy: str, python: bool = False, **more) -> Controller:
    """A tiny device with data off: only state and time; ``python``: its flusher on the Python path (a test that
    watches or replaces the flusher's or the policy's methods: the native path does not call them)."""
    cfg = load_profile("small").with_overrides({**TINY, "emulation.data": False, "policy.name": policy, **more})
    ctl = Controller(cfg)
    if python:
        ctl.flusher.to_python()
    return ctl


def before(t: float) -> float:
    return math.nextafter(t, -math.inf)


def flushes_at(ctl: Controller, t: float) -> int:
    """Flush batches a background tick at ``t`` starts."""
    n = ctl.stats["flush_batches"]
    ctl.tick(t)
    return ctl.stats["flush_batches"] - n


# ---- the exact-deadline helpers -------------------------------------------------------------------
def test_earliest_time_is_the_first_float_at_which_the_rule_holds():
    rng = random.Random(7)
    for _ in range(2000):
        since, delay = rng.uniform(0, 1e12), rng.choice([1e4, 1e6, 0.3, rng.uniform(0, 1e9)])
        for due in (lambda t: since <= t - delay, lambda t: t - since >= delay):  # lru's and hymcache's rules
            t = earliest_time(since + delay, due)
            assert due(t) and not due(before(t)), (since, delay)


def test_reads_idle_at_is_when_at_most_n_reads_are_left_in_flight():
    timing = TimingModel(load_profile("small").with_overrides(TINY))
    finishes = [timing.ssds[i % 2].read(1000.0 * i, PAGE) for i in range(6)]

    def in_flight(t):
        return sum(f > t for f in finishes)

    now = 2500.0
    for n in range(7):
        t = timing.reads_idle_at(now, n)
        assert t >= now and in_flight(t) <= n
        if t > now:
            assert in_flight(before(t)) > n
    assert timing.reads_idle_at(now, 0) == max(finishes)
    assert timing.reads_in_flight(now) == in_flight(now)  # the model's own count agrees


# ---- the controller's next event ------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_pending_is_no_event(policy):
    ctl = controller(policy, **ROOMY)
    assert ctl.next_event_ns(0.0) is None
    done = ctl.write(0, None, PAGE, 0.0).finish
    assert ctl.next_event_ns(done) is not None
    ctl.flush(done)
    assert ctl.next_event_ns(done) is None


@pytest.mark.parametrize("delay", [1e4, 0.3, 1e6 / 3])
def test_lru_next_event_is_the_write_back_deadline(delay):
    ctl = controller("lru", **{"policy.lru_writeback_delay_ns": delay})
    ctl.write(0, None, PAGE, 1000.1)
    (_, written), = ctl.dirty
    due = ctl.next_event_ns(written)
    assert due == earliest_time(written + delay, lambda t: ctl.policy.flush_grant(ctl.dirty, t, 0, False) > 0)
    assert abs(due - (written + delay)) <= 1e-9 * due
    assert flushes_at(ctl, before(due)) == 0
    assert flushes_at(ctl, due) == 1
    # a flush in flight that nothing waits for is no event (the next tick retires it: nothing looks before)
    assert ctl.flights and ctl.next_event_ns(due) is None
    ctl.write(2 * PAGE, None, PAGE, due + 5.0)  # the next write is the next deadline
    written = ctl.dirty[0][1]
    assert ctl.next_event_ns(written) == earliest_time(written + delay, lambda t: written <= t - delay)


def test_hymcache_next_event_is_the_max_delay_deadline():
    ctl = controller("hymcache", **{"policy.flush_max_delay_ns": 1e6 / 3})
    max_delay = ctl.cfg.policy.flush_max_delay_ns
    ctl.write(0, None, PAGE, 777.7)  # one page: a partial batch, no reads
    written = ctl.dirty[0][1]
    due = ctl.next_event_ns(written)
    assert due == earliest_time(written + max_delay, lambda t: t - written >= max_delay)
    assert flushes_at(ctl, before(due)) == 0
    assert flushes_at(ctl, due) == 1


def test_hymcache_next_event_waits_for_the_reads_in_flight():
    ctl = controller("hymcache")
    ctl.read(READ_STAGING_ADDR, PAGE, 0.0)  # a miss: an SSD read in flight
    reads_done = ctl.timing.reads_idle_at(0.0)
    ctl.write(0, None, BATCH_PAGES * PAGE, 1000.0)  # a full batch, due at once but for the read
    written = ctl.dirty[-1][1]
    assert written < reads_done and len(ctl.dirty) == BATCH_PAGES
    due = ctl.next_event_ns(written)
    assert due == reads_done
    assert flushes_at(ctl, before(due)) == 0
    assert flushes_at(ctl, due) == 1


def test_hymcache_next_event_is_the_landing_that_frees_the_flusher():
    """At most one batch in flight: with more dirty pages waiting, the next event is when enough of the
    batch's writes have landed to bring the pages in flight under the bound."""
    ctl = controller("hymcache")
    ctl.write(0, None, 2 * BATCH_PAGES * PAGE, 0.0)  # two full batches, no reads
    written = ctl.dirty[-1][1]
    assert ctl.next_event_ns(0.0) == written  # the batch is full once its last page is in DRAM
    assert flushes_at(ctl, written) == 1 and len(ctl.dirty) == BATCH_PAGES  # the second waits for room
    landings = sorted(entry[0] for entry in ctl.flights)
    due = ctl.next_event_ns(written)
    assert due == landings[0]  # one page landed brings the pages in flight under the bound
    assert flushes_at(ctl, before(due)) == 0
    assert flushes_at(ctl, due) == 1


def test_every_flush_landing_is_an_event_when_real_io_waits_to_be_collected(media_dir):
    cfg = load_profile("small").with_overrides({**TINY, "policy.name": "lru"})
    ctl = Controller(cfg, media_dir, log=lambda _: None)
    try:
        done = ctl.write(0, memoryview(bytes(PAGE)), PAGE, 0.0).finish
        ctl.tick(ctl.next_event_ns(done))
        (landing, _, _), = ctl.flights
        assert ctl.next_event_ns(done) == landing  # its media write's outcome is collected then
        assert ctl.run_until(landing) == 1 and not ctl.flights
    finally:
        ctl.close(0.0)


# ---- running the events ------------------------------------------------------------------------------
def test_run_until_runs_each_event_at_its_own_time_and_never_past_until():
    ctl = controller("lru", python=True)
    delay = ctl.cfg.policy.lru_writeback_delay_ns
    started = []
    start_flush = ctl.flusher.start_flush
    ctl.flusher.start_flush = lambda entries, now: (started.append(now), start_flush(entries, now))
    ctl.write(0, None, PAGE, 0.0)
    ctl.write(4 * PAGE, None, PAGE, ctl.dirty[0][1] + delay / 2)  # before the first is due
    first, second = (w for _, w in ctl.dirty)
    assert ctl.run_until(first + delay / 2) == 0 and not started
    assert ctl.run_until(1e18) == 2  # from here to a day or a year later: the same two events
    assert started == [earliest_time(w + delay, lambda t, w=w: w <= t - delay) for w in (first, second)]
    assert ctl.events_run == 2 and ctl.background_ns == 1e18


def test_run_until_refuses_a_deadline_at_which_the_policy_grants_nothing():
    ctl = controller("lru", python=True, **{"policy.lru_writeback_delay_ns": 1e12})
    ctl.write(0, None, PAGE, 0.0)
    ctl.policy.next_flush_at = lambda dirty, now, reads_idle_at: now  # says "now", grants nothing
    with pytest.raises(RuntimeError, match="policy 'lru': next_flush_at said a flush is due at .* but flush_grant "
                                           "granted none"):
        ctl.run_until(1e6)


def test_a_flusher_backing_off_has_no_flush_event_but_a_wall_time_retry():
    ctl = controller("lru", python=True)
    done = ctl.write(0, None, PAGE, 0.0).finish
    assert ctl.retry_wait_s() is None
    ctl.flusher.media_error, ctl.flusher._retry_at = OSError("test"), float("inf")  # as _media_failed leaves it
    assert ctl.next_event_ns(done) is None and ctl.retry_wait_s() == float("inf")
    ctl.flusher._retry_at = 0.0  # the backoff has passed: the write-back is due again
    assert ctl.next_event_ns(done) is not None and ctl.retry_wait_s() is None


def test_every_policy_can_say_when_it_flushes_next():
    for name in POLICIES:
        cfg = load_profile("small").with_overrides({**TINY, **ROOMY, "emulation.data": False, "policy.name": name})
        policy = make_policy(cfg)
        assert policy.next_flush_at([(0, 5.0)], 10.0, lambda n: 10.0) >= 10.0
        assert policy.next_flush_at([], 10.0, lambda n: 10.0) is None


def test_a_policy_that_flushes_but_cannot_say_when_is_named():
    class NoDeadline(Policy):
        name = "no-deadline"

        def flush_grant(self, dirty, now, reads_in_flight, force):
            return len(dirty)

    policy = NoDeadline(load_profile("small").with_overrides({**TINY, "emulation.data": False}))
    with pytest.raises(NotImplementedError, match=r"policy 'no-deadline' \(NoDeadline\) says how many pages to "
                                                  r"flush \(flush_grant\) but not when it next will \(next_flush_at\)"):
        policy.next_flush_at([(0, 1.0)], 2.0, lambda n: 2.0)
