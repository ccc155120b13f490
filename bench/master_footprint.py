"""The Master's metadata footprint per entry: a Master filled with registered blocks, measured with tracemalloc
(Python objects and numpy buffers) beside its own count (``Master.metadata_bytes``). bench_hymcache's (b) reports
it; tests/host_runtime/hymcache/test_master.py checks that the two agree.

    python -m bench.master_footprint [ENTRIES]
"""

from __future__ import annotations

import json
import sys
import tracemalloc

from host_runtime.hymcache.checks import MAX_TIMEOUT_S, check
from host_runtime.hymcache.clock import ManualClock
from host_runtime.hymcache.master import ENTRY_DTYPE, Master
from host_runtime.hymcache.messages import KEY_BYTES, DeviceInfo

BATCH = 32  # keys per put, as a worker's request


def measure_bytes_per_entry(entries: int = 1 << 16, block_bytes: int = 16 << 20) -> dict:
    """Fill an in-memory Master with ``entries`` registered blocks and measure its memory per entry with
    tracemalloc (Python objects and numpy buffers), beside ``metadata_bytes()``'s count."""
    entries = check.int("entries", entries, 1, 1 << 24)
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        keys = [i.to_bytes(KEY_BYTES, "little") for i in range(entries)]
        base = tracemalloc.get_traced_memory()[0]
        master = Master(ManualClock(), put_timeout_s=MAX_TIMEOUT_S, high_watermark=1.0, low_watermark=1.0)
        master.register_node(0, "", [DeviceInfo(0, "", entries * block_bytes, 1)])
        for start in range(0, entries, BATCH):
            batch = keys[start:start + BATCH]
            master.put_start("measure", batch, [block_bytes] * len(batch))
            master.put_end(batch, [0] * len(batch))
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    counted = master.metadata_bytes()
    # the key objects existed before ``base`` (the caller's keys): add them, the index holds them
    traced += entries * sys.getsizeof(keys[0])
    return {"entries": entries, "entry_bytes": ENTRY_DTYPE.itemsize, "traced_bytes_per_entry": traced / entries,
            "counted_bytes_per_entry": counted["bytes_per_entry"], **counted}


if __name__ == "__main__":
    print(json.dumps(measure_bytes_per_entry(*map(int, sys.argv[1:2])), indent=1))
