"""``Replay.run`` on the native request loop (native_replay.py): the workload fed to it phase by phase, or, for a
trace, in batches of arrays."""

from __future__ import annotations

import time


class NativeRun:
    """Replay's native path (a mixin of ``driver.Replay``)."""

    def _run_native(self, whole: bool = False, started: tuple[float, float] | None = None) -> dict:
        """``run`` on the native loop (native_replay.py). ``whole``: each phase fed whole before it runs (a trace
        out of time order: the first attempt stops at its first request out of order and this runs afresh, its
        wall and CPU time counted from ``started``, the first attempt's start)."""
        from .native_replay import NativeLoop, OutOfOrder

        wall0, cpu0 = started or (time.perf_counter(), time.process_time())
        now = self._populate(self.workload.populate_keys(), 0.0)
        t_start = now
        loop = self.native_loop = NativeLoop(self)
        loop.add_known(self.known)
        self.pbar = self._progress_bar(None)  # a streamed trace's length is known at its end
        try:
            now = self._feed_native(loop, now, whole)
        except OutOfOrder:
            if whole:
                raise RuntimeError("the native replay loop found a stream out of order in a phase fed whole")
            cfg, variant, workload, kwargs = self._init
            fresh = type(self)(cfg, variant, workload, **kwargs)
            result = fresh._run_native(whole=True, started=(wall0, cpu0))
            self.__dict__.update(fresh.__dict__)
            return result
        finally:
            self.pbar.close()
        loop.finish()
        return self._result(t_start, now, time.perf_counter() - wall0, time.process_time() - cpu0)

    def _feed_native(self, loop, now: float, whole: bool) -> float:
        """Every phase of the workload through the loop; the run's end."""
        lib, workload, pbar = loop.lib, self.workload, self.pbar
        more = lib.RP_FEED_HOLD if whole else lib.RP_FEED_MORE
        batches = getattr(workload, "native_batches", None)
        if batches is not None:  # a trace: one phase, in batches of arrays
            loop.phase_begin(now, "trace")
            for kind, args in batches(whole):  # the phase's end runs what is left
                if kind == "objects":
                    loop.feed_objects(*args, final=more)
                else:
                    loop.feed(*args, final=more)
                pbar.update(loop.blocks_done())
            now = loop.phase_end()
            pbar.update(loop.blocks_done())
            if hasattr(workload, "counted"):
                c = loop.counts()
                workload.counted(c.requests, c.objects, c.block_refs)
            return now
        for phase in workload.phases():
            loop.phase_begin(now, phase.label)
            loop.feed_phase(phase)
            now = loop.phase_end()
            pbar.update(loop.blocks_done())
        return now
