"""The DRAM-hit read in C (``chm_dev_read_hit``) and ``chm serve``'s C loop (``chm_srv_serve``).

The native path must be indistinguishable from the Python one: the same workload run with it on and
forced off ends with the same stats, latencies, timing state, eviction order and bytes. It serves only
whole hits and changes nothing when it declines (a miss, a merged miss, an unsettled staging read, a
failed one, a policy that looks pages up in Python).
"""

from __future__ import annotations

import errno
import random
import threading
import time

import pytest

from emulator import ChmError, Device, load_profile
from emulator.controller import Controller
from driver.wire import lib as wire
from emulator.native import ffi, lib
from emulator.policies import make_policy, policy_class, register, unregister
from emulator.policies.fifo import FifoOrder
from emulator.serve import server as server_mod
from emulator.serve.server import DeviceServer
from tests.driver.rawclient import RawClient
from tests.emulator.serve.serving import unique_node

from .conftest import KiB, TINY

MiB = 1 << 20
NATIVE_POLICIES = ("lru", "fifo", "clock", "sieve", "s3fifo", "hymcache")


POLICY_FIT = {"s3fifo": {"policy.s3fifo.small_size_ratio": 0.25}}  # TINY's 12 staging frames need a larger small queue


def tiny_config(policy: str, data: bool = True, more: dict | None = None):
    return load_profile("small").with_overrides({**TINY, "policy.name": policy, "emulation.data": data,
                                                 **POLICY_FIT.get(policy, {}), **(more or {})})


def controller_state(ctl: Controller) -> dict:
    """Everything the read path can change, as plain values."""
    timing = ctl.timing
    pipes = [timing.link_to_host, timing.link_to_device, timing.dram] + \
            [p for s in timing.ssds for p in (s.read_media, s.write_media)]
    areas = ctl.policy.areas
    snapshot = ctl.snapshot()
    del snapshot["device_epoch"]  # a new random id per formatted media
    return {
        "snapshot": snapshot,
        "pipes": [(p.name, p.free_at, p.busy_ns, p.bytes) for p in pipes],
        "controller": (timing.controller.free_at, timing.controller.busy_ns),
        "histograms": {k: (h.count, h.total_ns, h.min_ns, h.max_ns, bytes(h.counts))
                       for k, h in timing.latencies.histograms.items()},
        "ready_at": list(ctl.ready_at),
        "pages": [list(a.table.page_of) for a in areas],
        "queues": [[o.queue() for o in a.table.orders] for a in areas if not a.table.plugin],
    }


def run_workload(ctl: Controller, seed: int, ops: int = 400) -> list:
    """A random mix of reads (mostly of recently used ranges: hits), writes, prefetches, flushes and
    background work; returns what each operation answered (finish times, bytes, errnos)."""
    rng = random.Random(seed)
    cap, page = ctl.capacity, ctl.page
    now, out, handles, recent = 0.0, [], [], [0]
    for _ in range(ops):
        now += rng.choice((0.0, 10.0, 500.0, 20_000.0, 2e6))
        kind = rng.random()
        try:
            if kind < 0.55:
                base = rng.choice(recent) if rng.random() < 0.8 else rng.randrange(cap)
                addr = min(base + rng.randrange(2 * page), cap - 1)
                length = min(rng.choice((1, 100, page, page + 7, 3 * page)), cap - addr)
                buf = bytearray(length) if ctl.data else None
                done = ctl.read(addr, length, now, None if buf is None else memoryview(buf))  # outcomes alike too
                out.append(("read", done, None if buf is None else bytes(buf)))
            elif kind < 0.75:
                addr = rng.randrange(cap - 3 * page)
                length = rng.choice((page, 2 * page, 100))
                data = bytes(rng.randrange(256) for _ in range(length)) if ctl.data else None
                out.append(("write", ctl.write(addr, None if data is None else memoryview(data), length, now)))
                recent = (recent + [addr])[-8:]
            elif kind < 0.85:
                addr = rng.randrange(cap - 2 * page)
                issued = ctl.prefetch(addr, rng.choice((page, 2 * page)), now)
                handles.append(issued.handle)
                recent = (recent + [addr])[-8:]
                out.append(("prefetch", issued))
            elif kind < 0.92 and handles:
                handle = handles.pop(rng.randrange(len(handles)))
                out.append(("wait", ctl.wait(handle, now)))
                if rng.random() < 0.7:
                    out.append(("release", ctl.release(handle, now)))
                else:
                    handles.append(handle)
            elif kind < 0.95:
                out.append(("flush", ctl.flush(now)))
            else:
                out.append(("run_until", ctl.run_until(now)))
        except ChmError as exc:  # WriteBufferFull, a full prefetch window: answers like any other
            out.append(("error", exc.errno))
    return out


@pytest.mark.parametrize("data", [True, False], ids=["data", "timing-only"])
@pytest.mark.parametrize("policy", NATIVE_POLICIES)
def test_native_hits_end_where_python_ends(tmp_path, native_hits_served, policy, data):
    served = native_hits_served
    results = []
    for native in (True, False):
        media = tmp_path / f"media-{native}"
        media.mkdir()
        ctl = Controller(tiny_config(policy, data), media if data else None, log=lambda _: None)
        try:
            assert ctl.native_read
            ctl.native_read = native
            answers = run_workload(ctl, seed=7)
            results.append((answers, controller_state(ctl)))
        finally:
            ctl.close(1e12)
    (native_answers, native_state), (python_answers, python_state) = results
    assert sum(1 for pages in served if pages) >= 20, "the workload must give the native path hits to serve"
    assert native_answers == python_answers
    assert native_state == python_state


def test_hit_read_serves_whole_hits_only_and_changes_nothing_when_it_declines(media_dir):
    ctl = Controller(tiny_config("lru"), media_dir, log=lambda _: None)
    finish = ffi.new("double *")

    def hit(addr, length, now):
        before = controller_state(ctl)
        pages = lib.chm_dev_read_hit(ctl.native_dev, addr, length, now, ffi.NULL, 1, finish)
        if not pages:
            assert controller_state(ctl) == before, "a declined read changed the device"
        return pages

    try:
        assert hit(0, 4 * KiB, 0.0) == 0  # a miss
        ctl.read(0, 4 * KiB, 0.0, memoryview(bytearray(4 * KiB)))
        assert hit(0, 4 * KiB, 0.0) == 0  # staged but not in DRAM yet: a merged miss
        assert hit(0, 8 * KiB, 1e9) == 0  # one page of two is a miss
        assert hit(0, 0, 1e9) == 0 and hit(ctl.capacity - 10, 11, 1e9) == 0 and hit(ctl.capacity, 1, 1e9) == 0
        assert hit(0, 4 * KiB, 1e9) == 1 and finish[0] > 1e9
        assert hit(100, 4 * KiB, 1e9) == 0  # the second page is not resident

        handle = ctl.prefetch(64 * KiB, 4 * KiB, 2e9).handle
        assert hit(64 * KiB, 4 * KiB, 3e9) == 0  # its staging read has not been settled
        ctl.wait(handle, 3e9)
        assert hit(64 * KiB, 4 * KiB, 3e9) == 1  # pinned by the prefetch: a hit all the same, as in Python
        ctl.release(handle, 3e9)
    finally:
        ctl.close(4e9)


def test_a_failed_staging_read_is_raised_by_python_and_stops_the_hit_path(media_dir):
    with Device.open("small", media_dir, policy="lru", overrides=TINY) as dev:
        dev.write(0, b"z" * 4 * KiB)
    faults = {"faults.errno": "EIO", "faults.ops": "read", "faults.first_failing_op": 1, "faults.failing_ops": 1}
    with Device.open("small", media_dir, policy="lru", overrides={**TINY, **faults}, log=lambda _: None) as dev:
        ctl = dev.controller
        handle = dev.prefetch(0, 4 * KiB)
        with pytest.raises(ChmError) as exc:
            dev.wait(handle)
        assert exc.value.errno == errno.EIO and ctl.read_error
        assert ctl.quiet_until(dev.clock_ns) == float("-inf")  # the C loop serves nothing now
        with pytest.raises(ChmError) as exc:  # resident, ready and settled, but failed: Python raises it
            dev.read(0, 4 * KiB)
        assert exc.value.errno == errno.EIO
        dev.release(handle)
        assert dev.read(0, 4 * KiB) == b"z" * 4 * KiB  # dropped once unpinned, read again
        assert not ctl.read_error and ctl.quiet_until(dev.clock_ns) == float("inf")


def test_policies_that_look_up_or_count_hits_in_python_stay_in_python(media_dir):
    assert all(make_policy(tiny_config(p)).native_lookup_areas() for p in NATIVE_POLICIES)
    hym = make_policy(tiny_config("hymcache"))
    assert hym.native_lookup_areas() == [hym.write_area, hym.read_area]

    class TouchCounting(policy_class("lru")):
        def touch(self, frame):
            super().touch(frame)

    assert TouchCounting(tiny_config("lru")).native_lookup_areas() is None
    lru = make_policy(tiny_config("lru"))
    lru.touch = lambda frame: None  # an instance's own touch, too
    assert lru.native_lookup_areas() is None

    class PluginOrder(FifoOrder):  # overrides an operation: a plug-in, run in Python
        def hit(self, page):
            super().hit(page)

    register("plugin-fifo", PluginOrder)
    try:
        ctl = Controller(tiny_config("plugin-fifo"), media_dir, log=lambda _: None)
        try:
            assert not ctl.native_read and ctl.native_dev.n_areas == 0
            ctl.write(0, memoryview(b"p" * 4 * KiB), 4 * KiB, 0.0)
            out = bytearray(4 * KiB)
            ctl.read(0, 4 * KiB, 1e6, memoryview(out))
            assert out == b"p" * 4 * KiB and ctl.snapshot()["page_hits"] == 1
        finally:
            ctl.close(2e6)
        srv = DeviceServer(tiny_config("plugin-fifo"), media_dir, node=unique_node("plugin"), log=lambda _: None,
                           format_media=True)
        try:
            assert not srv.native_loop  # chm serve runs the plug-in's reads in the Python loop
        finally:
            srv.shutdown()
    finally:
        unregister("plugin-fifo")


def test_pacing_keeps_the_python_loop(media_dir):
    srv = DeviceServer(tiny_config("lru"), media_dir, node=unique_node("paced"), log=lambda _: None,
                       format_media=True, pacing=True)
    try:
        assert srv.ctl.native_read and not srv.native_loop  # held completions are Python's
    finally:
        srv.shutdown()


def test_quiet_until_is_the_next_background_event(media_dir):
    delay = 50_000.0
    ctl = Controller(tiny_config("lru", more={"policy.lru_writeback_delay_ns": delay}), media_dir,
                     log=lambda _: None)
    try:
        assert ctl.quiet_until(0.0) == float("inf")
        done = ctl.write(0, memoryview(b"w" * 4 * KiB), 4 * KiB, 0.0).finish
        due = ctl.quiet_until(done)
        assert due == ctl.next_event_ns(done) == pytest.approx(ctl.dirty[0][1] + delay)
        ctl.tick(due)  # the flush starts then ...
        assert ctl.flights and not ctl.dirty
        assert ctl.quiet_until(due) == ctl.flights[0][0]  # ... and its landing is the next event
    finally:
        ctl.close(1e9)


# ---- chm serve: the C loop against the Python loop -------------------------------------------------

SERVE_SMALL = {"dram.size_bytes": 32 * MiB, "policy.prefetch_window_bytes": 4 * MiB}  # the small profile, less DRAM


class _NoIdleTime:
    """The server's view of ``time`` with no idle wall time passing on the device clock: two servers then
    see the same virtual times whatever the scheduling."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def monotonic_ns() -> int:
        return 0


class ThreadedServer:
    def __init__(self, cfg, media, native: bool):
        self.srv = DeviceServer(cfg, media, node=unique_node("hits"), log=lambda _: None, format_media=True,
                                native_hits=native)
        assert self.srv.native_loop == native
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.srv.request_stop()
        self.thread.join(timeout=60)


def submit(c: RawClient, commands: list[dict]) -> list[tuple]:
    """Publish ``commands`` with one tail store and one doorbell; their completions, in order, as
    (user_data, res, latency_ns, clock_ns)."""
    for k, fields in enumerate(commands):
        e = c.sq[(c.tail + k) % c.entries]
        for name in ("flags", "rsvd0", "rsvd1", "rsvd2", "handle", "timeout_ns", "addr", "len", "buf_offset"):
            setattr(e, name, 0)
        for name, value in fields.items():
            setattr(e, name, value)
    c.publish(c.tail + len(commands))
    out = []
    for _ in commands:
        c.reap(1, timeout=60)
        e = c.cq[(c.head - 1) % c.hdr.cq_entries]
        out.append((e.user_data, e.res, e.latency_ns, e.clock_ns))
    return out


def serve_script(cfg, media, native: bool) -> tuple[list, dict, bytes, int]:
    """Writes, then reads (hits, misses, merged misses, errors, a large read in pieces) while a flush falls
    due, then stats: the completions, the STATS_JSON, the staging bytes and how many hits C served."""
    server = ThreadedServer(cfg, media, native)
    try:
        c = RawClient(server.srv.node_path.name, entries=256, staging=8 * MiB)
        page = cfg.device.page_size_bytes
        rng = random.Random(3)
        c.staging[: 8 * page] = bytes(rng.randrange(256) for _ in range(8 * page))
        done = submit(c, [dict(user_data=1, opcode=wire.CHM_OP_WRITE, addr=0, len=8 * page, buf_offset=0)])
        reads = []
        for i in range(120):
            r = rng.random()
            if r < 0.7:
                addr, length = rng.randrange(8 * page - 100), rng.choice((1, 100, 4 * KiB, page))
            elif r < 0.8:
                addr, length = rng.randrange(64 * page), page  # misses
            else:
                addr, length = 0, 3 * MiB  # a large read: pieces, in Python
            reads.append(dict(user_data=100 + i, opcode=wire.CHM_OP_READ, addr=addr, len=min(length, 8 * page - addr
                                                                                           if r < 0.7 else length),
                              buf_offset=rng.randrange(4 * MiB)))
        reads += [dict(user_data=900, opcode=wire.CHM_OP_READ, addr=0, len=page, buf_offset=0, rsvd2=1),  # EINVAL
                  dict(user_data=901, opcode=wire.CHM_OP_READ, addr=cfg.capacity_bytes, len=page),  # ERANGE
                  dict(user_data=902, opcode=wire.CHM_OP_READ, addr=0, len=page, buf_offset=8 * MiB),  # EFAULT
                  dict(user_data=903, opcode=wire.CHM_OP_READ, addr=0, len=0),  # EINVAL
                  dict(user_data=904, opcode=wire.CHM_OP_PREFETCH, addr=32 * page, len=page),
                  dict(user_data=905, opcode=wire.CHM_OP_READ, addr=32 * page, len=page, buf_offset=0)]
        for start in range(0, len(reads), 100):
            done += submit(c, reads[start: start + 100])
        staging = bytes(c.staging[: 8 * MiB])
        stats = c.stats_json(user_data=999)
        del stats["device_epoch"]  # a new random id per formatted media
        hits = server.srv._loop.hits
        c.close()
    finally:
        server.stop()
    return done, stats, staging, hits


@pytest.mark.parametrize("policy", ["lru", "hymcache"])
def test_chm_serve_answers_the_same_with_the_c_loop_on_or_off(tmp_path, monkeypatch, policy):
    monkeypatch.setattr(server_mod, "time", _NoIdleTime())
    cfg = load_profile("small").with_overrides({**SERVE_SMALL, "policy.name": policy,
                                                "policy.lru_writeback_delay_ns": 200_000,
                                                "policy.flush_max_delay_ns": 200_000})
    native = serve_script(cfg, tmp_path / "native", True)
    python = serve_script(cfg, tmp_path / "python", False)
    assert native[3] > 50 and python[3] == 0, "the C loop served the hits, the Python loop none"
    assert native[0] == python[0]  # every completion: result, modelled latency, client clock
    codes = {ud: res for ud, res, _, _ in native[0]}
    assert codes[900] == -errno.EINVAL and codes[901] == -errno.ERANGE and codes[902] == -errno.EFAULT
    assert codes[903] == -errno.EINVAL and codes[905] == cfg.device.page_size_bytes
    assert native[1] == python[1]  # stats, latency histograms included
    assert native[1]["flush_batches"] >= 1  # a flush fell due among the hits
    assert native[2] == python[2]  # the bytes every read delivered


def test_the_c_loop_gives_other_clients_their_turns(tmp_path, monkeypatch):
    """A client flooding the device with hits does not hold another's command up: one turn each."""
    monkeypatch.setattr(server_mod, "time", _NoIdleTime())
    cfg = load_profile("small").with_overrides({**SERVE_SMALL, "policy.name": "lru"})
    server = ThreadedServer(cfg, tmp_path / "media", True)
    try:
        page = cfg.device.page_size_bytes
        busy = RawClient(server.srv.node_path.name, entries=512, staging=4 * MiB)
        other = RawClient(server.srv.node_path.name, entries=16, staging=4 * MiB)
        submit(busy, [dict(user_data=1, opcode=wire.CHM_OP_READ, addr=0, len=page)])  # now a hit
        hits = [dict(user_data=10 + i, opcode=wire.CHM_OP_READ, addr=0, len=page) for i in range(400)]
        for k, fields in enumerate(hits):  # queued, not yet rung
            e = busy.sq[(busy.tail + k) % busy.entries]
            for name, value in {**dict(flags=0, rsvd0=0, rsvd1=0, rsvd2=0, buf_offset=0), **fields}.items():
                setattr(e, name, value)
        busy.tail += len(hits)
        busy.hdr.sq.tail = busy.tail & 0xFFFFFFFF
        (_, res, _, other_clock), = submit(other, [dict(user_data=2, opcode=wire.CHM_OP_NOP)])
        assert res == 0
        clocks = []
        for _ in hits:
            busy.reap(1, timeout=60)
            clocks.append(busy.cq[(busy.head - 1) % busy.hdr.cq_entries].clock_ns)
        # the other client's command ran after at most one turn (a chunk's worth) of the flood
        assert sum(1 for t in clocks if t <= other_clock) <= server_mod.CHUNK_BYTES // page + server_mod.MAX_BATCH
        busy.close()
        other.close()
    finally:
        server.stop()
