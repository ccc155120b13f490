"""Fairness in the device process: a large command is served in pieces,
round-robin with other clients, while its modelled time stays that of one call."""

import errno
import os
import time

import pytest

from driver.wire import lib
from emulator.config import load_profile
from emulator.controller import Controller
from tests.driver.rawclient import RawClient, device_barrier, wait_device_asleep
from tests.emulator.serve.serving import Server

MiB = 1 << 20
BIG = 128 * MiB
BIG_READS = 4


@pytest.fixture
def server(tmp_path):
    with Server(tmp_path / "media") as srv:
        yield srv


def submit_all(c: RawClient, commands: list[dict], ring: bool = True) -> None:
    """Fill several submission slots, then publish them with one tail store (one fetch takes them all).

    ``ring=False`` publishes without writing the doorbell: a sleeping device does not see them yet."""
    for k, fields in enumerate(commands):
        e = c.sq[(c.tail + k) % c.entries]
        for name in ("flags", "rsvd0", "rsvd1", "rsvd2", "handle", "timeout_ns"):
            setattr(e, name, 0)
        for name, value in fields.items():
            setattr(e, name, value)
    if ring:
        c.publish(c.tail + len(commands))
    else:
        c.tail += len(commands)
        c.hdr.sq.tail = c.tail & 0xFFFFFFFF


def completions(c: RawClient, n: int) -> list[tuple[int, int, int]]:
    """n completions as (user_data, res, the client's modelled clock after the command)."""
    out = []
    for _ in range(n):
        c.reap(1, timeout=120)
        e = c.cq[(c.head - 1) % c.hdr.cq_entries]
        out.append((e.user_data, e.res, e.clock_ns))
    return out


def race(server, big_commands: list[dict], big_staging: int) -> tuple[list, tuple]:
    """A client with ``big_commands`` and a victim with one 4 KiB read, both queued while the device
    sleeps, then one doorbell: the device finds both at once, the big client first (it attached first).

    The device time a command starts at is the latest finish of every command completed before it,
    so the completions' modelled clocks give the order the device served them in."""
    big = RawClient(server.node, entries=64, staging=big_staging)
    victim = RawClient(server.node)
    wait_device_asleep(server.node)
    submit_all(big, big_commands, ring=False)
    submit_all(victim, [dict(user_data=99, opcode=lib.CHM_OP_READ, addr=0, len=4096, buf_offset=0)], ring=False)
    os.eventfd_write(big.evfd, 1)
    (mine,) = completions(victim, 1)
    theirs = completions(big, len(big_commands))
    big.close()
    victim.close()
    return theirs, mine


def test_a_small_read_does_not_wait_behind_large_reads(server):
    """The defect: a 4 KiB read next to a client doing 512 MiB reads waited for them (p50 373 ms)."""
    theirs, mine = race(server, [dict(user_data=i + 1, opcode=lib.CHM_OP_READ, addr=i * BIG, len=BIG, buf_offset=0)
                                 for i in range(BIG_READS)], BIG)
    assert [(ud, res) for ud, res, _ in theirs] == [(i + 1, BIG) for i in range(BIG_READS)]  # in order, whole
    assert mine[:2] == (99, 4096)
    # Served before even the first large read was done (run whole, it would come after all of them).
    assert mine[2] < theirs[0][2], (mine, theirs)


def test_many_medium_reads_take_turns_too(server):
    """Commands of one piece each are not split, but a turn ends after about a piece's worth of bytes."""
    n = 32  # one fetch
    theirs, mine = race(server, [dict(user_data=i + 1, opcode=lib.CHM_OP_READ, addr=i * MiB, len=MiB, buf_offset=0)
                                 for i in range(n)], MiB)
    assert [(ud, res) for ud, res, _ in theirs] == [(i + 1, MiB) for i in range(n)]
    before_mine = sum(clock < mine[2] for _, _, clock in theirs)
    assert before_mine <= 1, f"{before_mine} of {n} reads of 1 MiB were served before the 4 KiB read"


@pytest.mark.parametrize("policy", ["hymcache", "lru"])  # lru has no write buffer: its large writes go in pieces too
def test_commands_after_a_large_one_keep_their_order_and_bytes(tmp_path, policy):
    with Server(tmp_path / "media", None, "--policy", policy) as server:
        c = RawClient(server.node, staging=16 * MiB)
        pattern = bytes(range(256)) * (6 * MiB // 256)
        c.staging[: len(pattern)] = pattern
        at = 3 * MiB + 512  # not piece-aligned: the first and last pieces are partial
        submit_all(c, [
            dict(user_data=1, opcode=lib.CHM_OP_WRITE, addr=at, len=len(pattern), buf_offset=0),
            dict(user_data=2, opcode=lib.CHM_OP_NOP),
            dict(user_data=3, opcode=lib.CHM_OP_READ, addr=at, len=len(pattern), buf_offset=8 * MiB),
            dict(user_data=4, opcode=lib.CHM_OP_READ, addr=at, len=4096, buf_offset=15 * MiB),
            dict(user_data=5, opcode=lib.CHM_OP_READ, addr=(8 << 30) - MiB, len=2 * MiB, buf_offset=0),  # past the end
        ])
        assert c.reap(5) == [(1, len(pattern)), (2, 0), (3, len(pattern)), (4, 4096), (5, -errno.ERANGE)]
        assert bytes(c.staging[8 * MiB: 8 * MiB + len(pattern)]) == pattern
        assert bytes(c.staging[15 * MiB: 15 * MiB + 4096]) == pattern[:4096]
        stats = c.stats_json()
        assert stats["reads"] == 2 and stats["writes"] == 1  # a command in pieces still counts once
        assert stats["latency"]["read"]["count"] == 2 and stats["latency"]["write"]["count"] == 1
        c.close()


def test_a_large_read_in_pieces_has_the_modelled_time_of_one_call(server, tmp_path):
    size = 16 * MiB  # 16 pieces
    c = RawClient(server.node, staging=size)
    c.push(user_data=1, opcode=lib.CHM_OP_READ, addr=0, len=size, buf_offset=0)
    assert c.reap(1) == [(1, size)]
    served = c.cq[0].latency_ns
    cfg = load_profile("small").with_overrides({"emulation.data": False})
    alone = Controller(cfg)
    one_call = alone.read(0, size, 0.0).finish
    # The SSDs, DRAM and the host link serialize as for one call. Only the controller's cycles differ:
    # one call looks up every page before moving any, a piece only its own, so later pieces' lookups
    # overlap earlier pieces' transfers (and each piece pays the per-command cycles).
    pieces, pages = size // MiB, size // cfg.device.page_size_bytes
    cycle_ns = 1000.0 / cfg.controller.clock_mhz
    slack = (pages * cfg.controller.cycles_per_lookup + pieces * cfg.controller.cycles_per_command) * cycle_ns
    assert abs(served - one_call) <= slack + 1, (served, one_call, slack)
    # Charged from each piece's own finish instead, each piece would wait out the link latency again.
    assert slack < (pieces - 1) * cfg.host_link.latency_ns
    c.close()


# ---- a prefetch wait waits for the media without holding up the device --------------------------------------------
# (Their wall-clock bounds, a slow disk's delay seen and answers well within it, are bench_fairness.py's checks.)

SLOW_DISK_S = 1.0  # every media read completes this long after it is submitted (test-only fault)


@pytest.fixture
def slow_disk(tmp_path):
    # lru: a page written stays in DRAM once flushed (hymcache's write buffer lets it go), so reading it is a hit
    with Server(tmp_path / "media", None, "--policy", "lru", "--set", f"faults.read_delay_ms={SLOW_DISK_S * 1e3:g}") as srv:
        yield srv


def _parked_waits(client, waiter) -> int:
    """The device's count of parked waits once it is not 0, or 0 once ``waiter``'s wait is answered: a device
    that waits for the media in the waiter's turn answers no stats call meanwhile, so it never says 1."""
    while waiter.hdr.cq.tail == waiter.head & 0xFFFFFFFF:
        n = client.stats_json().get("parked_waits", 0)  # each call waits for its completion
        if n:
            return n
    return 0


def test_a_prefetch_wait_does_not_hold_up_other_clients(slow_disk):
    """The defect: a wait for a prefetch whose SSD reads were in flight ran in the device's one thread, so every
    other client's commands waited for those reads too (a 4 KiB DRAM hit: 12 ms behind a 16 MiB staging)."""
    page = 65536  # the small profile's page: a whole-page write needs nothing from the media
    waiter, other = RawClient(slow_disk.node, staging=MiB), RawClient(slow_disk.node, staging=MiB)
    pattern = bytes(range(256)) * (page // 256)
    other.staging[:page] = pattern
    submit_all(other, [dict(user_data=1, opcode=lib.CHM_OP_WRITE, addr=64 * MiB, len=page, buf_offset=0)])
    assert other.reap(1) == [(1, page)]
    submit_all(waiter, [dict(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=MiB)])
    ((_, handle),) = waiter.reap(1)
    assert handle > 0
    submit_all(waiter, [dict(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1),
                        dict(user_data=3, opcode=lib.CHM_OP_NOP)])  # behind the wait: runs after it
    assert _parked_waits(other, waiter) == 1  # the device has taken the wait
    at = MiB // 2  # past what a stats answer overwrites
    submit_all(other, [dict(user_data=2, opcode=lib.CHM_OP_READ, addr=64 * MiB, len=page, buf_offset=at)])
    assert other.reap(1) == [(2, page)]  # a DRAM hit, answered while the wait waits
    assert waiter.hdr.cq.tail == waiter.head & 0xFFFFFFFF, "the wait was answered before the other client's read"
    assert bytes(other.staging[at:at + page]) == pattern
    assert other.stats_json()["parked_waits"] == 1
    assert waiter.reap(2, timeout=30) == [(2, 0), (3, 0)]  # the wait once the reads landed, then what followed it
    assert other.stats_json()["parked_waits"] == 0
    waiter.close()
    other.close()


def test_a_client_gone_while_its_wait_is_parked_leaves_the_device_serving(slow_disk):
    waiter, other = RawClient(slow_disk.node, staging=MiB), RawClient(slow_disk.node, staging=MiB)
    submit_all(waiter, [dict(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=MiB)])
    ((_, handle),) = waiter.reap(1)
    submit_all(waiter, [dict(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1)])
    assert _parked_waits(other, waiter) == 1
    waiter.close()  # gone with its wait parked: its handle is released, the wait forgotten
    device_barrier(slow_disk.node)  # the device has seen the close
    stats = other.stats_json()
    assert stats["clients"] == 1 and stats["parked_waits"] == 0 and stats["prefetch"]["handles_held"] == 0
    submit_all(other, [dict(user_data=1, opcode=lib.CHM_OP_READ, addr=2 * MiB, len=4096, buf_offset=0)])
    assert other.reap(1, timeout=30) == [(1, 4096)]
    other.close()


def test_a_look_at_a_prefetch_answers_at_once(slow_disk):
    """CHM_WAIT_LOOK (libchm's chm_prefetch_poll): EAGAIN while the object's media reads are in flight, never
    parked; then 0, as a wait would answer. Other flag bits stay refused."""
    from libchm import Device

    c = RawClient(slow_disk.node, staging=MiB)
    submit_all(c, [dict(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=MiB)])
    ((_, handle),) = c.reap(1)
    submit_all(c, [dict(user_data=2, opcode=lib.CHM_OP_WAIT, flags=lib.CHM_WAIT_LOOK, handle=handle, timeout_ns=-1),
                   dict(user_data=3, opcode=lib.CHM_OP_WAIT, flags=2, handle=handle, timeout_ns=-1)])
    assert c.reap(2) == [(2, -errno.EAGAIN), (3, -errno.EINVAL)]
    deadline = time.monotonic() + 30
    while True:  # each look waits for its answer; the reads land meanwhile
        submit_all(c, [dict(user_data=4, opcode=lib.CHM_OP_WAIT, flags=lib.CHM_WAIT_LOOK, handle=handle,
                            timeout_ns=-1)])
        ((_, res),) = c.reap(1)
        if res != -errno.EAGAIN or time.monotonic() > deadline:
            break
        os.sched_yield()
    assert res == 0
    c.close()
    with Device(slow_disk.node) as dev:  # the same through libchm
        h = dev.prefetch(4 * MiB, MiB)
        assert dev.poll(h) is False
        dev.wait(h)
        assert dev.poll(h) is True
        dev.release(h)
        with pytest.raises(Exception) as exc:
            dev.poll(h)
        assert getattr(exc.value, "errno", None) == errno.EINVAL


def test_a_parked_wait_on_more_reads_than_the_ring_holds_is_answered(tmp_path):
    """The defect: reads past the io_uring's depth stayed queued outside the ring when the ones in it had
    already completed (holes of a sparse file complete at once), so no completion was left to wake the
    device from its sleep and the parked wait was never answered."""
    with Server(tmp_path / "media", None, "--set", "emulation.io_queue_depth=4") as srv:
        c = RawClient(srv.node, staging=MiB)
        for k in range(3):  # 16 pages of 64 KiB never written: 4 ring loads each
            submit_all(c, [dict(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=(k + 1) * 64 * MiB, len=MiB)])
            ((_, handle),) = c.reap(1)
            assert handle > 0
            submit_all(c, [dict(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1),
                           dict(user_data=3, opcode=lib.CHM_OP_RELEASE, handle=handle)])
            assert c.reap(2, timeout=10) == [(2, 0), (3, 0)]
        c.close()
