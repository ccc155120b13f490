"""The benches can fail: each block built with FAULT=1 (one decision flipped:
the victim way, the window-full limit, the admission limit) must be caught by
the lockstep checks of its corner-case sequence, with and without
idle/back-pressure injection."""

from __future__ import annotations

import pytest

from rtl_model.sim import BLOCKS, default_params, run_bench


@pytest.mark.parametrize("block", list(BLOCKS))
def test_flipped_decision_is_caught(block, tmp_path):
    result = run_bench(block, default_params(block), tmp_path / "sim", tests="test_corners", fault=1)
    assert result.tests == 2, f"expected the two test_corners variants, ran {result.tests}"
    caught = {name: msg for name, msg in result.failures.items() if "lockstep mismatch" in msg}
    assert set(caught) == {"test_corners/stall=False", "test_corners/stall=True"}, \
        f"fault not caught as a lockstep mismatch: {result.failures}"
