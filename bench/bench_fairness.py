"""Fairness of ``chm serve``: a 4 KiB reader next to a 512 MiB reader.

The victim (C, through libchm: bench_libchm.c's ``lat`` mode) times 4 KiB
reads alone, then with a second client beside it reading 512 MiB at a time
in a loop; rounds alternate (alone, beside, alone, ...) and the figures are
medians over rounds. The device serves large reads in pieces round-robin
with other clients (emulator/serve/server.py, CHUNK_BYTES), so beside the big
reader the victim waits for at most one piece, not a whole 512 MiB read
(before that change: p50 373 ms beside it, 7 us alone).

    python -m bench bench_fairness            (or: make bench)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_libchm import LIBCHM, HERE, _run_json, _Serve
from emulator.serve.server import CHUNK_BYTES

BIG_READ = 512 << 20

# The big reader: libchm's Python binding, zero-copy reads of BIG_READ bytes into its staging buffer
# until SIGTERM; prints "go" once its first read is done, then how many it did.
AGGRESSOR = """
import json, signal, sys, time
from libchm import Device
size = int(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
with Device(sys.argv[1], staging_bytes=size) as dev:
    buf = dev.buffer()[:size]
    dev.read_into(0, buf)
    print("go", flush=True)
    n, t0 = 0, time.monotonic()
    while not stop:
        dev.read_into(0, buf)
        n += 1
    print(json.dumps({"reads": n, "seconds": time.monotonic() - t0}), flush=True)
"""


def _victim(exe: Path, node: str, iters: int) -> dict:
    return next(r for r in _run_json([str(exe), "lat", node, str(iters)]) if r["what"] == "libchm_read_4k")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_fairness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each case (default 5)")
    parser.add_argument("--iters", type=int, default=2000, help="victim reads per round (default 2000)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.iters < 200:
        parser.error("--rounds >= 1, --iters >= 200")

    subprocess.run(["make", "-s", "-C", str(LIBCHM)], check=True)
    work = Path(tempfile.mkdtemp(prefix="chm-bench-", dir="/var/tmp"))
    alone, beside, big_gbps = [], [], []
    try:
        exe = work / "bench_libchm"
        subprocess.run(["cc", "-O2", "-Wall", str(HERE / "bench_libchm.c"), "-o", str(exe), f"-I{LIBCHM / 'include'}",
                        f"-L{LIBCHM / 'build'}", f"-Wl,-rpath,{LIBCHM / 'build'}", "-lchm"], check=True)
        node = f"chm-bench-fair-{os.getpid()}"
        serve = _Serve(work / "media", node)  # profile small: 256 MiB of DRAM, so 512 MiB reads go to the SSDs
        try:
            for _ in range(args.rounds):
                alone.append(_victim(exe, node, args.iters))
                big = subprocess.Popen([sys.executable, "-c", AGGRESSOR, node, str(BIG_READ)], stdout=subprocess.PIPE,
                                       text=True, cwd=HERE.parent)
                try:
                    if big.stdout.readline().strip() != "go":
                        raise RuntimeError("the 512 MiB reader did not start")
                    beside.append(_victim(exe, node, args.iters))
                finally:
                    big.terminate()
                    out, _ = big.communicate(timeout=120)
                done = json.loads(out.strip().splitlines()[-1])
                if done["reads"]:
                    big_gbps.append(done["reads"] * BIG_READ / done["seconds"] / 1e9)
        finally:
            serve.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = lambda runs, key: statistics.median(r[key] for r in runs) / 1000  # noqa: E731
    print(f"4 KiB chm_read wall latency, {args.iters} reads x {args.rounds} interleaved rounds (medians over rounds)")
    print("                                         p50          p99")
    print(f"    alone                            {med(alone, 'p50_ns'):9.1f} us {med(alone, 'p99_ns'):9.1f} us")
    print(f"    beside a 512 MiB reader          {med(beside, 'p50_ns'):9.1f} us {med(beside, 'p99_ns'):9.1f} us")
    if big_gbps:
        gbps = statistics.median(big_gbps)
        # the bound: a small read waits for at most the one piece in service
        print(f"    the 512 MiB reader meanwhile: {gbps:.2f} GB/s (wall); one {CHUNK_BYTES >> 20} MiB piece at that "
              f"rate: {CHUNK_BYTES / gbps / 1000:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
