"""chm serve sleeps while idle until the controller's next background event, not on a fixed tick.

The server runs in this process (no client attaches) on a ManualClock, so each sleep is one ``poll`` that
only its timeout ends, at once, the clock moved on by it: the test sees the timeout it chose and the
virtual time the flush started at.
"""

from __future__ import annotations

import pytest

from emulator.serve.server import DeviceServer, ManualClock, idle_wall_wait_ns
from emulator import load_profile

from .serving import unique_node

KiB = 1 << 10
DEADLINE_NS = 40e6  # the flush deadline under test: 40 ms


def test_idle_wall_wait_converts_virtual_time_as_the_idle_clock_advances():
    # without pacing, idle wall time is added to the device time (the floor)
    assert idle_wall_wait_ns(5e6, floor_ns=1e6, wall_virtual_ns=9e9, pacing=False) == 4e6
    assert idle_wall_wait_ns(5e6, floor_ns=6e6, wall_virtual_ns=0.0, pacing=False) == 0.0
    # with pacing, device time is max(floor, wall): it waits for the wall clock to pass the floor first
    assert idle_wall_wait_ns(5e6, floor_ns=1e6, wall_virtual_ns=2e6, pacing=True) == 3e6
    assert idle_wall_wait_ns(5e6, floor_ns=4e6, wall_virtual_ns=2e6, pacing=True) == 3e6
    assert idle_wall_wait_ns(5e6, floor_ns=6e6, wall_virtual_ns=2e6, pacing=True) == 0.0  # already due
    assert idle_wall_wait_ns(5e6, floor_ns=1e6, wall_virtual_ns=7e6, pacing=True) == 0.0


@pytest.fixture
def serve(media_dir):
    servers = []

    def make(policy: str, overrides: dict) -> DeviceServer:
        cfg = load_profile("small").with_overrides({"policy.name": policy, **overrides})
        srv = DeviceServer(cfg, media_dir, node=unique_node("idle"), log=lambda _: None, format_media=True,
                           clock=ManualClock())
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.shutdown()


def flush_starts(srv: DeviceServer) -> list[float]:
    """Record the virtual time of every flush the controller starts from now on."""
    started = []
    start_flush = srv.ctl.flusher.start_flush
    srv.ctl.flusher.start_flush = lambda entries, now: (started.append(now), start_flush(entries, now))
    return started


@pytest.mark.parametrize("policy, overrides", [
    ("lru", {"policy.lru_writeback_delay_ns": DEADLINE_NS}),
    ("hymcache", {"policy.flush_max_delay_ns": DEADLINE_NS}),  # one page: a partial batch, due by age
])
def test_idle_server_with_dirty_pages_wakes_at_the_flush_deadline(serve, policy, overrides):
    srv = serve(policy, overrides)
    assert srv._idle_timeout_ms() is None  # nothing pending: sleep until a client or a signal
    started = flush_starts(srv)
    srv.floor = srv.ctl.write(0, memoryview(b"x" * 4 * KiB), 4 * KiB, srv.floor).finish
    written = srv.ctl.dirty[0][1]
    deadline = srv.ctl.next_event_ns(srv.floor)
    assert deadline == pytest.approx(written + DEADLINE_NS, abs=1e-3)
    assert srv._idle_timeout_ms() == pytest.approx((deadline - srv.floor) / 1e6)  # not a 5 ms tick
    srv._sleep()  # one poll: nothing arrives, so it returns at its timeout (the clock moved on by it)
    assert srv.floor >= deadline  # the idle wall time passed on the device clock
    assert started == [deadline]  # the flush ran at its own virtual time, not at the wake-up's
