"""The controller's sequential operations (controller.py's docstring, "Native sequential path"): a list of
reads and written-and-flushed writes run one after another, in C while the device is settled, else through
the calls. Methods of Controller.
"""

from __future__ import annotations

from array import array

from .native import ffi, lib
from .native_paths import NATIVE_SEQ_COUNTS, _ZERO_SEQ_COUNTS, _fold_counts, _policy_runs_sequentially
from .outcomes import SequentialOutcome, _tuple_new

SEQ_READ, SEQ_WRITE = lib.CHM_SEQ_READ, lib.CHM_SEQ_WRITE
_SEQ_KINDS = {"read": SEQ_READ, "write": SEQ_WRITE, SEQ_READ: SEQ_READ, SEQ_WRITE: SEQ_WRITE}
_SEQ_BAD_KIND = 255  # the native path stops there; the Python step says why
_run_sequential = lib.chm_dev_run_sequential


def sequential_ops(ops) -> tuple[bytes, array, array]:
    """``(kind, addr, length)`` operations (kind ``"read"`` or ``"write"``, as ``Replay.ops`` records them) as
    ``run_sequential``'s three arrays."""
    kinds = bytes(_SEQ_KINDS.get(kind, _SEQ_BAD_KIND) for kind, _, _ in ops)
    return kinds, array("Q", [addr for _, addr, _ in ops]), array("Q", [length for _, _, length in ops])


def _seq_buffer(values, fmt: str):
    """``values`` as a C-contiguous buffer of ``fmt`` items (kept, or converted); None when they are not all
    plain non-negative integers that fit (the Python calls then say what is wrong)."""
    try:
        view = memoryview(values)
    except TypeError:
        view = None
    if view is not None and view.c_contiguous and view.ndim == 1 and view.itemsize == array(fmt).itemsize \
            and view.format.lstrip("<=@") in ((fmt,) if fmt == "B" else (fmt, "L")):
        return view  # unsigned: used in place
    if fmt == "B":
        return bytes(_SEQ_KINDS.get(kind, _SEQ_BAD_KIND) for kind in values)
    values = view.tolist() if view is not None else values
    if any(type(v) is not int for v in values):  # a bool or a float: check_range names it
        return None
    try:
        return array(fmt, values)
    except OverflowError:  # a negative one
        return None


class SequentialOps:
    """``run_sequential`` and what it needs (a Controller mixin)."""

    def run_sequential(self, kinds, addrs, lengths, now: float = 0.0) -> SequentialOutcome:
        """Run operations one after another (module docstring, "Native sequential path"): operation ``i`` is
        a read (``kinds[i]`` ``"read"`` or ``SEQ_READ``) or a write and its flush (``"write"``, ``SEQ_WRITE``)
        of ``lengths[i]`` bytes at ``addrs[i]``, starting when the one before finished (the first at ``now``).
        The device ends as ``read``/``write``/``flush`` called in turn leave it; an operation they refuse
        raises their error, with the ones before it done. ``sequential_ops`` makes the arrays from
        ``(kind, addr, length)`` triples; buffers (``bytes``, ``array('Q')``) are used in place."""
        n = len(kinds)
        if len(addrs) != n or len(lengths) != n:
            raise ValueError(f"{n} kinds, {len(addrs)} addresses and {len(lengths)} lengths: one of each per operation")
        buffers = None
        if self.native_sequential_problem() is None:
            buffers = (_seq_buffer(kinds, "B"), _seq_buffer(addrs, "Q"), _seq_buffer(lengths, "Q"))
            if None in buffers:
                buffers = None
        pointers = None
        i, write_misses, native_ops = 0, 0, 0
        try:
            if buffers is not None:
                pointers = (ffi.from_buffer("uint8_t[]", buffers[0]), ffi.from_buffer("uint64_t[]", buffers[1]),
                            ffi.from_buffer("uint64_t[]", buffers[2]))
            while i < n:
                if pointers is not None and self._settled():
                    kinds_p, addrs_p, lengths_p = pointers
                    result = self._seq_result
                    rc = _run_sequential(self.native_dev, kinds_p + i, addrs_p + i, lengths_p + i, n - i, now, result)
                    self._fold_sequential(result)
                    i += result.done
                    native_ops += result.done
                    write_misses += result.write_misses
                    now = result.now
                    if rc == lib.CHM_E_NOMEM:
                        raise MemoryError(f"sequential operation #{i}: no memory for the native path's state")
                    if rc not in (lib.CHM_OK, lib.CHM_E_ARG):  # CHM_E_INTERNAL: a frame could not be had
                        raise RuntimeError(f"sequential operation #{i}: native status {rc} (every frame pinned)")
                    if i == n:
                        break
                    # CHM_E_ARG: the device refuses operation i; its call below raises why
                now, misses = self._sequential_step(kinds[i], addrs[i], lengths[i], now)
                write_misses += misses
                i += 1
        finally:
            for pointer in pointers or ():
                ffi.release(pointer)
        return _tuple_new(SequentialOutcome, (now, write_misses, native_ops))

    def _sequential_step(self, kind, addr: int, length: int, now: float) -> tuple[float, int]:
        """One operation of ``run_sequential`` through the calls: (its finish, its write misses)."""
        kind = _SEQ_KINDS.get(kind, kind)
        if kind == SEQ_READ:
            return self.read(addr, length, now).finish, 0
        if kind == SEQ_WRITE:
            written = self.write(addr, None, length, now)
            return self.flush(written.finish), written.new_pages
        raise ValueError(f"operation kind {kind!r} is neither 'read' nor 'write'")

    def native_sequential_problem(self) -> str | None:
        """Why ``run_sequential`` cannot use the native path on this device at all (None: it can, whenever
        the device is settled)."""
        if (problem := self._native_parts_problem()) is not None:
            return problem
        if not self.native_read or not _policy_runs_sequentially(self.policy):
            return f"policy {self.policy.name!r} is not a built-in frame-table cache without a write buffer"
        # the controller's own read and write: those of the class built on this mixin (a subclass may have others)
        own = next(c for c in type(self).__mro__ if SequentialOps in c.__bases__)
        if type(self).read is not own.read or type(self).write is not own.write \
                or {"read", "write"} & vars(self).keys():
            return "read or write is not the controller's own"
        if self.flush != self.flusher.flush or self.tick != self.flusher.tick:
            return "flush or tick is not the flusher's own"
        return None

    def _settled(self) -> bool:
        """Nothing dirty or in flight, no frame pinned, no prefetch held, no media or staging-read error:
        the state the native sequential path starts from (and leaves after each operation)."""
        flusher = self.flusher
        return (flusher.pending() == (0, 0) and not self.read_error and flusher.media_error is None
                and not self.staged and self.engine.pages_held == 0
                and lib.chm_ft_pinned_ways(self.policy.read_area.table._c, 0) == 0)

    def _fold_sequential(self, result) -> None:
        """Add what a native sequential run counted to ``stats`` and the flusher."""
        self.fold_native_counts()
        _fold_counts(self._stats, self._seq_counts, NATIVE_SEQ_COUNTS, _ZERO_SEQ_COUNTS)
        if self.flusher.dev is None:  # else the native flusher counted them
            self.flusher._flight_order += result.flush_writes
