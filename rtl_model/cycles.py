"""The cycle table: cycles per operation measured on the RTL, and the link to
the emulator's timing profiles.

``python -m rtl_model.cycles`` runs every block's ``test_cycles`` bench on its
default parameters and prints the table; ``--write`` stores it in
``rtl_model/cycles.json`` (checked in). The profiles' ``[controller]`` fields
named in PROFILE_LINKS must equal ``profile_fields(table)``;
tests/rtl_model/test_cycles_drift.py fails when the RTL, the table or a
profile drift apart.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from rtl_model.sim import BLOCKS, CYCLES_TABLE, default_params, load_cycle_table, run_bench

# profile field -> (block, measurement, why this measurement)
PROFILE_LINKS: dict[str, tuple[str, str, str]] = {
    "cycles_per_lookup": (
        "chm_frame_table", "lookup_interval",
        "a lookup occupies the frame table from one accepted command to the next"),
    "cycles_per_admission": (
        "chm_write_admission", "admission_interval",
        "one check-and-reserve per cycle, back to back"),
    "cycles_per_prefetch_page": (
        "chm_prefetch_engine", "issue_to_ready_per_page",
        "each extra page of an object adds this much to issue-to-ready (fetch issue and arrival, one per cycle)"),
}
# cycles_per_command (decode + dispatch) has no block in rtl_model: it stays provisional.
PROVISIONAL = ("cycles_per_command",)
PROFILES = ("small", "paper", "cmmh")


def profile_fields(table: dict) -> dict[str, int]:
    """The profile's [controller] values that follow from a cycle table (whole cycles, rounded up)."""
    out = {}
    for field, (block, key, _) in PROFILE_LINKS.items():
        out[field] = math.ceil(table["measured"][block]["cycles"][key])
    return out


def measure(build_root: Path, sim: str | None = None) -> dict:
    """Run every block's test_cycles on its default parameters; returns the table."""
    measured = {}
    for block in BLOCKS:
        result = run_bench(block, default_params(block), build_root / block, sim=sim, tests="test_cycles")
        if not result.passed or result.cycles is None:
            raise RuntimeError(f"{block}: test_cycles failed: {result.failures or 'no measurement written'}")
        measured[block] = {"params": result.cycles["params"], "cycles": result.cycles["cycles"]}
    table = {"measured": measured, "clock": "controller cycles (rtl_model benches, no idle or back-pressure)"}
    table["profile"] = {field: {"value": value, "from": f"{PROFILE_LINKS[field][0]}.{PROFILE_LINKS[field][1]}",
                                "why": PROFILE_LINKS[field][2]}
                        for field, value in profile_fields(table).items()}
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtl_model.cycles", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"store the table in {CYCLES_TABLE}")
    parser.add_argument("--sim", choices=("icarus", "verilator"), help="simulator (default: $SIM or icarus)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chm_rtl_cycles_") as tmp:
        table = measure(Path(tmp), args.sim)
    print(json.dumps(table, indent=2))
    if args.write:
        CYCLES_TABLE.write_text(json.dumps(table, indent=2) + "\n")
        print(f"wrote {CYCLES_TABLE}", file=sys.stderr)
    elif CYCLES_TABLE.exists() and load_cycle_table()["measured"] != table["measured"]:
        print(f"differs from the checked-in {CYCLES_TABLE}; rerun with --write and update the profiles", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
