"""The child process that reads a trace with libCacheSim's own reader (see lcs_trace.py for why a child).

Argument: one JSON object {"path", "trace_type" (a libcachesim.TraceType member name), "params"
(ReaderInitParam attribute -> value), "ignore_obj_size", "limit" (or null)}. Output on stdout: the request
count as a little-endian uint64, then the clock times (int64), object ids (uint64) and object sizes (int64)
of every request, each as one array in machine byte order. libCacheSim's log lines stay on stderr.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array


def open_reader(spec: dict):
    """libcachesim's TraceReader of one spec (the module docstring's JSON object)."""
    import libcachesim as lcs

    params = lcs.ReaderInitParam(ignore_obj_size=spec["ignore_obj_size"])
    for attr, value in spec["params"].items():
        setattr(params, attr, value)
    if spec["limit"] is not None:
        params.cap_at_n_req = spec["limit"]
    return lcs.TraceReader(spec["path"], getattr(lcs.TraceType, spec["trace_type"]), params)


def main(argv: list[str]) -> int:
    times, obj_ids, sizes = array("q"), array("Q"), array("q")
    for req in open_reader(json.loads(argv[1])):
        times.append(req.clock_time)
        obj_ids.append(req.obj_id)
        sizes.append(req.obj_size)
    out = sys.stdout.buffer
    out.write(struct.pack("<Q", len(times)))
    for column in (times, obj_ids, sizes):
        out.write(column.tobytes())
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
