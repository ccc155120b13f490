"""`make lint`'s C half: every hand-written C file compiled with ``-Wall -Wextra -Werror``, each with the include
dirs, defines and flags its own build gives it, two at a time; fails naming each file and its warnings.

The native modules' sources are taken from their build modules at run time (``make_ffi()`` and
``ApiModule.ffi()``: the files they list, and the flags they pass), so a source added to or split out of a
module is checked as it is built. Folders whose files are globbed as well (a source not yet wired into a
build is still checked): libchm/src (flags: ``make -C libchm cflags``), emulator/serve, the replay's and the
Master table's native folders, the C programs under tests/, bench/ and examples/ (built against libchm),
and tools/ (the sanitizer job's preload).
cffi-generated sources (``_*.c``) are never checked.

    python -m tools.ci.cwarn [FILE ...]     # no FILE: all of them
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WARNINGS = ("-Wall", "-Wextra", "-Werror")
JOBS = 2
LIBCHM = ROOT / "libchm"
GLOBBED = ("libchm/src/*.c", "emulator/serve/*.c", "host_runtime/replay/native/*.c",
           "host_runtime/hymcache/native/*.c", "tests/**/*.c", "bench/*.c", "examples/*.c", "tools/**/*.c")


@dataclass(frozen=True)
class Unit:
    """One file and how it is compiled: ``flags`` (no warning flags), run in ``cwd``; ``origin`` names the build
    that compiles it so."""

    source: Path
    flags: tuple[str, ...]
    origin: str
    cwd: Path = ROOT


def generated(path: Path) -> bool:
    return path.name.startswith("_")  # cffi writes _<module>.c (driver/_wire.c, libchm/_chm.c, emulator/_*.c)


def ffi_units(ffi, origin: str, source_file: Path | None = None) -> list[Unit]:
    """The files a cffi build compiles and its flags. ``source_file``: the file whose text is the set_source
    source itself (chm_srv.c), not one of ``sources``."""
    _, _, _, kwds = ffi._assigned_source
    flags = [f"-I{d}" for d in kwds.get("include_dirs", ())]
    flags += [f"-D{name}" if value is None else f"-D{name}={value}" for name, value in kwds.get("define_macros", ())]
    flags += [f for f in kwds.get("extra_compile_args", ()) if f not in WARNINGS]
    files = [Path(p) for p in kwds.get("sources", ())] + ([source_file] if source_file else [])
    return [Unit(f.resolve(), tuple(flags), origin) for f in files]


def build_module_units() -> list[Unit]:
    from emulator import native_build
    from emulator.serve import srv_build
    from host_runtime.hymcache import native_master_build
    from host_runtime.replay import native_build as replay_build

    units = ffi_units(native_build.make_ffi(), "emulator.native_build")
    units += ffi_units(srv_build.make_ffi(), "emulator.serve.srv_build", srv_build.HERE / "chm_srv.c")
    units += ffi_units(native_master_build.make_ffi(), "host_runtime.hymcache.native_master_build")
    for module in replay_build.MODULES:
        units += ffi_units(module.ffi(), f"host_runtime.replay.native_build ({module.stem})")
    return units


def libchm_flags() -> tuple[str, ...]:
    out = subprocess.run(["make", "-s", "-C", str(LIBCHM), "cflags"], capture_output=True, text=True, check=True)
    return tuple(f for f in shlex.split(out.stdout) if f not in WARNINGS)


def program_flags(native_include: tuple[str, ...]) -> tuple[str, ...]:
    """The C programs of tests/, bench/ and examples/: against libchm's header (tests/serving.compile_c's flags),
    and the native core's, which native_core_stress.c drives directly."""
    return ("-O2", f"-I{LIBCHM / 'include'}", f"-I{ROOT / 'driver' / 'include'}", *native_include)


def all_units() -> list[Unit]:
    """Every hand-written C file once: as its build module compiles it, else as its folder's build would."""
    units: dict[Path, Unit] = {}
    for unit in build_module_units():
        units.setdefault(unit.source, unit)
    core = [u for u in units.values() if u.origin == "emulator.native_build"]
    native_include = tuple(f for f in core[0].flags if f.startswith("-I")) if core else ()
    lib = libchm_flags()
    built = list(units.values())
    for pattern in GLOBBED:
        for path in sorted(ROOT.glob(pattern)):
            path = path.resolve()
            if path in units or generated(path):
                continue
            folder_peer = next((u for u in built if u.source.parent == path.parent), None)
            if path.parent == LIBCHM / "src":
                units[path] = Unit(path, lib, "libchm/Makefile", LIBCHM)
            elif folder_peer is not None:
                units[path] = Unit(path, folder_peer.flags, f"{folder_peer.origin}, as its folder", folder_peer.cwd)
            else:
                units[path] = Unit(path, program_flags(native_include), "a C program against libchm")
    return sorted(units.values(), key=lambda u: u.source)


def compile_unit(unit: Unit) -> tuple[Unit, str | None]:
    """``(unit, None)`` when it compiles cleanly, else ``(unit, the compiler's output)``."""
    if not unit.source.exists():
        return unit, f"listed by {unit.origin}, but missing"
    cc = os.environ.get("CC", "cc")
    cmd = [cc, *unit.flags, *WARNINGS, "-c", "-o", os.devnull, str(unit.source)]
    run = subprocess.run(cmd, cwd=unit.cwd, capture_output=True, text=True)
    if run.returncode == 0 and not run.stderr.strip():
        return unit, None
    return unit, f"$ (cd {unit.cwd} && {shlex.join(cmd)})\n{run.stdout}{run.stderr}".rstrip()


def first_diagnostic(output: str) -> str:
    for line in output.splitlines():
        if ": error:" in line or ": warning:" in line:
            return line.strip()
    return output.splitlines()[-1] if output else ""


def main(argv: list[str]) -> int:
    start = time.monotonic()
    units = all_units()
    if argv:
        wanted = {Path(a).resolve() for a in argv}
        units = [u for u in units if u.source in wanted]
    with ThreadPoolExecutor(JOBS) as pool:
        results = list(pool.map(compile_unit, units))
    failed = [(unit, output) for unit, output in results if output is not None]
    for unit, output in failed:
        print(f"cwarn: {unit.source.relative_to(ROOT)} ({unit.origin}):\n{output}\n", file=sys.stderr)
    elapsed = time.monotonic() - start
    if failed:
        print(f"cwarn: FAILED, {len(failed)} of {len(units)} C files with warnings ({' '.join(WARNINGS)}):",
              file=sys.stderr)
        for unit, output in failed:
            print(f"  {unit.source.relative_to(ROOT)}: {first_diagnostic(output)}", file=sys.stderr)
        return 1
    print(f"cwarn: {len(units)} hand-written C files compile cleanly with {' '.join(WARNINGS)} ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
