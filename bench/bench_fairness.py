"""Fairness of ``chm serve``: a 4 KiB reader next to a 512 MiB reader, and next to a client staging objects.

The victim (C, through libchm: bench_libchm.c's ``lat`` mode) times 4 KiB
reads alone, then with a second client beside it reading 512 MiB at a time
in a loop, then beside one that stages 16 MiB objects from the SSDs
(prefetch, wait, release) in a loop; rounds alternate (alone, beside the
reader, beside the stager, alone, ...) and the figures are medians over
rounds. The device serves large reads in pieces round-robin with other
clients (emulator/serve/fairness.py, CHUNK_BYTES), so beside the big reader the
victim waits for at most one piece, not a whole 512 MiB read (before that
change: p50 373 ms beside it, 7 us alone); and it parks a wait whose SSD
reads are in flight, so beside the stager it waits for none of them (before
that change: up to a whole staging, ~12 ms at p99).

Then the device's wall-clock checks (moved here from tests/emulator/serve, whose tests assert the same
behaviour without wall time): an idle device sleeps (CPU), stays awake a while after a staged wait, holds
paced completions to their modelled time, and answers others, and looks at a prefetch, well within a slow
disk's delay while a wait waits for it.

    python -m bench bench_fairness            (or: make bench)
    python -m bench.bench_fairness --checks-only

Results: ``bench/results/bench_fairness.json`` and ``.md``.
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
import time
from pathlib import Path

from bench import result_files
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


# The stager: writes one STAGED_OBJECT-byte object past the device's DRAM (flushed to the SSDs), then prefetches,
# waits for and releases it in a loop (hymcache drops a staged copy on release, so every prefetch reads the SSDs
# again); "go" once the first is done.
STAGED_OBJECT = 16 << 20
STAGER = """
import json, os, signal, sys, time
from libchm import Device
size, at = int(sys.argv[2]), int(sys.argv[3])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
with Device(sys.argv[1], staging_bytes=1 << 20) as dev:
    for off in range(0, size, 1 << 20):
        dev.write(at + off, os.urandom(1 << 20))
    dev.flush()
    def stage():
        h = dev.prefetch(at, size)
        dev.wait(h)
        dev.release(h)
    stage()
    print("go", flush=True)
    n, t0 = 0, time.monotonic()
    while not stop:
        stage()
        n += 1
    print(json.dumps({"reads": n, "seconds": time.monotonic() - t0}), flush=True)
"""


def _beside(exe: Path, node: str, iters: int, script: str, *args: str) -> tuple[dict, float | None]:
    """The victim's round while ``script`` runs in another process; and that process's GB/s meanwhile."""
    other = subprocess.Popen([sys.executable, "-c", script, node, *args], stdout=subprocess.PIPE, text=True,
                             cwd=HERE.parent)
    try:
        if other.stdout.readline().strip() != "go":
            raise RuntimeError("the other client did not start")
        got = _victim(exe, node, iters)
    finally:
        other.terminate()
        out, _ = other.communicate(timeout=120)
    done = json.loads(out.strip().splitlines()[-1])
    return got, (done["reads"] * int(args[0]) / done["seconds"] / 1e9 if done["reads"] else None)


def _victim(exe: Path, node: str, iters: int) -> dict:
    return next(r for r in _run_json([str(exe), "lat", node, str(iters)]) if r["what"] == "libchm_read_4k")


# ---- wall-clock checks (from tests/emulator/serve: test_server.py, test_fairness.py) -------------------------------

SLOW_DISK_S = 1.0  # every media read completes this long after it is submitted (test-only fault)
MiB = 1 << 20


def _first_sleep_after_s(node_path, limit_s: float = 0.05) -> float:
    """Seconds until the device's server_sleeping flag first reads 1 (sampled in a tight loop)."""
    import mmap
    import struct

    from driver.wire import ffi

    offset = ffi.offsetof("struct chm_node", "server_sleeping")
    fd = os.open(node_path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, ffi.sizeof("struct chm_node"), prot=mmap.PROT_READ) as m:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < limit_s:
                if struct.unpack_from("<I", m, offset)[0]:
                    return time.perf_counter() - t0
    finally:
        os.close(fd)
    return limit_s


def check_idle_cpu(srv) -> str | None:
    """An idle device uses under 2% of a CPU (it sleeps in poll(), no tick)."""
    def cpu_seconds() -> float:
        fields = open(f"/proc/{srv.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(0.3)  # the behaviour measured: the device idles over wall time
    before, t0 = cpu_seconds(), time.monotonic()
    time.sleep(1.5)
    used = cpu_seconds() - before
    if used >= 0.02 * (time.monotonic() - t0):
        return f"idle chm serve used {used:.3f} s of CPU"
    return None


def check_staged_spin(srv) -> str | None:
    """After answering a staged wait the device spins STAGED_SPIN_NS (0.5 ms), not spin_us (50 us), before it
    sleeps; after a read it sleeps as usual. One wait of seven must show the longer spin (a checker that loses
    its core starts sampling late; a device that shares its core yields its spin early, by design)."""
    import libchm

    with libchm.Device(srv.path, staging_bytes=1 << 20) as dev:
        dev.write(0, b"x" * 4096)
        after_wait, after_read = [], []
        for _ in range(7):
            h = dev.prefetch(0, 4096)
            dev.wait(h, timeout_ms=10_000)
            after_wait.append(_first_sleep_after_s(srv.path))
            dev.read(0, 4096)
            after_read.append(_first_sleep_after_s(srv.path))
            dev.release(h)
    if min(after_read) >= 0.05:
        return f"the device never slept within 50 ms of a read: {after_read}"
    if max(after_wait) < 0.3e-3:
        return f"the device slept {[f'{t * 1e6:.0f}' for t in sorted(after_wait)]} us after staged waits"
    return None


def check_pacing(work: Path) -> str | None:
    """With --pace, a wait on a staging of 0.3 s modelled read latency is answered no earlier than 0.3 s of
    wall time later (a lower bound: load can only make it later)."""
    from driver.wire import lib
    from tests.driver.rawclient import RawClient
    from tests.emulator.serve.serving import Server

    with Server(work / "pace-media", None, "--pace", "--set", "ssd.read_latency_ns=3e8") as srv:
        c = RawClient(srv.node)
        t0 = time.monotonic()
        c.push(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=65536)
        (_, handle), = c.reap(1)
        c.push(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1)
        c.reap(1)
        took = time.monotonic() - t0
        c.close()
    return None if took >= 0.3 else f"a paced wait of 0.3 s modelled time was answered after {took:.3f} s"


def check_slow_disk(work: Path) -> list[str]:
    """Beside a wait parked on a slow disk, another client's DRAM hit and a look at a prefetch are answered
    within half the disk's delay; the wait and the look's 0 come after 0.9 of it (the fault did hold them)."""
    import errno

    from driver.wire import lib
    from tests.driver.rawclient import RawClient
    from tests.emulator.serve.serving import Server

    failed = []
    with Server(work / "slow-media", None, "--policy", "lru", "--set",
                f"faults.read_delay_ms={SLOW_DISK_S * 1e3:g}") as srv:
        page = 65536
        waiter, other = RawClient(srv.node, staging=MiB), RawClient(srv.node, staging=MiB)
        other.staging[:page] = bytes(page)
        other.push(user_data=1, opcode=lib.CHM_OP_WRITE, addr=64 * MiB, len=page, buf_offset=0)
        other.reap(1)
        waiter.push(user_data=1, opcode=lib.CHM_OP_PREFETCH, addr=0, len=MiB)
        ((_, handle),) = waiter.reap(1)
        t0 = time.monotonic()
        waiter.push(user_data=2, opcode=lib.CHM_OP_WAIT, handle=handle, timeout_ns=-1)
        while not other.stats_json().get("parked_waits"):
            if time.monotonic() - t0 > SLOW_DISK_S / 2:
                failed.append("the wait was not parked within half the slow disk's delay")
                break
        t1 = time.monotonic()
        other.push(user_data=2, opcode=lib.CHM_OP_READ, addr=64 * MiB, len=page, buf_offset=MiB // 2)
        other.reap(1, timeout=30)
        if time.monotonic() - t1 >= SLOW_DISK_S / 2:
            failed.append(f"a DRAM hit beside a parked wait took {time.monotonic() - t1:.3f} s")
        waiter.reap(1, timeout=30)
        if time.monotonic() - t0 < SLOW_DISK_S * 0.9:
            failed.append(f"the slow disk's wait was answered after {time.monotonic() - t0:.3f} s")
        waiter.push(user_data=3, opcode=lib.CHM_OP_PREFETCH, addr=4 * MiB, len=MiB)
        ((_, handle),) = waiter.reap(1)
        t0 = time.monotonic()
        waiter.push(user_data=4, opcode=lib.CHM_OP_WAIT, flags=lib.CHM_WAIT_LOOK, handle=handle, timeout_ns=-1)
        (_, res), = waiter.reap(1, timeout=30)
        if res != -errno.EAGAIN or time.monotonic() - t0 >= SLOW_DISK_S / 2:
            failed.append(f"a look answered {res} after {time.monotonic() - t0:.3f} s")
        while res == -errno.EAGAIN and time.monotonic() - t0 < 30:
            waiter.push(user_data=5, opcode=lib.CHM_OP_WAIT, flags=lib.CHM_WAIT_LOOK, handle=handle, timeout_ns=-1)
            (_, res), = waiter.reap(1)
        if res != 0 or time.monotonic() - t0 < SLOW_DISK_S * 0.9:
            failed.append(f"a look answered {res} after {time.monotonic() - t0:.3f} s of a slow disk")
        waiter.close()
        other.close()
    return failed


def wall_clock_checks(work: Path) -> list[str]:
    """Each check that failed, as a line."""
    from tests.emulator.serve.serving import Server

    with Server(work / "media-checks") as srv:
        failed = [why for why in (check_idle_cpu(srv), check_staged_spin(srv)) if why]
    return failed + [why for why in [check_pacing(work)] if why] + check_slow_disk(work)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_fairness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each case (default 5)")
    parser.add_argument("--iters", type=int, default=2000, help="victim reads per round (default 2000)")
    parser.add_argument("--checks-only", action="store_true", help="only the wall-clock checks")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.iters < 200:
        parser.error("--rounds >= 1, --iters >= 200")
    if args.checks_only:
        return _report_checks()

    subprocess.run(["make", "-s", "-C", str(LIBCHM)], check=True)
    work = Path(tempfile.mkdtemp(prefix="chm-bench-", dir="/var/tmp"))
    alone, beside, big_gbps, beside_stager, stager_gbps = [], [], [], [], []
    try:
        exe = work / "bench_libchm"
        subprocess.run(["cc", "-O2", "-Wall", str(HERE / "bench_libchm.c"), "-o", str(exe), f"-I{LIBCHM / 'include'}",
                        f"-L{LIBCHM / 'build'}", f"-Wl,-rpath,{LIBCHM / 'build'}", "-lchm"], check=True)
        node = f"chm-bench-fair-{os.getpid()}"
        serve = _Serve(work / "media", node)  # profile small: 256 MiB of DRAM, so 512 MiB reads go to the SSDs
        try:
            for _ in range(args.rounds):
                alone.append(_victim(exe, node, args.iters))
                for runs, rates, script, *script_args in (
                        (beside, big_gbps, AGGRESSOR, str(BIG_READ)),
                        (beside_stager, stager_gbps, STAGER, str(STAGED_OBJECT), str(1 << 30))):
                    got, gbps = _beside(exe, node, args.iters, script, *script_args)
                    runs.append(got)
                    if gbps is not None:
                        rates.append(gbps)
        finally:
            serve.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = lambda runs, key: statistics.median(r[key] for r in runs) / 1000  # noqa: E731
    print(f"4 KiB chm_read wall latency, {args.iters} reads x {args.rounds} interleaved rounds (medians over rounds)")
    print("                                         p50          p99")
    print(f"    alone                            {med(alone, 'p50_ns'):9.1f} us {med(alone, 'p99_ns'):9.1f} us")
    print(f"    beside a 512 MiB reader          {med(beside, 'p50_ns'):9.1f} us {med(beside, 'p99_ns'):9.1f} us")
    print(f"    beside a {STAGED_OBJECT >> 20} MiB stager            {med(beside_stager, 'p50_ns'):9.1f} us "
          f"{med(beside_stager, 'p99_ns'):9.1f} us")
    if big_gbps:
        gbps = statistics.median(big_gbps)
        # the bound: a small read waits for at most the one piece in service
        print(f"    the 512 MiB reader meanwhile: {gbps:.2f} GB/s (wall); one {CHUNK_BYTES >> 20} MiB piece at that "
              f"rate: {CHUNK_BYTES / gbps / 1000:.1f} us")
    if stager_gbps:
        gbps = statistics.median(stager_gbps)
        print(f"    the stager meanwhile: {gbps:.2f} GB/s (wall); one whole staging at that rate: "
              f"{STAGED_OBJECT / gbps / 1000:.1f} us (what a wait in the device's thread would hold the victim up)")
    p50_p99 = lambda runs: f"{med(runs, 'p50_ns'):.1f} / {med(runs, 'p99_ns'):.1f} µs"  # noqa: E731
    big, stager = (statistics.median(r) if r else None for r in (big_gbps, stager_gbps))
    rows = [(f"4 KiB read beside a {BIG_READ >> 20} MiB reader, p50 / p99", p50_p99(beside),
             f"alone {p50_p99(alone)}" + ("" if big is None else
                                          f"; one {CHUNK_BYTES >> 20} MiB piece at the reader's {big:.2f} GB/s: "
                                          f"{CHUNK_BYTES / big / 1000:.1f} µs"), "one piece"),
            (f"4 KiB read beside a client staging {STAGED_OBJECT >> 20} MiB objects from the SSDs, p50 / p99",
             p50_p99(beside_stager),
             f"alone {p50_p99(alone)}" + ("" if stager is None else
                                          f"; one whole staging at the stager's {stager:.2f} GB/s: "
                                          f"{STAGED_OBJECT / stager / 1e6:.1f} ms"), "none of it")]
    result_files.write("bench_fairness", rows, {
        "alone": alone, "beside_reader": beside, "beside_stager": beside_stager, "reader_gbps": big_gbps,
        "stager_gbps": stager_gbps, "rounds": args.rounds, "iters": args.iters}, argv)
    return _report_checks()


def _report_checks() -> int:
    work = Path(tempfile.mkdtemp(prefix="chm-bench-checks-", dir="/var/tmp"))
    try:
        failed = wall_clock_checks(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("wall-clock checks: " + ("ok" if not failed else "FAILED\n    " + "\n    ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
