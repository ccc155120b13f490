"""The benches check the code the emulator runs: the native core built with one planted wrong decision
(-DCHM_MUTATION=..., emulator/native/chm_core.h) is the reference of its block's bench, and the lockstep
checks of the corner-case sequence must report the mismatch, with and without idle/back-pressure
injection, against the unchanged RTL."""

from __future__ import annotations

import pytest

from driver.native import load_or_build
from emulator import native_build
from rtl_model.sim import default_params, run_bench

MUTATIONS = {  # CHM_MUTATION_* -> the bench whose reference it changes
    "LRU_RANK": "chm_frame_table",  # LRU's victim is the most recently used unpinned way
    "PREFETCH_WINDOW": "chm_prefetch_engine",  # an object filling the window exactly is refused
    "EXACT_FIT": "chm_write_admission",  # a write fitting the buffer exactly is refused
}


@pytest.mark.parametrize("mutation,block", MUTATIONS.items())
def test_a_mutated_native_core_fails_the_lockstep_bench(mutation, block, tmp_path):
    mutant = load_or_build(native_build.module_name(mutation), lambda: native_build.build(mutation),
                           native_build.HERE / "native_build.lock")  # built here, not inside the simulator
    assert mutant.lib.chm_core_mutation() == getattr(mutant.lib, f"CHM_MUTATION_{mutation}")
    result = run_bench(block, default_params(block), tmp_path / "sim", tests="test_corners", native_mutation=mutation)
    assert result.tests == 2, f"expected the two test_corners variants, ran {result.tests}"
    caught = {name for name, message in result.failures.items() if "lockstep mismatch" in message}
    assert caught == {"test_corners/stall=False", "test_corners/stall=True"}, \
        f"mutation {mutation} not caught as a lockstep mismatch: {result.failures}"
