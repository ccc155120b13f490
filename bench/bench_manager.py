"""The KV Manager's timings, each against its bound: the per-block cost of the two read paths
(``measure_block_paths``), and how long other callers wait while one block stages from a slow disk or the
Master hangs (the wall-clock halves of tests/host_runtime/hymcache/test_manager*.py, whose tests check the
same behaviour by its outcome).

    python -m bench bench_manager            (or: make bench)

Results: ``bench/results/bench_manager.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import errno
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import libchm
from bench import result_files
from driver.errors import ChmError
from host_runtime.hymcache.clock import ManualClock, WallClock
from host_runtime.hymcache.manager import KVManager, ManagerClient, ManagerOptions, node_path, start_manager
from host_runtime.hymcache.manager_state import check
from host_runtime.hymcache.messages import KEY_BYTES

SLOW_DISK_S = 1.0         # every media read of the slow device lands this long after it is submitted
OTHERS_WAIT_MAX_S = SLOW_DISK_S / 3   # bound: another caller's answer while a block stages
HUNG_MASTER_WAIT_MAX_S = 0.5          # bound: a call while the Master does not answer a confirmation
HELD_TIMEOUT_S = 0.3                  # a held acquire's own timeout: answered ETIMEDOUT in [0.25, 0.8 s)
PAGE = 64 << 10


def measure_block_paths(master, device_node: str, *, block_bytes: int = 16 << 20, repeat: int = 8,
                        manager_endpoint: str | None = None) -> dict:
    """Seconds per block (medians of ``repeat``, the contenders interleaved) for one stored block of
    ``block_bytes``, on the device's machine:

    * ``stage_s``: hint → acquire: the Manager prefetches the block from flash into device DRAM
      (the same for both paths);
    * ``local_s``: a worker on the device's machine reads the staged block with libchm ``read_into``
      its zero-copy staging buffer; ``local_checked_s`` adds the xxh3 checksum;
    * ``zmq_s``: a worker elsewhere gets it through the Manager over ZeroMQ (``read``: one call, the
      block a zero-copy frame); ``zmq_checked_s`` adds the checksum;
    * ``local_total_s`` / ``zmq_total_s``: the whole per-block cycle, hint → acquire → read (checked)
      → release → finish.

    ``master``: a Master in process (or a MasterClient). With ``manager_endpoint`` None a KVManager is
    served from a thread of this process on ``device_node``; else that running Manager is used. The
    block is stored through the Master first (put_start → libchm write → flush → put_end).
    """
    import xxhash

    block_bytes = check.int("block_bytes", block_bytes, 1, 1 << 30)
    repeat = check.int("repeat", repeat, 1, 1000)
    key = os.urandom(KEY_BYTES)
    data = os.urandom(block_bytes)
    running = None
    if manager_endpoint is None:
        running = start_manager(ManagerOptions(node=0, devices=[device_node]), master=master).serve_in_background()
        manager_endpoint = running.endpoint
    times: dict[str, list[float]] = {name: [] for name in (
        "stage_s", "local_s", "local_checked_s", "zmq_s", "zmq_checked_s", "local_total_s", "zmq_total_s")}
    try:
        loc, = master.put_start(f"bench-put-{key.hex()}", [key], [block_bytes])
        with libchm.Device(node_path(device_node), staging_bytes=max(block_bytes, 1 << 20)) as dev, \
                ManagerClient(manager_endpoint) as client:
            dev.write(loc.offset, data)
            dev.flush()  # on the media, as a block of an earlier turn
            master.put_end([key], [xxhash.xxh3_64_intdigest(data)])
            view = dev.buffer()[:block_bytes]
            for i in range(repeat):
                for path in ("local", "zmq"):
                    rid = f"bench-{key.hex()}-{i}-{path}"
                    leased = master.lookup([key], request_id=rid) if path == "zmq" else []  # as a worker's Lookup
                    t0 = time.perf_counter()
                    client.hint(rid, [key])
                    token = client.acquire(rid, key)
                    t1 = time.perf_counter()
                    if leased:
                        client.lease(rid, leased)  # the bytes over ZeroMQ need the Master's lease
                    for checked in (False, True):
                        t2 = time.perf_counter()
                        if path == "local":
                            dev.read_into(token.offset, view)
                            block = view
                        else:
                            token, block = client.read(rid, key)
                        if checked and xxhash.xxh3_64_intdigest(block) != token.checksum:
                            raise ChmError(errno.EIO, f"{path} read of block {key.hex()}: checksum mismatch")
                        times[f"{path}_checked_s" if checked else f"{path}_s"].append(time.perf_counter() - t2)
                    client.release(rid, key)
                    client.finish(rid)
                    t3 = time.perf_counter()
                    times["stage_s"].append(t1 - t0)
                    # the cycle once: staging, one checked read, release (the unchecked read left out)
                    times[f"{path}_total_s"].append(t3 - t0 - times[f"{path}_s"][-1])
            del view, block
        master.remove([key])
    finally:
        if running is not None:
            running.close()
    out: dict = {name: statistics.median(v) for name, v in times.items()}
    out.update({name[:-2] + "_gbps": block_bytes / out[name] / 1e9 for name in times})
    out["block_bytes"], out["repeat"] = block_bytes, repeat
    return out


def _store(master, path: str, nblocks: int, tag: str, size: int = 2 * PAGE) -> list[bytes]:
    """``nblocks`` blocks put through the Master and flushed to the media (a hint stages them from the disk)."""
    from tests.host_runtime.hymcache.manager_pieces import store

    return store(master, {0: path}, nblocks, size, tag)[0]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _until(condition, limit_s: float = 10.0) -> None:
    """Wait for ``condition()`` (a bench may look at the clock; tests synchronize on events)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise ChmError(errno.ETIMEDOUT, "bench_manager: the state it waits for never came")
        time.sleep(0.005)


def bench_slow_disk(media: Path) -> dict:
    """A served Manager over a device whose staging reads take SLOW_DISK_S: what other callers wait meanwhile."""
    from host_runtime.hymcache.master import Master
    from tests.emulator.serve.serving import Server

    out = {}
    with Server(media, None, "--set", f"faults.read_delay_ms={SLOW_DISK_S * 1e3:g}") as srv:
        master = Master(ManualClock())
        with start_manager(ManagerOptions(node=0, devices=[srv.node]), master=master) as running:
            running.serve_in_background()
            mgr = running.manager
            # (1) a served acquire of a block still staging, and another caller's stats meanwhile
            keys = _store(master, str(srv.path), 1, "held")
            got = {}

            def worker():
                with ManagerClient(running.endpoint) as c:
                    c.hint("slow", keys)
                    got["took"] = _timed(lambda: c.acquire("slow", keys[0], 30.0))

            thread = threading.Thread(target=worker)
            thread.start()
            _until(lambda: mgr.held_calls == 1)
            with ManagerClient(running.endpoint) as other:
                out["served_other_stats_s"] = _timed(other.stats)
            thread.join(timeout=30)
            out["served_held_acquire_s"] = got["took"]
            mgr.finish("slow")
            # (2) a held acquire answers ETIMEDOUT at its caller's timeout
            keys = _store(master, str(srv.path), 1, "late")
            with ManagerClient(running.endpoint) as c:
                c.hint("late", keys)
                t0 = time.perf_counter()
                try:
                    c.acquire("late", keys[0], HELD_TIMEOUT_S)
                except ChmError as exc:
                    if exc.errno != errno.ETIMEDOUT:
                        raise
                out["held_timeout_s"] = time.perf_counter() - t0
                c.finish("late")
            # (3) an in-process acquire waiting for its block, and other threads' calls meanwhile
            keys = _store(master, str(srv.path), 1, "ip")
            mgr.hint("in-process", keys)
            thread = threading.Thread(target=lambda: mgr.acquire("in-process", keys[0], 30.0))
            thread.start()
            with ManagerClient(running.endpoint) as other:
                out["in_process_others_s"] = _timed(lambda: (mgr.stats(), other.stats()))
            thread.join(timeout=30)
            mgr.finish("in-process")
            # (4) a flood of held calls, and another caller's stats meanwhile
            from host_runtime.hymcache.manager import MAX_HELD

            keys = _store(master, str(srv.path), 1, "flood")
            with ManagerClient(running.endpoint) as c, ManagerClient(running.endpoint) as other:
                c.hint("flood", keys)
                for _ in range(MAX_HELD + 40):
                    c.rpc.post("acquire", "flood", keys[0], 30.0)
                _until(lambda: mgr.held_calls == MAX_HELD)
                out["flood_other_stats_s"] = _timed(other.stats)
    return out


def bench_hung_master(media: Path) -> dict:
    """A Manager whose background confirmation goes to a Master that never answers: a call meanwhile."""
    import zmq

    from host_runtime.hymcache.master import Master
    from tests.emulator.serve.serving import Server

    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the lookups, answers none
    silent.linger = 0
    silent.bind("tcp://127.0.0.1:0")
    try:
        with Server(media) as srv:
            master = Master(WallClock())
            with KVManager(0, [srv.node], master, WallClock()) as mgr:
                mgr.confirm_in_background(silent.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=1.0)
                keys = _store(master, str(srv.path), 2, "hung")
                mgr.hint("a", keys, master.lookup(keys), confirm_later=True)
                return {"hung_master_stats_s": _timed(mgr.stats)}
    finally:
        silent.close(0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_manager", description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-bytes", type=int, default=16 << 20, help="block size of the read paths (16 MiB)")
    parser.add_argument("--repeat", type=int, default=8, help="rounds of the read paths (medians; default 8)")
    args = parser.parse_args(argv)
    from host_runtime.hymcache.master import Master
    from tests.emulator.serve.serving import Server

    with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
        tmp = Path(tmp)
        with Server(tmp / "paths") as srv:
            paths = measure_block_paths(Master(WallClock()), srv.node, block_bytes=args.block_bytes,
                                        repeat=args.repeat)
        timings = {**bench_slow_disk(tmp / "slow"), **bench_hung_master(tmp / "hung")}
    ms = lambda s: f"{1e3 * s:.1f} ms"  # noqa: E731
    checks = [
        ("another caller's stats while a served acquire is held (slow disk)", timings["served_other_stats_s"],
         lambda s: s < OTHERS_WAIT_MAX_S, f"< {ms(OTHERS_WAIT_MAX_S)}"),
        ("the held acquire, answered once the reads land", timings["served_held_acquire_s"],
         lambda s: s >= 0.6 * SLOW_DISK_S, f">= {ms(0.6 * SLOW_DISK_S)}"),
        (f"a held acquire with a {HELD_TIMEOUT_S:g} s timeout, answered ETIMEDOUT", timings["held_timeout_s"],
         lambda s: 0.25 <= s < 0.8 * SLOW_DISK_S, f"in [250 ms, {ms(0.8 * SLOW_DISK_S)})"),
        ("other threads' calls while an in-process acquire waits", timings["in_process_others_s"],
         lambda s: s < OTHERS_WAIT_MAX_S, f"< {ms(OTHERS_WAIT_MAX_S)}"),
        ("another caller's stats under a flood of held calls", timings["flood_other_stats_s"],
         lambda s: s < OTHERS_WAIT_MAX_S, f"< {ms(OTHERS_WAIT_MAX_S)}"),
        ("a call while the Master does not answer a confirmation", timings["hung_master_stats_s"],
         lambda s: s < HUNG_MASTER_WAIT_MAX_S, f"< {ms(HUNG_MASTER_WAIT_MAX_S)}"),
    ]
    rows, failed = [], 0
    mb = args.block_bytes / (1 << 20)
    for label, key in (("stage (hint -> acquire)", "stage_s"), ("local libchm read_into", "local_s"),
                       ("local, checksum on", "local_checked_s"), ("ZeroMQ read through the Manager", "zmq_s"),
                       ("ZeroMQ, checksum on", "zmq_checked_s"), ("local cycle", "local_total_s"),
                       ("ZeroMQ cycle", "zmq_total_s")):
        rows.append((f"{mb:g} MiB block: {label}", f"{ms(paths[key])} ({paths[key[:-2] + '_gbps']:.2f} GB/s)", "", ""))
    for label, seconds, ok, bound in checks:
        failed += not ok(seconds)
        rows.append((label, ms(seconds), "", f"{bound}{'' if ok(seconds) else ' (missed)'}"))
    for row in rows:
        print(f"  {row[0]:<72} {row[1]:>24}  {row[3]}")
    result_files.write("bench_manager", rows, {"block_paths": paths, "timings": timings}, argv)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
