"""The replay's native index (NativeMaster, hymcache/native/) against the Python Master it matches call for call:
requests per second of replay's calls for a request of 32 blocks (lookup, put_start of the rest, put_end), many
requests on one device. Bound: the native index is faster (moved here from tests/: a wall-clock comparison).

    python -m bench bench_native_master
"""

from __future__ import annotations

import random
import sys
import time

from bench import result_files
from host_runtime.hymcache.clock import ManualClock
from host_runtime.hymcache.master import Master
from host_runtime.hymcache.messages import DeviceInfo
from host_runtime.hymcache.native_master import NativeMaster

KiB = 1024
REQUESTS = 1500
BLOCKS = 32                 # per request
BLOCK_BYTES = 64 * KiB
KEYS = 8000                 # a request's first block: one of these, its 31 successors after it


def key_of(i: int) -> bytes:
    """Replay's master_key; every other key past 64 bits (libCacheSim's obj_id << 24 | block reaches 2^88)."""
    return (i if i % 2 else i << 70 | i).to_bytes(16, "little")


def requests_per_second(cls) -> float:
    clock = ManualClock()
    m = cls(clock)
    m.register_node(0, "speed", [DeviceInfo(0, "speed", 4096 * BLOCK_BYTES, 0)])
    rng = random.Random(3)
    t0 = time.perf_counter()
    for r in range(REQUESTS):
        clock.t += 0.001
        base = rng.randrange(KEYS)
        keys = [key_of(base + j) for j in range(BLOCKS)]
        rest = keys[len(m.lookup(keys)):]
        if rest:
            locs = m.put_start(f"r{r}", rest, [BLOCK_BYTES] * len(rest))
            written = [loc.key for loc in locs if loc is not None]
            if written:
                m.put_end(written, [0] * len(written))
    return REQUESTS / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    rates = {cls.__name__: requests_per_second(cls) for cls in (Master, NativeMaster)}
    ratio = rates["NativeMaster"] / rates["Master"]
    print(f"requests of {BLOCKS} blocks per second: Master {rates['Master']:.0f}, NativeMaster "
          f"{rates['NativeMaster']:.0f} ({ratio:.1f}x; bound: > 1)")
    result_files.write("bench_native_master", [(name, f"{rate:.0f}") for name, rate in rates.items()],
                       {"requests": REQUESTS, "blocks_per_request": BLOCKS, "requests_per_s": rates, "ratio": ratio},
                       argv, columns=("index", "requests/s"))
    return 0 if ratio > 1 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
