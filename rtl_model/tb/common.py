"""Pieces every bench shares: clock/reset, valid/ready stream drivers with
idle and back-pressure injection, lockstep checks, trace cuts, cycle tables.

Signals are sampled right after a rising edge, i.e. with the values they had
at the edge (cocotb's usual convention): ``valid and ready`` read then is the
beat that moved at that edge.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import cocotb
from cocotb.clock import Clock
from cocotb.queue import Queue
from cocotb.triggers import RisingEdge
from cocotb.utils import get_sim_time

from emulator.shared_data import mooncake_conversation_trace

CLOCK_NS = 10


class LockstepMismatch(AssertionError):
    """The RTL and the emulator's reference model decided differently."""


def check(what: str, got, expected, context: str = "") -> None:
    if got != expected:
        raise LockstepMismatch(f"lockstep mismatch: {what}: RTL {got!r}, reference {expected!r}" + (f" ({context})" if context else ""))


def params() -> dict:
    """The HDL parameters this simulation was built with (set by rtl_model.sim)."""
    return json.loads(os.environ["CHM_RTL_PARAMS"])


def as_int(sig) -> int | None:
    """A signal as an int, or None while it holds X/Z (e.g. before reset)."""
    v = sig.value
    return int(v) if v.is_resolvable else None


def cycle() -> int:
    return int(get_sim_time("ns")) // CLOCK_NS


def stall_pattern(enabled: bool, seed: int, probability: float = 0.3):
    """A callable answering 'stall this cycle?': idle on sources, back-pressure on sinks."""
    if not enabled:
        return lambda: False
    rng = random.Random(seed)
    return lambda: rng.random() < probability


async def start(dut) -> None:
    """Clock and a 3-cycle synchronous reset."""
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, unit="ns").start())
    dut.rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    await RisingEdge(dut.clk)


class StreamSource:
    """Drives ``<prefix>_valid`` and fields, waits for ``<prefix>_ready``."""

    def __init__(self, dut, prefix: str, fields: list[str], stall=None):
        self.clk = dut.clk
        self.valid = getattr(dut, f"{prefix}_valid")
        self.ready = getattr(dut, f"{prefix}_ready")
        self.fields = {name: getattr(dut, f"{prefix}_{name}") for name in fields}
        self.stall = stall or (lambda: False)
        self.valid.value = 0
        for sig in self.fields.values():
            sig.value = 0

    async def send(self, **values) -> int:
        """Send one beat; returns the cycle it moved."""
        while self.stall():  # idle injection: hold valid low for a cycle
            self.valid.value = 0
            await RisingEdge(self.clk)
        for name, value in values.items():
            self.fields[name].value = int(value)
        self.valid.value = 1
        while True:
            await RisingEdge(self.clk)
            if as_int(self.ready):
                break
        self.valid.value = 0
        return cycle()


class StreamSink:
    """Drives ``<prefix>_ready`` (with back-pressure) and queues the beats that move."""

    def __init__(self, dut, prefix: str, fields: list[str], stall=None):
        self.clk, self.rst = dut.clk, dut.rst
        self.valid = getattr(dut, f"{prefix}_valid")
        self.ready = getattr(dut, f"{prefix}_ready")
        self.fields = {name: getattr(dut, f"{prefix}_{name}") for name in fields}
        self.stall = stall or (lambda: False)
        self.queue: Queue = Queue()
        self.ready.value = 0
        cocotb.start_soon(self._run())

    async def _run(self) -> None:
        while True:
            self.ready.value = 0 if self.stall() else 1
            await RisingEdge(self.clk)
            if as_int(self.valid) and as_int(self.ready) and not as_int(self.rst):  # nothing moves in reset
                beat = {name: as_int(sig) for name, sig in self.fields.items()}
                beat["cycle"] = cycle()
                self.queue.put_nowait(beat)

    async def recv(self) -> dict:
        return await self.queue.get()

    def empty(self) -> bool:
        return self.queue.empty()


def trace_requests(count: int) -> list[dict]:
    """The first ``count`` requests of the Mooncake conversation trace (a cut at run time, not a sample)."""
    out = []
    with open(mooncake_conversation_trace()) as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) == count:
                break
    return out


def write_cycles(block: str, measured: dict) -> None:
    """Hand the measured cycle counts to the runner (rtl_model.sim reads the file)."""
    path = os.environ.get("CHM_CYCLES_OUT")
    if path:
        Path(path).write_text(json.dumps({"block": block, "params": params(), "cycles": measured}, indent=2))
