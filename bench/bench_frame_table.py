"""The frame table alone on the Mooncake access sequence, beside libCacheSim.

Every hash id of every request of the shared trace, in file order, is one access to one 2 MiB page; a
fully associative table of N frames (the replay oracle's setting, tests/host_runtime/test_replay_oracle.py).
Rows: the native core's batch call (``access_many``: the whole sequence in one call into C), one call per
access (``lookup_or_insert``), the controller's three calls per access (``lookup``, ``touch``/``insert``),
an LRU written in Python as a plug-in (the slower path), and the peer, libCacheSim's ``process_trace``
(LRU, its own oracleGeneral reader) on the same accesses. Each row checks its miss count against the
peer's. Best of three runs.

Results: ``bench/results/bench_frame_table.json`` and ``.md``.
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
import time
from array import array
from collections import OrderedDict
from itertools import filterfalse
from pathlib import Path

from bench import result_files
from emulator.frame_table import EvictionPolicy, FrameTable
from emulator.policies import policy_class
from emulator.shared_data import mooncake_conversation_trace

FRAMES = 4096
RUNS = 3
POLICIES = ("lru", "fifo", "clock", "sieve", "s3fifo")
ORACLE_GENERAL = struct.Struct("<IQIq")  # libCacheSim's oracleGeneral record: time, id, size, next access


class PythonLru(EvictionPolicy):
    """LRU as a plug-in would write it (docs/policies.md, "Write your own policy")."""

    def __init__(self, capacity, params=None):
        super().__init__(capacity)
        self.order = OrderedDict()

    def find(self, page, update=True):
        if update and page in self.order:
            self.order.move_to_end(page)
        return page in self.order

    def insert(self, page):
        self.order[page] = None

    def evict(self, pinned, incoming=None):
        victim = next(filterfalse(pinned, self.order))
        del self.order[victim]
        return victim

    def remove(self, page):
        del self.order[page]


def best(run) -> tuple[float, int]:
    """(seconds, misses) of the fastest of RUNS runs of ``run() -> misses``."""
    results = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        misses = run()
        results.append((time.perf_counter() - t0, misses))
    return min(results)


def per_call(table: FrameTable, pages) -> int:
    lookup, touch, insert, misses = table.lookup, table.touch, table.insert, 0
    for page in pages:
        frame = lookup(page)
        if frame is None:
            misses += 1
            insert(page)
        else:
            touch(frame)
    return misses


def one_call(table: FrameTable, pages) -> int:
    access = table.lookup_or_insert
    return sum(not access(page).hit for page in pages)


def main(argv: list[str] | None = None) -> int:
    with mooncake_conversation_trace().open() as f:
        ids = [h for line in f if line.strip() for h in json.loads(line)["hash_ids"]]
    pages = array("Q", ids)
    n = len(ids)
    print(f"Mooncake conversation trace: {n} accesses (one 2 MiB page per hash id), {FRAMES} frames, "
          f"fully associative; best of {RUNS}")
    rows: list[tuple[str, float, int]] = []
    try:
        import libcachesim as lcs
    except ImportError:
        lcs = None
    if lcs is not None:
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "mooncake.oracleGeneral"
            trace.write_bytes(b"".join(ORACLE_GENERAL.pack(i, h, 1, -1) for i, h in enumerate(ids)))

            def process_trace():
                reader = lcs.TraceReader(str(trace), lcs.TraceType.ORACLE_GENERAL_TRACE)
                return round(lcs.LRU(FRAMES).process_trace(reader)[0] * n)

            rows.append(("peer: libCacheSim LRU process_trace", *best(process_trace)))
    lru = policy_class("lru").eviction
    rows.append(("lru, access_many (one C call)", *best(lambda: FrameTable(FRAMES, eviction=lru).access_many(pages).misses)))
    rows.append(("lru, lookup_or_insert per access", *best(lambda: one_call(FrameTable(FRAMES, eviction=lru), ids))))
    rows.append(("lru, lookup + touch/insert per access", *best(lambda: per_call(FrameTable(FRAMES, eviction=lru), ids))))
    rows.append(("lru as a Python plug-in, per access", *best(lambda: per_call(FrameTable(FRAMES, eviction=PythonLru), ids))))
    for name in POLICIES[1:]:
        order = policy_class(name).eviction
        rows.append((f"{name}, access_many", *best(lambda: FrameTable(FRAMES, eviction=order).access_many(pages).misses)))
    peer = rows[0][1] if lcs is not None else None
    print(f"  {'':<40} {'M acc/s':>8} {'x peer':>7} {'misses':>8}")
    for label, seconds, misses in rows:
        ratio = f"{peer / seconds:7.2f}" if peer else "      -"
        print(f"  {label:<40} {n / seconds / 1e6:8.2f} {ratio} {misses:>8}")
    result_files.write("bench_frame_table", [
        (label, f"{n / seconds / 1e6:.2f}", f"{peer / seconds:.2f}" if peer else "-", str(misses))
        for label, seconds, misses in rows],
        {"accesses": n, "frames": FRAMES, "runs": RUNS,
         "rows": [{"what": label, "seconds": seconds, "misses": misses} for label, seconds, misses in rows]},
        columns=("frame table", "M accesses/s", "× libCacheSim process_trace (LRU)", "misses"))
    lru_misses = {misses for label, _, misses in rows if label.startswith(("peer", "lru"))}
    if len(lru_misses) != 1:
        print(f"  LRU miss counts differ: {sorted(lru_misses)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
