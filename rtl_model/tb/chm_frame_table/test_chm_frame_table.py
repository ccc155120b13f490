"""chm_frame_table in lockstep with emulator.frame_table.FrameTable.

Every command goes to the RTL and to the reference; every response field that
the command defines is compared (hit, frame, victim, victim page and dirty
bit, success). Run through rtl_model.sim (pytest: tests/rtl_model).
"""

from __future__ import annotations

import random

import cocotb

from emulator.frame_table import FrameTable
from rtl_model.tb.common import (StreamSink, StreamSource, check, params, start, stall_pattern, trace_requests,
                                 write_cycles)

LOOKUP, INSERT, TOUCH, MARK_DIRTY, CLEAR_DIRTY, INVALIDATE, PIN, UNPIN = range(8)
OP_NAMES = ["LOOKUP", "INSERT", "TOUCH", "MARK_DIRTY", "CLEAR_DIRTY", "INVALIDATE", "PIN", "UNPIN"]
RSP_FIELDS = ["ok", "hit", "frame", "victim", "victim_page", "victim_dirty"]


class TB:
    def __init__(self, dut, stall: bool, seed: int = 1):
        self.dut = dut
        p = params()
        self.frames, self.ways = p["FRAMES"], p["WAYS"]
        self.addr_w, self.pin_max = p["ADDR_W"], (1 << p["PIN_W"]) - 1
        self.ref = FrameTable(self.frames, self.ways)
        self.cmd = StreamSource(dut, "cmd", ["op", "page", "frame"], stall_pattern(stall, seed))
        self.rsp = StreamSink(dut, "rsp", RSP_FIELDS, stall_pattern(stall, seed + 1))
        self.ops = 0
        self.seen = {"hit": 0, "miss_free": 0, "evict_clean": 0, "evict_dirty": 0, "all_pinned": 0, "refused": 0}

    async def op(self, op: int, page: int = 0, frame: int = 0) -> dict:
        """One command through the RTL and the reference; raises LockstepMismatch on any difference."""
        expected = self._reference(op, page, frame)
        sent = await self.cmd.send(op=op, page=page, frame=frame)
        got = await self.rsp.recv()
        got["latency"] = got["cycle"] - sent
        got["sent"] = sent
        ctx = f"op #{self.ops} {OP_NAMES[op]} page={page} frame={frame}"
        for name, value in expected.items():
            check(name, got[name], value, ctx)
        self.ops += 1
        if op in (LOOKUP, INSERT):
            key = ("hit" if got["hit"] else "all_pinned" if not got["ok"] else
                   "miss_free" if not got["victim"] else "evict_dirty" if got["victim_dirty"] else "evict_clean")
            self.seen[key] += 1
        elif not got["ok"]:
            self.seen["refused"] += 1
        return got

    def covered(self, *what: str) -> None:
        """The sequence reached these decisions (a lockstep run that never evicts proves little)."""
        for key in what:
            check(f"sequence reached '{key}'", self.seen[key] > 0, True, str(self.seen))

    def _reference(self, op: int, page: int, frame: int) -> dict:
        ref = self.ref
        if op in (LOOKUP, INSERT):
            hit = ref.lookup(page)
            if hit is not None:
                if op == INSERT:
                    ref.touch(hit)
                return dict(ok=1, hit=1, frame=hit, victim=0)
            if op == INSERT:
                ins = ref.insert(page)
                if ins is None:
                    return dict(ok=0, hit=0)
                out = dict(ok=1, hit=0, frame=ins.frame, victim=int(ins.victim_page is not None))
                if ins.victim_page is not None:
                    out.update(victim_page=ins.victim_page, victim_dirty=int(ins.victim_dirty))
                return out
            if ref.free_ways(page):  # a free way: the lowest-numbered one
                s = ref.set_of(page)
                free = min(f for f in range(s * self.ways, (s + 1) * self.ways) if ref.page_of[f] is None)
                return dict(ok=1, hit=0, frame=free, victim=0)
            victim = ref.lru_victim(page)
            if victim is None:
                return dict(ok=0, hit=0)
            return dict(ok=1, hit=0, frame=victim, victim=1, victim_page=ref.page_of[victim],
                        victim_dirty=int(ref.dirty[victim]))
        valid = ref.page_of[frame] is not None
        ok = {TOUCH: valid, MARK_DIRTY: valid, CLEAR_DIRTY: valid,
              INVALIDATE: valid and ref.pins[frame] == 0,
              PIN: valid and ref.pins[frame] < self.pin_max,
              UNPIN: valid and ref.pins[frame] > 0}[op]
        if ok:
            {TOUCH: ref.touch, MARK_DIRTY: ref.mark_dirty, CLEAR_DIRTY: ref.clear_dirty,
             INVALIDATE: ref.invalidate, PIN: ref.pin, UNPIN: ref.unpin}[op](frame)
        return dict(ok=int(ok))


# ---- sequences ------------------------------------------------------------------------

async def random_ops(tb: TB, count: int, seed: int) -> None:
    rng = random.Random(seed)
    pages = 3 * tb.frames  # enough pressure to evict, few enough to hit
    weights = {INSERT: 40, LOOKUP: 20, TOUCH: 8, MARK_DIRTY: 10, CLEAR_DIRTY: 3, INVALIDATE: 7, PIN: 6, UNPIN: 6}
    ops, w = zip(*weights.items())
    for _ in range(count):
        op = rng.choices(ops, w)[0]
        await tb.op(op, page=rng.randrange(pages), frame=rng.randrange(tb.frames))


async def corner_ops(tb: TB) -> None:
    """Full sets, all ways dirty, all ways pinned, pin counter full, illegal frame ops."""
    sets = tb.frames // tb.ways
    ref = tb.ref
    # fill set 0 with pages 0, sets, 2*sets, ... and dirty every way
    set0 = [k * sets for k in range(tb.ways)]
    for page in set0:
        await tb.op(INSERT, page=page)
    for way in range(tb.ways):
        await tb.op(MARK_DIRTY, frame=way)
    # touch in reverse so the LRU order is no longer the fill order
    for way in reversed(range(tb.ways)):
        await tb.op(TOUCH, frame=way)
    # all ways dirty: every insert evicts a dirty LRU way
    for k in range(tb.ways, tb.ways + 2):
        await tb.op(LOOKUP, page=k * sets)
        await tb.op(INSERT, page=k * sets)
    # every way pinned: lookup and insert have no frame to offer
    for way in range(tb.ways):
        await tb.op(PIN, frame=way)
    r = await tb.op(INSERT, page=(tb.ways + 5) * sets)
    check("insert with every way pinned fails", r["ok"], 0)
    await tb.op(LOOKUP, page=(tb.ways + 5) * sets)
    await tb.op(INVALIDATE, frame=1)  # pinned: refused
    # unpin one way: it becomes the only victim
    await tb.op(UNPIN, frame=tb.ways - 1)
    await tb.op(INSERT, page=(tb.ways + 6) * sets)
    for way in range(tb.ways - 1):
        await tb.op(UNPIN, frame=way)
    await tb.op(UNPIN, frame=0)  # not pinned: refused
    # pin counter to its limit and one past
    for _ in range(tb.pin_max + 1):
        await tb.op(PIN, frame=2 % tb.ways)
    for _ in range(tb.pin_max + 1):
        await tb.op(UNPIN, frame=2 % tb.ways)
    # empty frames refuse frame ops; a freed way is reused lowest-first
    await tb.op(INVALIDATE, frame=1)
    await tb.op(INVALIDATE, frame=0)
    for op in (TOUCH, MARK_DIRTY, CLEAR_DIRTY, INVALIDATE, PIN, UNPIN):
        await tb.op(op, frame=0)
    await tb.op(LOOKUP, page=(tb.ways + 7) * sets)
    await tb.op(INSERT, page=(tb.ways + 7) * sets)
    await tb.op(INSERT, page=(tb.ways + 8) * sets)
    # highest page address, and a set other than 0
    top = (1 << tb.addr_w) - 1
    await tb.op(INSERT, page=top)
    await tb.op(LOOKUP, page=top)
    check("pages tracked", len(ref), sum(p is not None for p in ref.page_of))


async def trace_ops(tb: TB, requests: int) -> None:
    """The controller's read path over a cut of the Mooncake trace: each KV block
    (hash id) is a page; pages go in chunks (as the controller's CHUNK_PAGES):
    lookup-or-insert and pin each page of the chunk, then unpin them; the
    request's last block is new (written), so it is marked dirty."""
    chunk = max(1, tb.ways // 2)
    for req in trace_requests(requests):
        pages = req["hash_ids"]
        for first in range(0, len(pages), chunk):
            frames = []
            for page in pages[first: first + chunk]:
                r = await tb.op(INSERT, page=page % (1 << tb.addr_w))
                if r["ok"]:
                    await tb.op(PIN, frame=r["frame"])
                    frames.append(r["frame"])
            if frames and first + chunk >= len(pages):
                await tb.op(MARK_DIRTY, frame=frames[-1])
            for frame in frames:
                await tb.op(UNPIN, frame=frame)


# ---- tests ------------------------------------------------------------------------------

@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_random(dut, stall):
    tb = TB(dut, stall, seed=11)
    await start(dut)
    await random_ops(tb, 1500, seed=5)
    dut._log.info("decisions reached: %s", tb.seen)
    tb.covered("hit", "miss_free", "evict_clean", "evict_dirty", "refused")


@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_corners(dut, stall):
    tb = TB(dut, stall, seed=21)
    await start(dut)
    await corner_ops(tb)
    dut._log.info("decisions reached: %s", tb.seen)
    tb.covered("hit", "miss_free", "evict_dirty", "all_pinned", "refused")


@cocotb.test()
@cocotb.parametrize(stall=[False, True])
async def test_trace(dut, stall):
    tb = TB(dut, stall, seed=31)
    await start(dut)
    await trace_ops(tb, 40)
    dut._log.info("decisions reached: %s", tb.seen)
    tb.covered("hit", "miss_free", "evict_clean", "evict_dirty")
    check("trace mostly found a frame", tb.seen["all_pinned"] < tb.seen["evict_clean"], True, str(tb.seen))


@cocotb.test()
async def test_cycles(dut):
    """Cycles per operation, no idle or back-pressure: latency (accept to response)
    and initiation interval (accept to next accept, commands back to back)."""
    tb = TB(dut, stall=False)
    await start(dut)
    sets = tb.frames // tb.ways
    for k in range(tb.ways):
        await tb.op(INSERT, page=k * sets)
        await tb.op(MARK_DIRTY, frame=k)
    hit = await tb.op(LOOKUP, page=0)
    hit2 = await tb.op(LOOKUP, page=sets)
    miss = await tb.op(INSERT, page=tb.ways * sets)  # evicts a dirty way
    after = await tb.op(LOOKUP, page=0)
    check("eviction reported", (miss["hit"], miss["victim"], miss["victim_dirty"]), (0, 1, 1))
    write_cycles("chm_frame_table", {
        "lookup_hit_latency": hit["latency"],
        "lookup_interval": hit2["sent"] - hit["sent"],
        "insert_evict_latency": miss["latency"],
        "insert_evict_interval": after["sent"] - miss["sent"],
    })
