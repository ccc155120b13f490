"""SSD backend throughput next to fio, on the same backing file and block size.

Both sides do O_DIRECT io_uring I/O with the same queue depth on the same
file region: the emulator through its backend (``emulator.ssd.SsdBackend``,
the path every staging read and flush takes), fio with
``--ioengine=io_uring --direct=1``. The region is written before it is read,
so reads hit allocated blocks, not holes.

Results: ``bench/results/bench_ssd.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import result_files
from emulator.config import load_profile
from emulator.ssd import SsdBackend, media_file

MiB = 1 << 20


def emulator_pass(backend: SsdBackend, opcode: int, size: int, bs: int, depth: int, buf_addr: int) -> float:
    """Stream ``size`` bytes through SSD 0 in ``bs`` blocks, ``depth`` in flight; returns GB/s."""
    start = time.perf_counter()
    inflight = []
    for i, offset in enumerate(range(0, size, bs)):
        inflight.append(backend.submit(opcode, 0, offset, buf_addr + (i % depth) * bs, bs))
        if len(inflight) == depth:
            backend.wait(inflight.pop(0))
    for token in inflight:
        backend.wait(token)
    return size / (time.perf_counter() - start) / 1e9


def fio_pass(path: Path, rw: str, size: int, bs: int, depth: int) -> float:
    out = subprocess.run(
        ["fio", "--name=chm", f"--filename={path}", "--ioengine=io_uring", "--direct=1", f"--rw={rw}",
         f"--bs={bs}", f"--iodepth={depth}", f"--size={size}", "--offset=0", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read" if rw == "read" else "write"]
    return side["io_bytes"] / (side["runtime"] / 1e3) / 1e9 if side["runtime"] else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_ssd", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes streamed per pass (default 1024 MiB)")
    parser.add_argument("--bs-kib", type=int, default=1024, help="block size (default 1024 KiB)")
    parser.add_argument("--depth", type=int, default=32, help="I/Os in flight (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="passes per side; the median is reported (default 5)")
    parser.add_argument("--dir", default=None, help="where the backing file goes (default: a temp dir under the repository)")
    args = parser.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio not found: run `make setup` (it installs Debian's fio)")
        return 1
    size, bs, depth = args.size_mib * MiB, args.bs_kib * 1024, args.depth
    cfg = load_profile("small").with_overrides({"emulation.io_queue_depth": depth})
    root = Path(args.dir or Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix=".bench-ssd-", dir=root) as media:
        backend = SsdBackend(cfg, media)
        buf = mmap.mmap(-1, depth * bs)
        cbuf = backend.ffi.from_buffer(buf)
        addr = int(backend.ffi.cast("uintptr_t", cbuf))
        path = media_file(Path(media), 0)
        results = {}
        try:
            emulator_pass(backend, SsdBackend.WRITE, size, bs, depth, addr)  # allocate the blocks first, untimed
            for rw, opcode in (("write", SsdBackend.WRITE), ("read", SsdBackend.READ)):
                emu, fio = [], []
                for i in range(args.repeats):  # interleaved, first one then the other, so drift hits both
                    runs = [lambda: emu.append(emulator_pass(backend, opcode, size, bs, depth, addr)),
                            lambda: fio.append(fio_pass(path, rw, size, bs, depth))]
                    for run in runs[::1 if i % 2 == 0 else -1]:
                        run()
                results[rw] = (statistics.median(emu), statistics.median(fio), emu, fio)
        finally:
            backend.close()
            del cbuf
            buf.close()
    print(f"SSD backend vs fio: {media_file(Path('<tmp>'), 0).name} on {root}, {args.size_mib} MiB per pass, "
          f"bs {args.bs_kib} KiB, {depth} in flight, O_DIRECT io_uring, median of {args.repeats}")
    print(f"{'':8}{'emulator GB/s':>15}{'fio GB/s':>12}{'ratio':>9}   all passes (emulator | fio)")
    for rw, (emu, fio, emu_all, fio_all) in results.items():
        passes = " ".join(f"{x:.2f}" for x in emu_all) + " | " + " ".join(f"{x:.2f}" for x in fio_all)
        print(f"{rw:8}{emu:15.2f}{fio:12.2f}{emu / fio:9.0%}   {passes}")
    setting = f"{args.bs_kib} KiB blocks, {depth} in flight, O_DIRECT io_uring, median of {args.repeats} passes"
    result_files.write("bench_ssd", [
        (f"SSD backend {rw}, {setting}", f"{emu:.2f} GB/s", f"fio, same file: {fio:.2f} GB/s ({emu / fio:.0%})",
         "≥ 80% of fio") for rw, (emu, fio, _, _) in results.items()],
        {"size_mib": args.size_mib, "bs_kib": args.bs_kib, "depth": depth, "repeats": args.repeats,
         **{rw: {"emulator_gbps": emu, "fio_gbps": fio, "emulator_passes": e, "fio_passes": f}
            for rw, (emu, fio, e, f) in results.items()}}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
