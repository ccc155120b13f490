"""chm_prefetch_engine in lockstep with emulator.prefetch.PrefetchEngine.

Each command's status code is compared with what the reference returns or
raises (ChmError errno); each page fetch leaving the RTL is compared with the
reference's ``next_fetch()``; each completion is fed to ``arrived()`` and the
objects must become ready in the order the reference reports. Staging frames
(not modelled by the reference) are checked by a scoreboard: a fetch only
targets a frame in range that no held object owns.
"""

from __future__ import annotations

import errno
import random
from collections import deque

import cocotb
from cocotb.triggers import RisingEdge

from emulator.errors import ChmError
from emulator.prefetch import PrefetchEngine
from rtl_model.tb.common import (StreamSink, StreamSource, check, params, start, stall_pattern, trace_requests,
                                 write_cycles)

ISSUE, RELEASE, QUERY = range(3)
OP_NAMES = ["ISSUE", "RELEASE", "QUERY"]
OK = 0


class SsdModel:
    """The SSD side: takes page fetches, completes them in random (or oldest-first) order."""

    def __init__(self, tb: "TB", stall: bool, seed: int):
        self.tb = tb
        self.rng = random.Random(seed)
        self.pending: list[tuple[int, int, int]] = []  # (handle, page, frame)
        self.hold = False        # complete nothing while set
        self.in_order = False    # oldest first instead of random
        self.fetch_cycles: list[int] = []
        cocotb.start_soon(self._take_fetches())
        cocotb.start_soon(self._complete())

    async def _take_fetches(self) -> None:
        tb = self.tb
        while True:
            beat = await tb.fq.recv()
            expected = tb.ref.next_fetch()
            got = (beat["handle"], beat["page"])
            check("fetch (handle, page)", got, expected, f"fetch #{len(self.fetch_cycles)}")
            frame = beat["frame"]
            check("staging frame in window", frame < tb.window, True, f"frame {frame}")
            check("staging frame free", tb.frame_owner.get(frame), None, f"frame {frame}")
            tb.frame_owner[frame] = beat["handle"]
            self.pending.append((beat["handle"], beat["page"], frame))
            self.fetch_cycles.append(beat["cycle"])

    async def _complete(self) -> None:
        tb = self.tb
        while True:
            if self.hold or not self.pending:
                await RisingEdge(tb.dut.clk)
                continue
            i = 0 if self.in_order else self.rng.randrange(len(self.pending))
            handle, _, frame = self.pending.pop(i)
            await tb.cpl.send(frame=frame)
            if tb.ref.arrived(handle):
                tb.expected_ready.append(handle)


class TB:
    def __init__(self, dut, stall: bool, seed: int = 1):
        self.dut = dut
        p = params()
        self.window, self.max_handles = p["WINDOW_PAGES"], p["MAX_HANDLES"]
        self.handle_space = 1 << p["HANDLE_W"]
        self.addr_space = 1 << p["ADDR_W"]
        self.ref = PrefetchEngine(self.window, self.max_handles)
        self.cmd = StreamSource(dut, "cmd", ["op", "handle", "page", "pages"], stall_pattern(stall, seed))
        self.sts = StreamSink(dut, "sts", ["code", "handle", "staged"], stall_pattern(stall, seed + 1))
        self.fq = StreamSink(dut, "fq", ["handle", "page", "frame"], stall_pattern(stall, seed + 2))
        self.cpl = StreamSource(dut, "cpl", ["frame"], stall_pattern(stall, seed + 3))
        self.rdy = StreamSink(dut, "rdy", ["handle"], stall_pattern(stall, seed + 4))
        self.frame_owner: dict[int, int] = {}
        self.expected_ready: deque[int] = deque()
        self.ready_seen: dict[int, int] = {}  # handle -> cycle its ready beat moved
        self.ssd = SsdModel(self, stall, seed + 5)
        self.commands = 0
        self.codes: dict[int, int] = {}
        cocotb.start_soon(self._watch_ready())

    async def _watch_ready(self) -> None:
        while True:
            beat = await self.rdy.recv()
            check("a ready object was expected", bool(self.expected_ready), True, f"handle {beat['handle']}")
            check("ready order", beat["handle"], self.expected_ready.popleft())
            self.ready_seen[beat["handle"]] = beat["cycle"]

    def _reference(self, op: int, handle: int, page: int, pages: int) -> tuple[int, int | None]:
        """(expected status code, expected staged flag or None when not checked)."""
        ref = self.ref
        try:
            if op == ISSUE:
                ref.issue(handle, page, pages)
                self.ready_seen.pop(handle, None)
                return OK, None
            obj = ref.get(handle)
            if op == QUERY:
                return OK, (1 if handle in self.ready_seen else None)
            if not obj.ready:  # the RTL refuses to free frames still being written (documented)
                return errno.EBUSY, 0
            ref.release(handle)
            for frame in [f for f, h in self.frame_owner.items() if h == handle]:
                del self.frame_owner[frame]
            return OK, 1
        except ChmError as e:
            return e.errno, None

    async def command(self, op: int, handle: int, page: int = 0, pages: int = 0) -> dict:
        expected, staged = self._reference(op, handle, page, pages)
        sent = await self.cmd.send(op=op, handle=handle, page=page, pages=pages)
        got = await self.sts.recv()
        got["sent"] = sent
        ctx = f"command #{self.commands} {OP_NAMES[op]} handle={handle} page={page} pages={pages}"
        check("status", got["code"], expected, ctx)
        check("status handle", got["handle"], handle, ctx)
        if staged is not None:
            check("staged", got["staged"], staged, ctx)
        self.commands += 1
        self.codes[got["code"]] = self.codes.get(got["code"], 0) + 1
        return got

    def covered(self) -> None:
        """The sequence reached success, EBUSY and EINVAL."""
        for code in (OK, errno.EBUSY, errno.EINVAL):
            check(f"sequence reached status {code}", self.codes.get(code, 0) > 0, True, str(self.codes))

    async def wait_ready(self, handle: int, limit: int = 20000) -> int:
        for _ in range(limit):
            if handle in self.ready_seen:
                return self.ready_seen[handle]
            await RisingEdge(self.dut.clk)
        raise AssertionError(f"handle {handle} never became ready")

    async def drain(self) -> None:
        """Let every object stage, release them all, and check the window is whole again."""
        for handle in list(self.ref.objects):
            await self.wait_ready(handle)
            await self.command(RELEASE, handle)
        check("reference window empty", self.ref.pages_held, 0)
        await self.command(ISSUE, 0, page=0, pages=self.window)  # the whole window is free again
        await self.wait_ready(0)
        await self.command(RELEASE, 0)


# ---- sequences ------------------------------------------------------------------------

async def random_commands(tb: TB, count: int, seed: int) -> None:
    rng = random.Random(seed)
    handles = min(tb.handle_space, 2 * tb.max_handles + 3)  # small: handles collide and get reused
    sizes = [1, 1, 2, 3, tb.window // 2, tb.window, tb.window + 1]
    for _ in range(count):
        r = rng.random()
        ready = [h for h in tb.ref.objects if h in tb.ready_seen]
        if r < 0.45:
            await tb.command(ISSUE, rng.randrange(handles), page=rng.randrange(tb.addr_space - tb.window),
                             pages=rng.choice(sizes))
        elif r < 0.75 and ready:
            await tb.command(RELEASE, rng.choice(ready))
        elif r < 0.85:  # unknown, or released already
            unknown = [h for h in range(handles) if h not in tb.ref.objects]
            if unknown:
                await tb.command(RELEASE, rng.choice(unknown))
        else:
            await tb.command(QUERY, rng.randrange(handles))
        for _ in range(rng.randrange(4)):
            await RisingEdge(tb.dut.clk)
    await tb.drain()


async def corner_commands(tb: TB) -> None:
    w = tb.window
    # the window exactly full, then one page more
    await tb.command(ISSUE, 1, page=100, pages=w - 3)
    await tb.command(ISSUE, 2, page=500, pages=3)
    await tb.command(ISSUE, 3, page=900, pages=1)        # EBUSY: window full
    await tb.command(ISSUE, 1, page=900, pages=1)        # EINVAL: handle in use
    await tb.command(ISSUE, 4, page=900, pages=w + 1)    # EINVAL: can never fit
    await tb.drain()
    # every handle slot taken
    for h in range(tb.max_handles):
        await tb.command(ISSUE, 10 + h, page=10 * h, pages=1)
    await tb.command(ISSUE, 99, page=0, pages=1)         # EBUSY: no handle free
    await tb.drain()
    # release before staged (RTL: EBUSY), then staged, then twice, then never issued
    tb.ssd.hold = True
    await tb.command(ISSUE, 7, page=3000, pages=3)
    while len(tb.ssd.pending) < 3:
        await RisingEdge(tb.dut.clk)
    await tb.command(RELEASE, 7)
    await tb.command(QUERY, 7)
    tb.ssd.hold = False
    await tb.wait_ready(7)
    await tb.command(QUERY, 7)
    await tb.command(RELEASE, 7)
    await tb.command(RELEASE, 7)                          # EINVAL: double release
    await tb.command(RELEASE, 12345 % tb.handle_space)    # EINVAL: never issued
    # three objects, completions held and then given back in reverse order
    tb.ssd.hold = True
    for h, n in ((20, 2), (21, 1), (22, 3)):
        await tb.command(ISSUE, h, page=7000 + 16 * h, pages=min(n, w // 3))
    want = sum(o.pages for o in tb.ref.objects.values())
    while len(tb.ssd.pending) < want:
        await RisingEdge(tb.dut.clk)
    tb.ssd.pending.reverse()
    tb.ssd.in_order, tb.ssd.hold = True, False
    await tb.drain()
    # highest page address
    await tb.command(ISSUE, 5, page=tb.addr_space - 2, pages=2)
    await tb.drain()


async def trace_commands(tb: TB, requests: int) -> None:
    """HyMCache's KV Manager over a cut of the Mooncake trace: every KV block
    (hash id, two pages) of a request is prefetched under its own handle within
    the bounded window and consumed (released) in issue order; a full window
    (EBUSY) waits for the oldest object and releases it."""
    outstanding: deque[int] = deque()
    handle = 0
    for req in trace_requests(requests):
        for block in req["hash_ids"]:
            pages = min(2, tb.window)
            page = (block * pages) % (tb.addr_space - pages)
            while True:
                handle = (handle + 1) % tb.handle_space
                r = await tb.command(ISSUE, handle, page=page, pages=pages)
                if r["code"] == OK:
                    outstanding.append(handle)
                    break
                oldest = outstanding.popleft()
                await tb.wait_ready(oldest)
                await tb.command(RELEASE, oldest)
    await tb.drain()


# ---- tests ------------------------------------------------------------------------------

@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_random(dut, stall):
    tb = TB(dut, stall, seed=11)
    await start(dut)
    await random_commands(tb, 1000, seed=5)
    dut._log.info("decisions reached: %s", tb.codes)
    tb.covered()


@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_corners(dut, stall):
    tb = TB(dut, stall, seed=21)
    await start(dut)
    await corner_commands(tb)
    dut._log.info("decisions reached: %s", tb.codes)
    tb.covered()


@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_trace(dut, stall):
    tb = TB(dut, stall, seed=31)
    await start(dut)
    await trace_commands(tb, 30)
    dut._log.info("decisions reached: %s", tb.codes)
    check("trace filled the window (EBUSY) and drained it", tb.codes.get(errno.EBUSY, 0) > 0, True, str(tb.codes))


@cocotb.test()
async def test_cycles(dut):
    """Issue-to-ready per page with an SSD side that answers every fetch at once:
    the slope between a 1-page and a whole-window object; the fetch interval."""
    tb = TB(dut, stall=False)
    tb.ssd.in_order = True
    await start(dut)
    latency = {}
    for pages in (1, tb.window):
        r = await tb.command(ISSUE, pages, page=64, pages=pages)
        latency[pages] = await tb.wait_ready(pages) - r["sent"]
        await tb.command(RELEASE, pages)
    fetches = tb.ssd.fetch_cycles[-tb.window:]
    write_cycles("chm_prefetch_engine", {
        "issue_to_ready_1_page": latency[1],
        f"issue_to_ready_{tb.window}_pages": latency[tb.window],
        "issue_to_ready_per_page": (latency[tb.window] - latency[1]) / (tb.window - 1),
        "fetch_interval": (fetches[-1] - fetches[0]) / (len(fetches) - 1),
    })
