"""chm_write_admission in lockstep with emulator.write_buffer.WriteAdmission
and FlushArbiter.

The bench runs a small write path around the block: a writer asks for
write-buffer pages, admitted pages become dirty, a flusher asks the arbiter
for grants (with the dirty count, the reads in flight and the oldest dirty
page's age) and, some cycles after a grant, releases the flushed pages.
Admissions and releases run concurrently, so they meet in the same cycle;
every handshake is replayed on the reference in the RTL's order (cycle, then
release before admission) and every admission result and every grant is
compared.
"""

from __future__ import annotations

import random
from collections import deque

import cocotb
from cocotb.triggers import RisingEdge

from emulator.write_buffer import FlushArbiter, WriteAdmission
from rtl_model.tb.common import (StreamSink, StreamSource, check, cycle, params, start, stall_pattern,
                                 trace_requests, write_cycles)

TOKENS_PER_PAGE = 64  # KV tokens per write-buffer page in the trace replay


class TB:
    def __init__(self, dut, stall: bool, seed: int = 1):
        self.dut = dut
        p = params()
        self.capacity, self.batch = p["CAPACITY_PAGES"], p["BATCH_PAGES"]
        self.max_reads, self.max_delay = p["MAX_READS"], p["MAX_DELAY"]
        self.max_request = (1 << p["PAGES_W"]) - 1
        self.max_dirty, self.max_reads_in = (1 << p["DIRTY_W"]) - 1, (1 << p["READS_W"]) - 1
        self.max_age = (1 << p["AGE_W"]) - 1
        self.admission = WriteAdmission(self.capacity)
        self.arbiter = FlushArbiter(self.batch, self.max_reads, self.max_delay)
        self.adm = StreamSource(dut, "adm", ["pages"], stall_pattern(stall, seed))
        self.res = StreamSink(dut, "res", ["admitted", "free"], stall_pattern(stall, seed + 1))
        self.rel = StreamSource(dut, "rel", ["pages"], stall_pattern(stall, seed + 2))
        self.arb = StreamSource(dut, "arb", ["dirty", "reads", "age", "force"], stall_pattern(stall, seed + 3))
        self.gnt = StreamSink(dut, "gnt", ["pages"], stall_pattern(stall, seed + 4))
        self.events: list[tuple[int, int, int]] = []  # (cycle, 0 release / 1 admission, pages)
        self.expected: deque[tuple[int, int, int, int]] = deque()  # (admitted, free after, pages, cycle)
        self.results = 0
        self.admissions = 0
        self.result_cycles: list[int] = []
        self.sending = False
        self.rng = random.Random(seed + 6)
        self.decisions = {"admitted": 0, "refused": 0, "granted": 0, "held": 0, "exactly_full": 0, "same_cycle": 0}
        self.dirty: deque[list[int]] = deque()  # [cycle admitted, pages] chunks, oldest first
        self.releases: deque[int] = deque()
        self.releases_in_flight = 0
        self.reads_started: deque[int] = deque()  # cycles reads started (trace replay)
        cocotb.start_soon(self._check_results())
        cocotb.start_soon(self._send_releases())

    # ---- admission path ----
    async def admit(self, pages: int) -> int:
        self.admissions += 1
        moved = await self.adm.send(pages=pages)
        self.events.append((moved, 1, pages))
        return moved

    async def release(self, pages: int) -> int:
        moved = await self.rel.send(pages=pages)
        self.events.append((moved, 0, pages))
        return moved

    def _replay_until(self, before: int) -> None:
        """Feed the reference every handshake that moved before cycle ``before``, in the RTL's order."""
        due = sorted(e for e in self.events if e[0] < before)
        self.events = [e for e in self.events if e[0] >= before]
        cycles = [e[0] for e in due]
        for moved, kind, pages in due:
            if kind == 0:
                self.admission.release(pages)
            else:
                if cycles.count(moved) > 1:
                    self.decisions["same_cycle"] += 1
                exactly = pages == self.admission.free_pages
                admitted = self.admission.admit(pages)
                self.decisions["exactly_full"] += exactly and admitted
                self.expected.append((int(admitted), self.admission.free_pages, pages, moved))

    async def _check_results(self) -> None:
        while True:
            beat = await self.res.recv()
            self._replay_until(beat["cycle"])
            check("an admission was expected", bool(self.expected), True, f"result at cycle {beat['cycle']}")
            admitted, free, pages, moved = self.expected.popleft()
            ctx = f"admission #{self.results} of {pages} pages accepted at cycle {moved}"
            check("admitted", beat["admitted"], admitted, ctx)
            check("free pages", beat["free"], free, ctx)
            self.results += 1
            self.result_cycles.append(beat["cycle"])
            self.decisions["admitted" if admitted else "refused"] += 1
            if admitted and pages:
                self.dirty.append([moved, pages])

    async def _send_releases(self) -> None:
        while True:
            if self.releases:
                self.sending = True
                await self.release(self.releases.popleft())
                self.sending = False
            else:
                await RisingEdge(self.dut.clk)

    # ---- flush path ----
    def dirty_pages(self) -> int:
        return sum(chunk[1] for chunk in self.dirty)

    async def ask(self, dirty: int, reads: int, age: int, force: bool) -> int:
        """One grant request, compared with FlushArbiter.grant on the same inputs."""
        expected = self.arbiter.grant(dirty, reads, age, force)
        await self.arb.send(dirty=dirty, reads=reads, age=age, force=int(force))
        beat = await self.gnt.recv()
        check("grant", beat["pages"], expected, f"dirty={dirty} reads={reads} age={age} force={force}")
        self.decisions["granted" if expected else "held"] += 1
        return beat["pages"]

    async def flush_step(self, reads: int, force: bool, rng: random.Random) -> None:
        """Ask for a grant with the current dirty state; flush what is granted."""
        dirty = min(self.dirty_pages(), self.max_dirty)
        age = min(cycle() - self.dirty[0][0], self.max_age) if self.dirty else 0
        granted = await self.ask(dirty, min(reads, self.max_reads_in), age, force)
        self.take_dirty(granted)
        if granted:
            cocotb.start_soon(self._complete_flush(granted, rng.randrange(3, 30)))

    def take_dirty(self, pages: int) -> None:
        """The oldest ``pages`` dirty pages leave the dirty list (flushed or handed back)."""
        while pages:
            take = min(pages, self.dirty[0][1])
            self.dirty[0][1] -= take
            if not self.dirty[0][1]:
                self.dirty.popleft()
            pages -= take

    async def _complete_flush(self, pages: int, latency: int) -> None:
        self.releases_in_flight += 1
        for _ in range(latency):
            await RisingEdge(self.dut.clk)
        while pages:  # one release beat carries at most a request's worth
            part = min(pages, self.max_request)
            self.releases.append(part)
            pages -= part
        self.releases_in_flight -= 1

    async def settle(self) -> None:
        """Wait for every admission's result, then feed the reference the releases that moved since."""
        while self.results < self.admissions or self.releases or self.sending:
            await RisingEdge(self.dut.clk)
        await RisingEdge(self.dut.clk)
        self._replay_until(cycle() + 1)
        check("every admission answered", len(self.expected), 0)

    async def drain(self) -> None:
        """Force-flush everything; then the buffer must be empty and take exactly its capacity."""
        while self.dirty or self.releases or self.sending or self.releases_in_flight or self.results < self.admissions:
            if self.dirty:
                await self.flush_step(0, True, self.rng)
            await RisingEdge(self.dut.clk)
        await self.settle()
        check("reference buffer empty", self.admission.used_pages, 0)
        if self.capacity <= self.max_request:
            await self.admit(self.capacity)
            await self.admit(1)
            await self.settle()
            check("whole buffer admitted, one page more refused", self.admission.used_pages, self.capacity)
            self.take_dirty(self.capacity)
            await self.release(self.capacity)
            await self.settle()
            check("reference buffer empty again", self.admission.used_pages, 0)


# ---- sequences ------------------------------------------------------------------------

async def random_traffic(tb: TB, writes: int, seed: int) -> None:
    rng = random.Random(seed)

    async def flusher(stop: list[bool]) -> None:
        while not stop[0]:
            await tb.flush_step(rng.randrange(tb.max_reads + 3), rng.random() < 0.05, rng)
            for _ in range(rng.randrange(6)):
                await RisingEdge(tb.dut.clk)

    stop = [False]
    task = cocotb.start_soon(flusher(stop))
    for _ in range(writes):
        pages = rng.choice([0, 1, 1, 2, 3, tb.batch, tb.capacity // 2, min(tb.capacity + 1, tb.max_request)])
        await tb.admit(pages)
        for _ in range(rng.randrange(3)):
            await RisingEdge(tb.dut.clk)
    stop[0] = True
    await task
    await tb.drain()


async def corner_traffic(tb: TB) -> None:
    cap = tb.capacity
    # exactly full, one more, nothing, more than the whole buffer
    for pages in (cap - 3, 3, 1, 0, min(cap + 1, tb.max_request)):
        await tb.admit(pages)
    # a release and an admission that only fits thanks to it, in the same cycle
    both = [cocotb.start_soon(tb.release(2)), cocotb.start_soon(tb.admit(2))]
    for task in both:
        await task
    await tb.admit(1)  # full again: refused
    await tb.settle()
    tb.take_dirty(2)  # those 2 pages went back by hand above
    # the arbiter's edges
    b, r, d = tb.batch, tb.max_reads, tb.max_delay
    for dirty, reads, age, force in [
        (0, 0, d, True), (0, 0, d, False),                       # nothing dirty
        (b + 5, r + 1, 0, True), (b - 1 or 1, r + 1, 0, True),   # force ignores reads
        (b, r, 0, False), (b, r + 1, 0, False),                  # read threshold, exactly
        (b - 1 or 1, 0, d - 1, False), (b - 1 or 1, 0, d, False),  # delay, exactly
        (b + 1, 0, 0, False), (tb.max_dirty, 0, tb.max_age, False),
        (tb.max_dirty, tb.max_reads_in, tb.max_age, True),
    ]:
        await tb.ask(dirty, min(reads, tb.max_reads_in), min(age, tb.max_age), force)
    await tb.drain()


async def trace_traffic(tb: TB, requests: int) -> None:
    """A cut of the Mooncake trace: each request reads its prefix blocks (reads in
    flight for 6 cycles each) and writes its output's KV (output tokens /
    64 per page); the flusher asks for a grant before each request."""
    rng = random.Random(7)
    last_ts = None
    for req in trace_requests(requests):
        gap = 2 + (0 if last_ts is None else min(req["timestamp"] - last_ts, 40))
        last_ts = req["timestamp"]
        for _ in range(gap):
            await RisingEdge(tb.dut.clk)
        now = cycle()
        while tb.reads_started and tb.reads_started[0] < now - 6:
            tb.reads_started.popleft()
        await tb.flush_step(len(tb.reads_started), False, rng)
        tb.reads_started.extend([cycle()] * len(req["hash_ids"]))
        pages = min(-(-req["output_length"] // TOKENS_PER_PAGE), tb.max_request)
        await tb.admit(pages)
    await tb.drain()


# ---- tests ------------------------------------------------------------------------------

@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_random(dut, stall):
    tb = TB(dut, stall, seed=11)
    await start(dut)
    await random_traffic(tb, 1500, seed=5)
    dut._log.info("decisions reached: %s", tb.decisions)
    for what in ("admitted", "refused", "granted", "held", "exactly_full", "same_cycle"):
        check(f"random traffic exercised '{what}'", tb.decisions[what] > 0, True, str(tb.decisions))


@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_corners(dut, stall):
    tb = TB(dut, stall, seed=21)
    await start(dut)
    await corner_traffic(tb)
    dut._log.info("decisions reached: %s", tb.decisions)
    check("corners exercised a same-cycle release and admission", tb.decisions["same_cycle"] > 0 or stall, True)


@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_trace(dut, stall):
    tb = TB(dut, stall, seed=31)
    await start(dut)
    await trace_traffic(tb, 400)
    dut._log.info("decisions reached: %s", tb.decisions)
    for what in ("admitted", "refused", "granted", "held"):
        check(f"trace exercised '{what}'", tb.decisions[what] > 0, True, str(tb.decisions))


@cocotb.test()
async def test_cycles(dut):
    """Admission latency (accept to result) and interval (back-to-back accepts); grant latency."""
    tb = TB(dut, stall=False)
    await start(dut)
    sent = [await tb.admit(1) for _ in range(4)]
    await tb.settle()
    arb_sent = await tb.arb.send(dirty=1, reads=0, age=0, force=1)
    gnt = await tb.gnt.recv()
    check("forced grant", gnt["pages"], 1)
    write_cycles("chm_write_admission", {
        "admission_latency": tb.result_cycles[0] - sent[0],
        "admission_interval": (sent[-1] - sent[0]) / (len(sent) - 1),
        "grant_latency": gnt["cycle"] - arb_sent,
    })
