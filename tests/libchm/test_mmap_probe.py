"""The kernel probe of chm_mmap (docs/mmap.md): tools/mmap_probe/, built with cc and run.

Each check the design relies on must pass where the kernel has it; where it lacks a feature the test skips,
naming it. A check the probe runs but that fails on a kernel that has the feature is a failure.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE_DIR = ROOT / "tools" / "mmap_probe"
SOURCES = ("uffd_probe.c", "probe_common.c", "probe_costs.c")
LINE = re.compile(r"^(?P<name>\w+): (?P<state>ok|missing)(?: \(errno (?P<errno>\d+): [^)]*\))?(?P<detail>.*)$")

# The kernel features the design needs (docs/mmap.md, "Mechanism"); without one, chm_mmap is -EOPNOTSUPP.
FEATURES = ("feature_MISSING_SHMEM", "feature_MINOR_SHMEM", "feature_SIGBUS", "feature_WP_HUGETLBFS_SHMEM")
# What the design does with them; each is run only where the features above are there.
BEHAVIOURS = ("register_missing_anon", "map_frame_on_fault", "withdraw_refaults", "punch_traps_minor",
              "punch_traps_missing", "wp_shmem_first_write", "sigbus_beyond_eof", "sigbus_blocked_faulter",
              "fault_cost_uffd_sigbus", "sigbus_mode_syscall_efault", "remote_writeprotect", "max_map_count",
              "per_frame_vmas", "pidfd_poll_death")


def run_probe(tmp_path: Path, env: dict | None = None) -> dict[str, re.Match]:
    """Build and run the probe; its checks by name."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build tools/mmap_probe/uffd_probe.c")
    exe = tmp_path / "uffd_probe"
    subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", *(str(PROBE_DIR / f) for f in SOURCES),
                    "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    checks = {}
    for line in out.splitlines()[1:]:  # the first line names the kernel
        m = LINE.match(line)
        assert m, f"probe line not in the 'name: ok|missing ...' form: {line!r}"
        checks[m["name"]] = m
    return checks


def require(checks: dict[str, re.Match]) -> None:
    """Skip, naming what is missing, where the kernel lacks userfaultfd or a feature the design needs."""
    for name in ("uffd_api", *FEATURES):
        m = checks.get(name)
        if m is None or m["state"] != "ok":
            pytest.skip(f"kernel lacks {name} ({m.group(0) if m else 'not probed'}): chm_mmap is -EOPNOTSUPP here")


def test_probe_checks_the_design_needs(tmp_path):
    checks = run_probe(tmp_path)
    require(checks)
    failed = [checks[n].group(0) if n in checks else f"{n}: not reported" for n in BEHAVIOURS
              if n not in checks or checks[n]["state"] != "ok"]
    assert not failed, "kernel checks the mmap design relies on failed:\n" + "\n".join(failed)


def test_probe_reports_the_fault_costs(tmp_path):
    checks = run_probe(tmp_path)
    require(checks)
    for name in ("fault_cost_uffd_sigbus", "fault_cost_uffd_mmap", "fault_cost_sigsegv_mmap", "punch_cost"):
        assert re.search(r"p50_ns=\d+", checks[name]["detail"]), checks[name].group(0)


def test_a_broken_check_fails(tmp_path):
    """PROBE_BREAK makes one check report missing: the assertion above would then fail, naming it."""
    import os

    checks = run_probe(tmp_path, env={**os.environ, "PROBE_BREAK": "punch_traps_minor"})
    require(checks)
    assert checks["punch_traps_minor"]["state"] == "missing"
    assert "broken on purpose" in checks["punch_traps_minor"]["detail"]
