"""The KV connector's fault timings, each against its bound: how long a turn (and the wait inside it) takes
when the Master or a device fails under it. These are the wall-clock halves of
tests/host_runtime/hymcache/test_connector.py and test_vllm_connector.py, whose tests run the same
scenarios (imported from them here) and check them by their outcome: the error recorded, the request
recomputed, the tokens, the counters, the order of events.

    python -m bench bench_connector_faults                     (both parts; the vLLM one takes minutes)
    python -m bench.bench_connector_faults --part connector    (the PagedEngine part only, ~1 min)

Results: ``bench/results/bench_connector_faults.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import result_files

# PagedEngine part (test_connector.py): lookup_timeout_ms 1000 and rpc_timeout_s 1.0; blocking_timeout_secs 2.0
MASTER_KILLED_TURN_MAX_S = 15.0  # a lookup gives up after lookup_timeout_ms, a put_start after rpc_timeout_s
DEVICE_KILLED_TURN_MAX_S = 30.0  # the load gives up at blocking_timeout_secs, the turn recomputes
# vLLM part (test_vllm_connector.py's timeouts: BLOCKING_TIMEOUT_S, LOOKUP_TIMEOUT_MS, RPC_TIMEOUT_S)
LOOKUP_SLACK_S = 1.0   # a lookup fails in [lookup_timeout_ms, lookup_timeout_ms + this): before an RPC's timeout
WAIT_SLACK_S = 2.0     # a put_start step, a load: at most their own timeout plus this
HANG_S = 120.0         # a vLLM turn that takes longer hangs (a loaded 2-core machine computes a turn in ~1-15 s)
SLOW_LOAD_MIN = 0.9    # the slow device's undisturbed load takes at least this fraction of READ_DELAY_MS


def check(label: str, seconds: float | None, ok, bound: str) -> dict:
    """One measured time against its bound (a missing measurement misses it)."""
    return {"what": label, "seconds": seconds, "ok": seconds is not None and bool(ok(seconds)), "bound": bound}


def connector_part(work: Path) -> tuple[list[dict], dict]:
    """test_connector.py's Master-killed and device-killed turns on the PagedEngine and SmolLM2."""
    import torch

    from host_runtime.hybridgen.model import SmolLM2
    from host_runtime.hybridgen.tokenizer import Tokenizer
    from tests.host_runtime.hymcache.test_connector import (device_killed_turn, in_process_pieces,
                                                            master_killed_turns)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests' smol fixture
    try:
        model = SmolLM2.load()
        tok = Tokenizer.from_gguf(model.tokenizer_reader)
        (work / "master").mkdir()
        master = master_killed_turns(model, tok, work / "master")
        (work / "device").mkdir()
        with in_process_pieces(work / "device") as pieces:
            device = device_killed_turn(model, tok, *pieces)
    finally:
        torch.set_num_threads(threads)
    checks = [
        check("PagedEngine: the turn after kill -9 of the Master", master.second_s,
              lambda s: s < MASTER_KILLED_TURN_MAX_S, f"< {MASTER_KILLED_TURN_MAX_S:g} s"),
        check("PagedEngine: the turn after kill -9 of the device", device.after_s,
              lambda s: s < DEVICE_KILLED_TURN_MAX_S, f"< {DEVICE_KILLED_TURN_MAX_S:g} s"),
    ]
    details = {"master_killed": {"turn_s": master.second_s, "reused_tokens": master.second.reused_tokens,
                                 "skipped_stores": master.second_skipped,
                                 "identical": master.second.output_token_ids == master.ref.output_token_ids},
               "device_killed": {"turn_s": device.after_s, "load_errors": device.load_errors,
                                 "identical": device.after.output_token_ids == device.ref.output_token_ids}}
    return checks, details


def vllm_part(work: Path) -> tuple[list[dict], dict]:
    """test_vllm_connector.py's fault turns in the real vLLM: the Master stopped, a device killed mid-load, a
    device killed under in-flight media reads. Builds what the tests' fixtures build (the reference process,
    the set, the engine, the slow-read set)."""
    import pytest

    from host_runtime.hymcache.hf_model import ensure_hf_folder
    from tests.host_runtime.hymcache import test_vllm_connector as tv  # sets vLLM's environment before vLLM loads

    model_dir = ensure_hf_folder()
    (work / "ref").mkdir()
    row = tv.run_reference(model_dir, work / "ref" / "reference.json")["rows"][-1]
    (work / "media").mkdir()
    (work / "media-slow").mkdir()
    with tv.keyed_set(None, str(work / "media"), "benchfaults") as (hset, keys), \
            tv.connector_engine(model_dir, hset, keys) as engine:
        engine.generate(row["prompt"])  # stored
        with pytest.MonkeyPatch.context() as mp:
            stopped = tv.master_stopped_turn(engine, row, hset, mp)
        engine.generate(row["prompt"])  # loaded again with the Master back, as the tests run in turn
        with pytest.MonkeyPatch.context() as mp:
            mid_load = tv.device_killed_mid_load_turn(engine, row, hset, mp)
        with tv.keyed_set(keys, str(work / "media-slow"), "benchslow", 1, tv.SLOW_READS) as (slow_set, _), \
                pytest.MonkeyPatch.context() as mp:
            inflight = tv.killed_under_inflight_reads(engine, row, slow_set, keys, mp)
    lookup_s, read_delay_s = tv.LOOKUP_TIMEOUT_MS / 1000, tv.READ_DELAY_MS / 1000
    slow_load_s = inflight.slow["load_time_ns"] / 1e9
    hang = (lambda s: s < HANG_S), f"< {HANG_S:g} s (a hang)"
    checks = [
        check("vLLM, Master stopped: the lookup asked -> failed", stopped.lookup_s,
              lambda s: lookup_s <= s < lookup_s + LOOKUP_SLACK_S,
              f"in [{lookup_s:g}, {lookup_s + LOOKUP_SLACK_S:g}) s (lookup_timeout_ms, before the RPC timeout)"),
        check("vLLM, Master stopped: the longest put_start step", stopped.bind_s,
              lambda s: s < tv.RPC_TIMEOUT_S + WAIT_SLACK_S,
              f"< {tv.RPC_TIMEOUT_S + WAIT_SLACK_S:g} s (rpc_timeout_s)"),
        check("vLLM, Master stopped: the turn", stopped.turn_s, *hang),
        check("vLLM, device killed mid-load: the load", mid_load.load_s,
              lambda s: s < tv.BLOCKING_TIMEOUT_S + WAIT_SLACK_S,
              f"< {tv.BLOCKING_TIMEOUT_S + WAIT_SLACK_S:g} s (blocking_timeout_secs)"),
        check("vLLM, device killed mid-load: the turn", mid_load.turn_s, *hang),
        check("vLLM, slow-read device: the undisturbed load (worker's load_time_ns)", slow_load_s,
              lambda s: s >= SLOW_LOAD_MIN * read_delay_s, f">= {SLOW_LOAD_MIN * read_delay_s:g} s (READ_DELAY_MS)"),
        check("vLLM, slow-read device: lookup -> kill (the reads still in flight)", inflight.kill_after_lookup_s,
              lambda s: s < read_delay_s, f"< {read_delay_s:g} s (READ_DELAY_MS)"),
        check("vLLM, slow-read device killed: the load", inflight.load_s,
              lambda s: s < tv.BLOCKING_TIMEOUT_S + WAIT_SLACK_S,
              f"< {tv.BLOCKING_TIMEOUT_S + WAIT_SLACK_S:g} s (blocking_timeout_secs)"),
        check("vLLM, slow-read device killed: the turn", inflight.turn_s, *hang),
    ]
    details = {"master_stopped": {"lookup_s": stopped.lookup_s, "bind_s": stopped.bind_s, "turn_s": stopped.turn_s,
                                  "failed": [str(e) for e in stopped.failed],
                                  "identical": stopped.output == row["output"]},
               "device_killed_mid_load": {"load_s": mid_load.load_s, "turn_s": mid_load.turn_s,
                                          "load_errors": mid_load.worker["num_load_errors"],
                                          "identical": mid_load.output == row["output"]},
               "killed_under_inflight_reads": {"slow_load_s": slow_load_s,
                                               "kill_after_lookup_s": inflight.kill_after_lookup_s,
                                               "load_s": inflight.load_s, "turn_s": inflight.turn_s,
                                               "load_errors": inflight.worker["num_load_errors"],
                                               "identical": inflight.output == row["output"]}}
    return checks, details


PARTS = {"connector": connector_part, "vllm": vllm_part}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_connector_faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["all", *PARTS], default="all", help="which scenarios (default: all)")
    args = parser.parse_args(argv)
    checks, details = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-connector-faults-") as tmp:
        for name, part in PARTS.items():
            if args.part in ("all", name):
                (Path(tmp) / name).mkdir()
                got, details[name] = part(Path(tmp) / name)
                checks += got
    rows = [(c["what"], "-" if c["seconds"] is None else f"{c['seconds']:.2f} s", "",
             f"{c['bound']}{'' if c['ok'] else ' (missed)'}") for c in checks]
    for row in rows:
        print(f"  {row[0]:<72} {row[1]:>10}  {row[3]}")
    result_files.write("bench_connector_faults", rows, {"checks": checks, "scenarios": details}, argv)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
