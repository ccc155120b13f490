"""Replay in event-driven virtual time, by the wall clock: a trace's span (epoch-stamped times, a day-long idle
gap, ``--time-scale 1000``) must not set its cost. Each shifted trace replays beside the same requests from
time zero, interleaved, median of ``--repeat``; the bound is the one the tests held before it moved here
(tests/host_runtime/test_replay_event_time.py asserts the event counts, which need no clock):
wall(shifted) < 2 x wall(plain) + 1 s, and ``chm replay`` of an epoch-stamped trace with a day gap under 30 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from itertools import islice
from pathlib import Path

from bench import result_files

KiB, MiB = 1 << 10, 1 << 20
REQUESTS = 400
EPOCH_MS = 1_700_000_000_000
DAY_MS = 86_400_000
OVERRIDES = {"dram.size_bytes": 64 * MiB, "policy.prefetch_window_bytes": 8 * MiB}
BOUND_FACTOR, BOUND_SLACK_S, CLI_BOUND_S = 2.0, 1.0, 30.0


def _write(path: Path, records: list[dict], shift_ms) -> Path:
    with path.open("w") as f:
        for i, rec in enumerate(records):
            f.write(json.dumps({**rec, "timestamp": rec["timestamp"] + shift_ms(i)}) + "\n")
    return path


def _wall(path: Path, variant: str, time_scale: float = 1.0) -> float:
    from host_runtime.replay import MooncakeTrace, Replay, replay_config

    trace = MooncakeTrace(path, block_bytes=256 * KiB, tokens_per_block=512, time_scale=time_scale)
    rp = Replay(replay_config("small", variant, OVERRIDES), variant, trace, window_bytes=MiB, progress=False)
    t0 = time.perf_counter()
    rp.run()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench bench_event_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs of each pair (default 3)")
    args = parser.parse_args(argv)
    from emulator.cli import main as chm_main
    from emulator.shared_data import mooncake_conversation_trace

    with mooncake_conversation_trace().open() as f:
        records = [json.loads(line) for line in islice(f, REQUESTS)]
    half = len(records) // 2
    rows, details, ok = [], {}, True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plain = _write(tmp / "plain.jsonl", records, lambda i: 0)
        cases = {"epoch-ms timestamps": (_write(tmp / "epoch.jsonl", records, lambda i: EPOCH_MS), 1.0),
                 "a day-long gap": (_write(tmp / "day.jsonl", records, lambda i: DAY_MS if i >= half else 0), 1.0),
                 "--time-scale 1000": (plain, 1000.0)}
        for case, (path, scale) in cases.items():
            for variant in ("lru", "hymcache"):
                base, shifted = [], []
                for _ in range(args.repeat):  # interleaved: the machine's drift hits both alike
                    base.append(_wall(plain, variant))
                    shifted.append(_wall(path, variant, scale))
                b, s = statistics.median(base), statistics.median(shifted)
                bound = BOUND_FACTOR * b + BOUND_SLACK_S
                ok &= s < bound
                rows.append((f"{case}, {variant}", f"{s:.2f} s", f"plain {b:.2f} s", f"< {bound:.2f} s"
                             + (" (met)" if s < bound else " (MISSED)")))
                details[f"{case}/{variant}"] = {"plain_s": base, "shifted_s": shifted}
        day = _write(tmp / "cli.jsonl", records[:50], lambda i: EPOCH_MS + (DAY_MS if i >= 25 else 0))
        t0 = time.perf_counter()
        rc = chm_main(["replay", str(day), "--profile", "small", "--policy", "lru", "--block-bytes", "256KiB",
                       "--tokens-per-block", "512", "--time-scale", "1000", "--window-s", "86400", "--no-progress",
                       "--set", "dram.size_bytes=67108864", "--set", "policy.prefetch_window_bytes=8388608"])
        cli_s = time.perf_counter() - t0
    ok &= rc == 0 and cli_s < CLI_BOUND_S
    rows.append(("chm replay, epoch-stamped, a day gap", f"{cli_s:.2f} s (exit {rc})", "-",
                 f"< {CLI_BOUND_S:g} s" + (" (met)" if cli_s < CLI_BOUND_S else " (MISSED)")))
    details["chm_replay_s"] = cli_s
    for row in rows:
        print("  ".join(f"{c:<40}" if i == 0 else f"{c:<18}" for i, c in enumerate(row)))
    path = result_files.write("bench_event_time", rows, details, argv)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
