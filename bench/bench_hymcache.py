"""HyMCache runtime against its floors, side by side in one run (medians of interleaved rounds).

(a) Master lookups per second, batches of 32 keys that all hit (each answer: 32 descriptors and
    32 read leases): in process, and over ZeroMQ to a Master process; beside a plain dict lookup of
    the same 32 keys and a bare ZeroMQ DEALER/ROUTER round trip of the same request size (floors).
(b) Master metadata bytes per entry, index included (the Master's own measuring function).
(c) One 16 MiB block of an earlier turn loaded on the device's machine:
    Lookup -> KV Manager (hint, prefetch, read token) -> connector (libchm reads of the block's
    pieces into its staging buffer, each copied into the engine's KV as it lands), checksum off and on; beside a bare libchm ``read_into`` of the
    same block (the floor; goal: >= 0.8 of it with the checksum off). The Lookup has seen the block
    before (it looked it up in the previous round, as a worker did in a conversation's previous turn),
    so it hints the Manager before asking the Master; a Lookup that remembers nothing shows the first
    look's way (Master first, then the hint). And the ZeroMQ path of a worker on another machine (the
    block read through the Manager as a zero-copy frame): cost per block.

Every piece is a real process: ``chm serve`` (the device), ``chm hymcache master`` and
``chm hymcache manager``; the worker is this process.

    python -m bench bench_hymcache            (or: make bench)

Results: ``bench/results/bench_hymcache.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import result_files
from driver.errors import ChmError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BATCH = 32
KEY_BYTES = 16

_ECHO = r"""
import sys, zmq
ctx = zmq.Context.instance()
s = ctx.socket(zmq.ROUTER); s.linger = 0
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    frames = s.recv_multipart(copy=False)
    if frames[-1].bytes == b"stop":
        break
    s.send_multipart(frames, copy=False)
"""


def _piece(args: list[str]) -> tuple[subprocess.Popen, dict]:
    """``chm hymcache ROLE ...`` as a process, once it printed its ready JSON line."""
    import json

    from host_runtime.hymcache.cli import read_lines

    proc = subprocess.Popen([sys.executable, "-m", "host_runtime.hymcache.cli", *args], stdout=subprocess.PIPE,
                            cwd=ROOT)
    try:
        for line in read_lines(proc, time.monotonic() + 60, f"chm hymcache {args[0]}"):
            if line.startswith("{"):
                return proc, json.loads(line)
        raise RuntimeError(f"chm hymcache {args[0]} not ready within 60 s")
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _rate(fn, batches: list, reps: int) -> float:
    """Calls of ``fn`` per second over ``reps`` passes through ``batches``."""
    t0 = time.perf_counter()
    for _ in range(reps):
        for b in batches:
            fn(b)
    return reps * len(batches) / (time.perf_counter() - t0)


def _interleaved(variants: dict, rounds: int) -> dict:
    """Each variant once per round, the order rotated each round; the median of each."""
    names = list(variants)
    got = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            got[n].append(variants[n]())
    return {n: statistics.median(v) for n, v in got.items()}


def _populate(master, n_entries: int, device_info) -> list[list[bytes]]:
    """``n_entries`` complete blocks in requests of 32 (one node, one fake device: metadata only)."""
    master.register_node(0, "", [device_info])
    requests = []
    for r in range(n_entries // BATCH):
        keys = [os.urandom(KEY_BYTES) for _ in range(BATCH)]
        locs = master.put_start(f"bench-{r}", keys, [4096] * BATCH)
        assert all(loc is not None for loc in locs)
        assert master.put_end(keys, list(range(BATCH))) == BATCH
        requests.append(keys)
    return requests


CHURN_BLOCK_MIB = (8, 16, 24, 32)  # blocks of several models' sizes share a device
CHURN_DEVICE_BYTES = 4 << 30


def bench_fragmentation(ops: int, seed: int = 1) -> dict:
    """Append-only allocation under churn: a 4 GiB device filled with blocks of mixed sizes, then ``ops``
    rounds of one request's put (evicting at the high watermark) and a random remove.
    Fragmentation = 1 - largest free extent / free bytes, as Master.stats() reports it."""
    import random

    from host_runtime.hymcache.clock import ManualClock
    from host_runtime.hymcache.master import Master
    from host_runtime.hymcache.messages import DeviceInfo

    rng = random.Random(seed)
    clock = ManualClock()
    master = Master(clock)
    master.register_node(0, "", [DeviceInfo(0, "", CHURN_DEVICE_BYTES, 1)])
    live: list[bytes] = []
    worst = 0.0
    for op in range(ops):
        keys = [os.urandom(KEY_BYTES) for _ in range(rng.randint(1, 4))]
        size = rng.choice(CHURN_BLOCK_MIB) << 20
        try:
            locs = master.put_start(f"churn-{op}", keys, [size] * len(keys))
        except ChmError:  # no extent fits even after eviction: counted by the Master
            locs = []
        written = [k for k, loc in zip(keys, locs) if loc is not None]
        master.put_end(written, [1] * len(written))
        live.extend(written)
        if live and rng.random() < 0.5:
            master.remove([live.pop(rng.randrange(len(live)))])
        clock.advance(60.0)  # leases from put/lookup long gone: everything complete is evictable
        master.expire()
        if op >= ops // 2:
            worst = max(worst, master.stats()["devices"][0]["fragmentation"])
    dev = master.stats()["devices"][0]
    return {"ops": ops, "used": dev["used_bytes"] / CHURN_DEVICE_BYTES, "fragmentation": dev["fragmentation"],
            "worst_fragmentation": worst, "freed_extents": dev["freed_extents"],
            "evictions": master.stats()["evictions"], "no_space": master.stats()["put_no_space"]}


def bench_lookups(n_entries: int, rounds: int, reps: int) -> dict:
    import zmq

    from host_runtime.hymcache.clock import WallClock
    from host_runtime.hymcache.master import Master, MasterClient
    from host_runtime.hymcache.messages import DeviceInfo

    fake = DeviceInfo(device=0, node_path="/dev/shm/bench-none", capacity_bytes=1 << 46, epoch=1)
    # long leases: the bench measures lookups, not lease expiry
    local = Master(WallClock(), lease_s=3600, lease_max_s=7200)
    requests = _populate(local, n_entries, fake)
    table = {k: (0, 0, i * 4096, 4096, i, 1) for i, k in enumerate(k for r in requests for k in r)}
    sample = requests[:: max(1, len(requests) // 256)]

    state = tempfile.mkdtemp(prefix="chm-bench-hymcache-", dir="/var/tmp")
    echo = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    master_proc = remote = dealer = None
    try:
        port = int(echo.stdout.readline())
        master_proc, info = _piece(["master", "--state-dir", state, "--lease", "3600", "--lease-max", "7200"])
        remote = MasterClient(info["endpoint"], timeout_s=60)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(f"tcp://127.0.0.1:{port}")
        rrequests = _populate(remote, min(n_entries, 32 * 256), fake)
        rsample = rrequests[:: max(1, len(rrequests) // 256)]
        # the same request size as a lookup call: a call id and a header holding 32 keys
        import msgspec

        header_of = {id(b): msgspec.msgpack.encode(("lookup", [b])) for b in rsample}

        def zmq_rt(batch):
            dealer.send_multipart([b"12345678", header_of[id(batch)]], copy=False)
            dealer.recv_multipart(copy=False)

        def dict_lookup(batch):
            out = []
            for k in batch:
                v = table.get(k)
                if v is None:
                    break
                out.append(v)
            return out

        assert len(local.lookup(sample[0])) == BATCH and len(remote.lookup(rsample[0])) == BATCH
        zreps = max(1, reps // 10)
        got = _interleaved({
            "dict": lambda: _rate(dict_lookup, sample, reps),
            "master_in_process": lambda: _rate(local.lookup, sample, reps),
            "zmq_round_trip": lambda: _rate(zmq_rt, rsample, zreps),
            "master_zmq": lambda: _rate(remote.lookup, rsample, zreps),
        }, rounds)
        got["entries_in_process"] = len(table)
        got["entries_zmq"] = 32 * len(rrequests)
        got["bytes_per_entry"] = _bytes_per_entry(local)
        return got
    finally:
        if dealer is not None:
            dealer.send_multipart([b"x", b"stop"])
            dealer.close(0)
        if remote is not None:
            remote.close()
        local.close()
        if master_proc is not None:
            _stop(master_proc)
        try:
            echo.wait(timeout=10)
        except subprocess.TimeoutExpired:
            echo.kill()
            echo.wait()
        import shutil

        shutil.rmtree(state, ignore_errors=True)


def _bytes_per_entry(master) -> dict:
    """The Master's metadata per entry: bench/master_footprint.py's measurement (tracemalloc over a filled
    Master) and the count of the live Master of (a)."""
    from bench.master_footprint import measure_bytes_per_entry

    m = measure_bytes_per_entry()
    out = {k: m[k] for k in ("entries", "entry_bytes", "traced_bytes_per_entry", "counted_bytes_per_entry") if k in m}
    live = master.metadata_bytes()
    out["live_entries"], out["live_bytes_per_entry"] = live["entries"], live["bytes_per_entry"]
    return out


# --------------------------------------------------------------------------------------- (c) one 16 MiB block

# Pages of 2 MiB and a 64 MiB window, as bench_libchm's second configuration: the controller's per-page
# Python work (the emulator's, not the runtime's) would otherwise dominate every path alike.
DEVICE_SET = ("device.page_size_bytes=2097152", "ssd.stripe_bytes=2097152", "policy.prefetch_window_bytes=67108864")
LAYERS, KV_HEADS, HEAD_DIM = 16, 8, 64   # the engine KV the block loads into (float32)


def bench_block(block_bytes: int, rounds: int) -> dict:
    import torch
    import xxhash

    from libchm import Device

    from host_runtime.hymcache.cli import HyMCacheSet
    from host_runtime.hymcache.clock import WallClock
    from host_runtime.hymcache.connector import (HyMCacheConnector, HyMCacheConnectorMetadata, KVConnectorRole,
                                                 LoadSpec, ReqMeta)
    from host_runtime.hymcache.lookup import Lookup
    from host_runtime.hymcache.manager import ManagerClient
    from host_runtime.hymcache.master import MasterClient

    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    chunk = block_bytes // per_token
    work = tempfile.mkdtemp(prefix="chm-bench-hymcache-", dir="/var/tmp")
    hset = HyMCacheSet(1, 1, media_root=os.path.join(work, "media"), device_overrides=list(DEVICE_SET),
                       label="bench_hymcache", verbose=False, tag=f"chm-bench-hym-{os.getpid()}")
    hset.start()
    desc = hset.describe()
    master = MasterClient(desc["master"], timeout_s=30)
    manager = ManagerClient(desc["managers"][0]["endpoint"], timeout_s=30)
    dev = Device(desc["devices"][0]["path"], staging_bytes=max(block_bytes, 1 << 20))
    # the engine's paged KV: per layer [blocks, k/v, chunk_size tokens, kv heads, head dim]; one block = block_bytes
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 2, chunk, KV_HEADS, HEAD_DIM) for i in range(LAYERS)}
    connectors = {}
    lookup = cold = None
    try:
        for checked in (False, True):
            c = HyMCacheConnector({"chunk_size": chunk, "verify_checksum": checked,
                                   "staging_buffer_size": block_bytes / 1e9 + 0.001},
                                  KVConnectorRole.WORKER, master=master, manager_for_node=lambda node: manager)
            c.register_kv_caches(kv)
            connectors[checked] = c
        # the Lookup's thread talks through clients of its own (a ZeroMQ socket is one thread's)
        lookup = Lookup(desc["master"], None, WallClock())
        cold = Lookup(desc["master"], None, WallClock(), known_locations=0)  # remembers no descriptor
        key = os.urandom(KEY_BYTES)
        data = os.urandom(block_bytes)
        checksum = xxhash.xxh3_64_intdigest(data)
        (loc,) = master.put_start("bench-block", [key], [block_bytes])
        dev.write(loc.offset, data)
        dev.flush()
        master.put_end([key], [checksum])
        view = dev.buffer()[:block_bytes]
        counter = iter(range(1 << 30))
        phases: dict[str, list[float]] = {}

        def at_rest():
            t0 = time.perf_counter()
            dev.read_into(loc.offset, view)  # the device stages it from its SSDs and hands it over
            return time.perf_counter() - t0

        def staged():
            # staged in device DRAM first (as the Manager's prefetch does), then timed: the transfer alone
            h = dev.prefetch(loc.offset, block_bytes)
            dev.wait(h, timeout_ms=30_000)
            t0 = time.perf_counter()
            dev.read_into(loc.offset, view)
            t = time.perf_counter() - t0
            dev.release(h)
            return t

        def prefetched():
            # what the Manager does for it, in this process: prefetch, wait, read_into, release
            t0 = time.perf_counter()
            h = dev.prefetch(loc.offset, block_bytes)
            dev.wait(h, timeout_ms=30_000)
            dev.read_into(loc.offset, view)
            dev.release(h)
            return time.perf_counter() - t0

        def through(checked: bool, lookup=lookup, tag: str = ""):
            conn = connectors[checked]

            def run():
                rid = f"bench-{next(counter)}"
                t0 = time.perf_counter()
                lookup.start(rid, [key])                      # hint to the Manager; Master lookup
                (hit,) = lookup.result(rid, 30.0)
                t1 = time.perf_counter()
                conn.bind_connector_metadata(HyMCacheConnectorMetadata([ReqMeta(rid, LoadSpec([key], [hit], [1]))]))
                conn.start_load_kv(None)                      # acquire, read_into staging, (xxh3), copy into KV
                failed = conn.get_block_ids_with_load_errors()
                conn.clear_connector_metadata()
                t = time.perf_counter() - t0
                phases.setdefault(f"lookup_{tag or checked}", []).append(t1 - t0)
                phases.setdefault(f"load_{tag or checked}", []).append(t - (t1 - t0))
                lookup.forget(rid)
                if failed:
                    raise AssertionError(f"the block failed to load: {conn.counters}")
                return t
            return run

        def remote(checked: bool):
            def run():
                rid = f"bench-z{next(counter)}"
                t0 = time.perf_counter()
                # the Master's lookup for this request: its read lease, which a served read needs (as the Lookup does)
                manager.hint(rid, [key], master.lookup([key], request_id=rid))
                token, frame = manager.read(rid, key, 30.0)   # the block as a zero-copy frame
                if checked and xxhash.xxh3_64_intdigest(frame) != token.checksum:
                    raise AssertionError("ZeroMQ read: checksum mismatch")
                manager.release(rid, key)
                manager.finish(rid)
                return time.perf_counter() - t0
            return run

        def from_rest(fn):
            # Every variant starts with the block on the SSDs only: a staged copy dropped on release
            # (hymcache), so no variant finds it left in device DRAM by the one before it.
            def run():
                h = dev.prefetch(loc.offset, block_bytes)
                dev.wait(h, timeout_ms=30_000)
                dev.release(h)
                return fn()
            return run

        variants = {"bare_at_rest": at_rest, "bare_staged": staged, "bare_prefetch": prefetched,
                    "connector": through(False), "connector_checked": through(True),
                    "connector_cold": through(False, cold, "cold"),
                    "zmq": remote(False), "zmq_checked": remote(True)}
        got = _interleaved({name: from_rest(fn) for name, fn in variants.items()}, rounds)
        loaded = torch.stack([kv[name][1] for name in kv]).numpy().tobytes()
        assert xxhash.xxh3_64_intdigest(loaded) == checksum, "the engine's KV does not hold the stored block"
        view.release()
        got.update({name: statistics.median(v) for name, v in phases.items()})
        return got
    finally:
        for lk in (lookup, cold):
            if lk is not None:
                lk.close()
        for c in connectors.values():
            c.shutdown()
        dev.close()
        manager.close()
        master.close()
        hset.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_hymcache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="blocks stored in the in-process Master")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians; default 7)")
    parser.add_argument("--reps", type=int, default=20, help="passes over 256 batches per in-process timing")
    parser.add_argument("--block-bytes", type=int, default=16 << 20, help="(c) block size (default 16 MiB)")
    parser.add_argument("--block-rounds", type=int, default=21, help="(c) interleaved rounds (default 21)")
    args = parser.parse_args(argv)
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    bad = (args.entries < 32 * 256 or min(args.rounds, args.block_rounds, args.reps) < 1
           or not per_token <= args.block_bytes <= 64 << 20 or args.block_bytes % per_token)
    if bad:
        parser.error(f"--entries >= 8192, --rounds, --block-rounds, --reps >= 1, --block-bytes a multiple of "
                     f"{per_token} in [{per_token}, 64 MiB]")
    try:
        for piece in ("master", "manager", "lookup", "connector"):
            importlib.import_module(f"host_runtime.hymcache.{piece}")
    except ImportError as exc:
        print(f"bench_hymcache: the runtime is not all there yet: {exc}", file=sys.stderr)
        return 1

    lk = bench_lookups(args.entries, args.rounds, args.reps)
    print(f"(a) Master lookups, batches of {BATCH} keys, all hits (medians of {args.rounds} interleaved rounds)")
    print(f"    {'':50} batches/s     keys/s   us/batch")
    for label, key in (("plain dict lookup (floor)", "dict"),
                       (f"Master in process ({lk['entries_in_process']} entries)", "master_in_process"),
                       ("bare ZeroMQ DEALER/ROUTER round trip (floor)", "zmq_round_trip"),
                       (f"Master over ZeroMQ, another process ({lk['entries_zmq']} entries)", "master_zmq")):
        r = lk[key]
        print(f"    {label:<50} {r:9.0f} {r * BATCH:10.0f} {1e6 / r:10.1f}")
    bpe = lk["bytes_per_entry"]
    print("(b) Master metadata per entry (goal: 64 + index overhead): "
          + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in bpe.items()))

    frag = bench_fragmentation(2000)
    print(f"(b) append-only allocation after {frag['ops']} churn rounds on a {CHURN_DEVICE_BYTES >> 30} GiB device, "
          f"blocks of {'/'.join(map(str, CHURN_BLOCK_MIB))} MiB: used {frag['used']:.0%}, fragmentation "
          f"{frag['fragmentation']:.2f} (worst over the second half {frag['worst_fragmentation']:.2f}), "
          f"{frag['freed_extents']} freed extents, {frag['evictions']} evictions, {frag['no_space']} puts refused")

    blk = bench_block(args.block_bytes, args.block_rounds)
    mb = args.block_bytes / (1 << 20)
    base = blk["bare_at_rest"]
    print(f"(c) one {mb:g} MiB block of an earlier turn, on the device's machine (medians of {args.block_rounds})")
    print(f"    {'':58} ms/block    GB/s  of floor  (goal: >= 0.8 of the floor, checksum off)")
    for label, key in (("bare libchm read_into, block at rest (floor)", "bare_at_rest"),
                       ("bare libchm read_into, block already staged (transfer)", "bare_staged"),
                       ("bare libchm prefetch + wait + read_into + release", "bare_prefetch"),
                       ("Lookup -> Manager -> connector -> engine KV, checksum off", "connector"),
                       ("Lookup -> Manager -> connector -> engine KV, checksum on", "connector_checked"),
                       ("the same, checksum off, a Lookup that remembers nothing", "connector_cold"),
                       ("ZeroMQ path via the Manager (remote worker)", "zmq"),
                       ("ZeroMQ path, checksum on", "zmq_checked")):
        s = blk[key]
        print(f"    {label:<58} {1e3 * s:8.2f} {args.block_bytes / s / 1e9:7.2f} {base / s:8.2f}")
    print(f"    of the local path (checksum off): Lookup (hint + Master lookup) {1e3 * blk['lookup_False']:.2f} ms "
          f"(remembering nothing: Master lookup, then hint {1e3 * blk['lookup_cold']:.2f} ms), "
          f"connector load (acquire: staged by the Manager's prefetch; reads and copies into KV; release posted) "
          f"{1e3 * blk['load_False']:.2f} ms")
    print(f"    checksum (xxh3) on the local path: {1e3 * (blk['connector_checked'] - blk['connector']):+.2f} ms per "
          f"block; the ZeroMQ path over the local one: {1e3 * (blk['zmq'] - blk['connector']):+.2f} ms per block")
    us = lambda key: f"{1e6 / lk[key]:.1f} µs"  # noqa: E731
    ms_of_floor = lambda key: f"{1e3 * blk[key]:.2f} ms ({base / blk[key]:.2f} of the floor)"  # noqa: E731
    rows = [(f"Master lookup, batch of {BATCH}, in process / over ZeroMQ",
             f"{us('master_in_process')} / {us('master_zmq')}",
             f"dict {us('dict')} / bare ZeroMQ round trip {us('zmq_round_trip')}", ""),
            ("Master metadata per entry", ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in bpe.items()), "the 64-byte entry", "64 + index"),
            (f"append-only allocation after {frag['ops']} churn rounds ({CHURN_DEVICE_BYTES >> 30} GiB device)",
             f"used {frag['used']:.0%}, fragmentation {frag['fragmentation']:.2f} (worst over the second half "
             f"{frag['worst_fragmentation']:.2f}), {frag['freed_extents']} freed extents, {frag['evictions']} "
             f"evictions, {frag['no_space']} puts refused", "", "no put refused"),
            (f"{mb:g} MiB block of an earlier turn, at rest: Lookup → Manager → connector → engine KV, checksum off / on",
             f"{ms_of_floor('connector')} / {ms_of_floor('connector_checked')}",
             f"bare libchm read of the block at rest: {1e3 * base:.2f} ms", "≥ 0.8 of the floor"),
            ("the same, a Lookup that remembers nothing (Master lookup, then hint)", ms_of_floor("connector_cold"),
             "the same floor", ""),
            ("the same block through the Manager over ZeroMQ (remote worker)", ms_of_floor("zmq"), "", "")]
    result_files.write("bench_hymcache", rows, {"lookups": lk, "fragmentation": frag, "block": blk,
                                                "block_bytes": args.block_bytes, "rounds": args.rounds,
                                                "block_rounds": args.block_rounds}, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
