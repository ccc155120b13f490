"""``chm demo``: the same multi-pass object workload under each policy.

A KV-cache-like pattern: objects are written once, then read back in order
twice (two "turns"), the footprint larger than device DRAM. ``lru`` caches on
demand and keeps what was consumed, so the second pass misses too;
``hymcache`` prefetches a bounded window ahead of the reader and releases each
object after reading it. Every byte read back is checked.
"""

from __future__ import annotations

import hashlib
import tempfile
import time

from tqdm import tqdm

from common.units import format_bytes

from .cli import int_at_least
from .device import Device
from .errors import WriteBufferFull


def read_in_order(dev: Device, objects: int, object_bytes: int, window: int):
    """Read objects 0..objects-1 in order, keeping up to ``window`` prefetches
    in flight ahead of the reader (issue -> wait -> read -> release).
    Yields (index, bytes)."""
    handles = {}
    for i in range(objects):
        for j in range(i, min(objects, i + window)):
            if j not in handles:
                handles[j] = dev.prefetch(j * object_bytes, object_bytes)
        if i in handles:
            dev.wait(handles[i])
        yield i, dev.read(i * object_bytes, object_bytes)
        if i in handles:
            dev.release(handles.pop(i))


def run_workload(dev: Device, objects: int, object_bytes: int, passes: int, window: int, progress=None) -> dict:
    """Write ``objects`` objects, then read them ``passes`` times in order.

    With ``window`` > 0, each pass keeps up to ``window`` prefetches in flight
    ahead of the reader. Returns the figures of the demo table.
    """
    digests = []
    refused = 0
    for i in range(objects):
        data = hashlib.sha256(i.to_bytes(8, "little")).digest() * (object_bytes // 32)
        digests.append(hashlib.sha256(data).digest())
        while True:
            try:
                dev.write(i * object_bytes, data)
                break
            except WriteBufferFull:
                refused += 1
                dev.flush()  # the demo retries after draining; a server would retry next turn
        if progress:
            progress.update()
    dev.flush()
    write_done = dev.clock_ns
    before = dev.stats()
    mismatches = 0
    for _ in range(passes):
        for i, data in read_in_order(dev, objects, object_bytes, window):
            mismatches += hashlib.sha256(data).digest() != digests[i]
            if progress:
                progress.update()
    after = dev.stats()
    read_ns = dev.clock_ns - write_done
    return {
        "policy": dev.info()["policy"],
        "page_hits": after["page_hits"] - before["page_hits"],
        "page_misses": after["page_misses"] - before["page_misses"] + after["merged_misses"] - before["merged_misses"],
        "ssd_read": after["ssd_read_bytes"] - before["ssd_read_bytes"],
        "ssd_written": after["ssd_write_bytes"],
        "refused_writes": refused,
        "read_time_ms": read_ns / 1e6,
        "read_gbps": passes * objects * object_bytes / read_ns,
        "mismatches": mismatches,
    }


def register(sub) -> None:
    p = sub.add_parser("demo", help="run both policies on a small device and print a table",
                       description="Write objects to a small emulated device, read them back twice in order under "
                                   "each policy, and print hits, bytes moved and modelled time.")
    p.add_argument("--objects", type=int_at_least(1), default=24, help="number of objects (default 24)")
    p.add_argument("--object-mib", type=int_at_least(1), default=2, help="object size in MiB (default 2)")
    p.add_argument("--dram-mib", type=int_at_least(1), default=32,
                   help="device DRAM in MiB (default 32, smaller than the footprint)")
    p.add_argument("--window", type=int_at_least(1), default=4, help="hymcache prefetch depth in objects (default 4)")
    p.add_argument("--media-dir", help="where the SSD backing files go (default: a temporary directory)")
    p.set_defaults(func=_demo)


def _demo(args) -> int:
    object_bytes = args.object_mib << 20
    dram = args.dram_mib << 20
    overrides = {"dram.size_bytes": dram, "policy.prefetch_window_bytes": min(args.window * object_bytes, dram // 2),
                 "policy.flush_batch_bytes": min(8 << 20, dram // 8)}
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chm-demo-", dir=args.media_dir) as media:
        total = 2 * (args.objects * 3)
        with tqdm(total=total, desc="chm demo", unit="op", leave=False) as bar:
            for policy, window in (("lru", 0), ("hymcache", args.window)):
                with Device.open("small", f"{media}/{policy}", policy=policy, overrides=overrides) as dev:
                    rows.append(run_workload(dev, args.objects, object_bytes, 2, window, bar))
    footprint = args.objects * object_bytes
    print(f"CXL-HM demo: {args.objects} objects x {format_bytes(object_bytes)} = {format_bytes(footprint)} footprint, "
          f"device DRAM {format_bytes(dram)}, 2 read passes (profile 'small')")
    header = ("policy", "page hits", "page misses", "SSD read", "SSD written", "refused wr", "read time", "read GB/s", "bad reads")
    print("  ".join(f"{h:>11}" for h in header))
    for r in rows:
        cells = (r["policy"], r["page_hits"], r["page_misses"], format_bytes(r["ssd_read"]), format_bytes(r["ssd_written"]),
                 r["refused_writes"], f"{r['read_time_ms']:.2f} ms", f"{r['read_gbps']:.2f}", r["mismatches"])
        print("  ".join(f"{c:>11}" for c in cells))
    print(f"(modelled time on the small profile's hardware; wall time {time.perf_counter() - started:.1f} s; "
          f"hymcache prefetches {args.window} objects ahead)")
    return 1 if any(r["mismatches"] for r in rows) else 0
