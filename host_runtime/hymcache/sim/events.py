"""The simulation's kernel: one heap of events in virtual time (nanoseconds, floats, as the emulator's).

A *process* is a generator. It yields

* a number: the virtual time (ns, >= now) at which it resumes;
* an ``Event``: it resumes when the event fires, with the event's value (at once if it fired already);

and its ``return`` value fires its ``Process.done`` event. ``yield from`` composes processes, so a tier's
load is a generator the worker's step runs inline. Ties resume in the order they were scheduled (a
sequence number), so a run is deterministic. Nothing sleeps: time jumps from event to event.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Generator

Proc = Generator[Any, Any, Any]


class Event:
    """Fires once, with a value; the processes waiting on it resume at the time it fires."""

    __slots__ = ("env", "waiters", "fired", "value")

    def __init__(self, env: "Env"):
        self.env, self.waiters, self.fired, self.value = env, [], False, None

    def succeed(self, value: Any = None) -> None:
        if self.fired:
            raise RuntimeError("event fired twice")
        self.fired, self.value = True, value
        for gen in self.waiters:
            self.env._push(self.env.now, gen, value)
        self.waiters = []


class Process:
    __slots__ = ("gen", "done")

    def __init__(self, env: "Env", gen: Proc):
        self.gen, self.done = gen, Event(env)


class Env:
    """The heap and the clock. ``run()`` resumes the earliest process until none is left (or ``until``)."""

    def __init__(self):
        self.now = 0.0
        self._heap: list[tuple[float, int, Any, Any]] = []
        self._seq = 0
        self._procs: dict[int, Process] = {}
        self.resumes = 0

    def _push(self, t: float, what, value=None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, what, value))

    def event(self) -> Event:
        return Event(self)

    def process(self, gen: Proc, at: float | None = None) -> Process:
        """Start ``gen`` at ``at`` (default: now)."""
        p = Process(self, gen)
        self._procs[id(gen)] = p
        self._push(self.now if at is None else at, gen, None)
        return p

    def call_at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at virtual time ``t`` (>= now)."""
        self._push(max(t, self.now), fn, None)

    def run(self, until: float = math.inf) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, what, value = pop(heap)
            if t < self.now:
                raise RuntimeError(f"event at {t} ns is before now ({self.now} ns)")
            self.now = t
            if not hasattr(what, "send"):  # a call_at callback
                what()
                continue
            self._resume(what, value)

    def _resume(self, gen: Proc, value) -> None:
        self.resumes += 1
        try:
            out = gen.send(value)
        except StopIteration as stop:
            p = self._procs.pop(id(gen), None)
            if p is not None:
                p.done.succeed(stop.value)
            return
        if isinstance(out, Event):
            if out.fired:
                self._push(self.now, gen, out.value)
            else:
                out.waiters.append(gen)
        else:
            t = float(out)
            if not t >= self.now:  # NaN fails too
                raise RuntimeError(f"a process yielded time {out!r} ns, before now ({self.now} ns)")
            self._push(t, gen, None)
