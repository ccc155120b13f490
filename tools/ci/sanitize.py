"""`make sanitize`: libchm.so, the server's C loop and the native core built with ASan and UBSan, then the libchm
tests and the system test's C stress clients run against them. Any sanitizer report fails the job.

The builds go to build/sanitize/, never over the tree's:

* ``libchm/``: libchm.so.2 (``make -C libchm BUILD=...``), found first through ``LD_LIBRARY_PATH`` by the Python
  binding and by every C program the tests build against libchm (they carry a RUNPATH, which it overrides);
* ``modules/``: the server loop (``emulator.serve.srv_build``) and the native core (``emulator.native_build``),
  each built from its build module's own ``make_ffi()`` (its sources, flags and name: a core split into more
  files is built as the tree builds it) with the sanitizer flags added through ``CFLAGS``/``LDFLAGS``, and
  named by its full module name; ``sanitized_site/sitecustomize.py`` imports them in place of the tree's;
* ``reports/``: the sanitizers' reports, one file per process that had one: ASan's through its ``log_path``,
  UBSan's through ``ubsan_log_path.so`` (ubsan_log_path.c: UBSan beside ASan ignores ``log_path``).

Python itself is not instrumented: the ASan runtime is preloaded (``LD_PRELOAD``) into every process, and
its leak check is off (``detect_leaks=0``: the interpreter's own allocations at exit are no finding).

    python -m tools.ci.sanitize           # build what is missing, check, run, report
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SANITIZE = ROOT / "build" / "sanitize"
LIBDIR, MODULES, REPORTS = SANITIZE / "libchm", SANITIZE / "modules", SANITIZE / "reports"
SITE = Path(__file__).resolve().parent / "sanitized_site"
UBSAN_ROUTE_SOURCE = Path(__file__).resolve().parent / "ubsan_log_path.c"
UBSAN_ROUTE = SANITIZE / "ubsan_log_path.so"
SAN_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all")
STAMP = SANITIZE / "flags"  # the flags the builds here were made with: others are rebuilt
# The libchm tests cover the library's every entry point (rings, copy and zero-copy paths, prefetch, async,
# errors, closed handles) against a sanitized server and core; the system test runs the C stress client
# (tests/system/stress_client.c) and Python clients at once, one of them killed.
TESTS = ("tests/libchm", "tests/system/test_system.py::test_many_clients_and_a_killed_one",
         # calls libchm on a freed handle on purpose (chm.h: undefined, as after free; detected where cheap):
         # ASan rightly reports the use after free
         "--deselect", "tests/libchm/test_binding_edges.py::test_c_double_close_and_use_after_close_are_refused")
BUILDS = ("core", "server loop")
JOBS = 2
INSTALL_HINT = "the sanitizer runtimes come with gcc (libasan, libubsan: apt-get install gcc)"


def module_ffi(which: str):
    """The cffi build of ``which`` (one of BUILDS), as its build module makes it."""
    if which == "core":
        from emulator import native_build
        return native_build.make_ffi()
    from emulator.serve import srv_build
    return srv_build.make_ffi()


def module_name(ffi) -> str:
    return ffi._assigned_source[0]


def module_file(name: str) -> Path:
    return MODULES / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def build_module(which: str) -> None:
    """Compile ``which`` with the sanitizer flags ``CFLAGS``/``LDFLAGS`` carry (set by ``build_all``) into
    ``MODULES``, unless there already; remove its builds from earlier sources."""
    ffi = module_ffi(which)
    name = module_name(ffi)
    target = module_file(name)
    stem = name.rsplit("_", 1)[0] + "_"
    for old in MODULES.glob(f"{stem}*"):
        if old != target:
            old.unlink()
    if target.exists():
        return
    with tempfile.TemporaryDirectory(prefix="chm_sanitize_") as scratch:
        built = Path(ffi.compile(tmpdir=scratch, verbose=False))
        staged = MODULES / f".{os.getpid()}.{target.name}"
        shutil.copyfile(built, staged)
        os.replace(staged, target)


def build_env() -> dict[str, str]:
    flags = " ".join(SAN_FLAGS)
    return dict(os.environ, CFLAGS=f"-O1 -g {flags}", LDFLAGS=flags)


def build_all() -> None:
    """libchm (make) and both modules (a process each), two at a time."""
    flags = " ".join(SAN_FLAGS)
    if not STAMP.exists() or STAMP.read_text() != flags:
        shutil.rmtree(SANITIZE, ignore_errors=True)
    MODULES.mkdir(parents=True, exist_ok=True)
    STAMP.write_text(flags)
    env = build_env()
    cc = os.environ.get("CC", "cc")
    commands = [["make", "-s", "-C", str(ROOT / "libchm"), f"BUILD={LIBDIR}"],
                [cc, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(UBSAN_ROUTE),
                 str(UBSAN_ROUTE_SOURCE), "-ldl"]]
    commands += [[sys.executable, "-m", "tools.ci.sanitize", "--build", which] for which in BUILDS]
    with ThreadPoolExecutor(JOBS) as pool:
        runs = list(pool.map(lambda cmd: subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True),
                             commands))
    failed = [run for run in runs if run.returncode]
    for run in failed:
        print(f"sanitize: build failed: {' '.join(run.args)}\n{run.stdout}{run.stderr}", file=sys.stderr)
    if failed:
        if any("libasan" in run.stderr or "libubsan" in run.stderr for run in failed):
            print(f"sanitize: {INSTALL_HINT}", file=sys.stderr)
        raise SystemExit(1)


def runtime(library: str) -> str:
    """The sanitizer runtime ``library`` (libasan.so, libubsan.so) the compiler links."""
    cc = os.environ.get("CC", "cc")
    found = subprocess.run([cc, f"-print-file-name={library}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(found) or not os.path.exists(found):
        raise SystemExit(f"sanitize: {cc} has no {library}; {INSTALL_HINT}")
    return os.path.realpath(found)


def run_env() -> dict[str, str]:
    """Every process of the run: the ASan runtime preloaded, the sanitized builds found first, reports to
    ``REPORTS``."""
    def prepend(var: str, value: str, sep: str) -> str:
        return value + (sep + os.environ[var] if os.environ.get(var) else "")

    return dict(os.environ,
                LD_PRELOAD=prepend("LD_PRELOAD", f"{runtime('libasan.so')} {UBSAN_ROUTE}", " "),
                # handle_sigbus=0: SIGBUS is chm_mmap's documented answer to an access it cannot serve (the
                # tests expect the process to die of it), not a memory error of ours
                ASAN_OPTIONS=f"detect_leaks=0:halt_on_error=1:handle_sigbus=0:log_path={REPORTS}/asan",
                UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
                CHM_UBSAN_LOG_PATH=f"{REPORTS}/ubsan", CHM_UBSAN_RUNTIME=runtime("libubsan.so"),
                LD_LIBRARY_PATH=prepend("LD_LIBRARY_PATH", str(LIBDIR), ":"),
                PYTHONPATH=prepend("PYTHONPATH", str(SITE), ":"),
                CHM_SANITIZED_MODULES=str(MODULES))


# Run in a process of the job: are the sanitized builds the ones loaded?
CHECK = """
import sys
import emulator.native, emulator.serve.server, libchm
maps = open("/proc/self/maps").read()
for name in sys.argv[1:]:
    loaded = sys.modules.get(name)
    assert loaded is not None and loaded.__file__.startswith("{modules}"), (name, loaded and loaded.__file__)
assert "{libdir}/libchm.so" in maps, "libchm.so.2 is not the sanitized build"
assert "libasan" in maps, "the ASan runtime is not loaded"
"""


def check_loaded(env: dict[str, str]) -> None:
    names = [module_name(module_ffi(which)) for which in BUILDS]
    code = CHECK.format(modules=MODULES, libdir=LIBDIR)
    run = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"sanitize: the sanitized builds are not the ones loaded:\n{run.stdout}{run.stderr}")


def reports() -> list[Path]:
    return sorted(REPORTS.glob("*san.*")) if REPORTS.exists() else []


def main(argv: list[str]) -> int:
    if argv[:1] == ["--build"]:
        build_module(argv[1])
        return 0
    start = time.monotonic()
    build_all()
    built = time.monotonic()
    shutil.rmtree(REPORTS, ignore_errors=True)
    REPORTS.mkdir(parents=True)
    env = run_env()
    check_loaded(env)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                           env=env)
    found = reports()
    for report in found:
        print(f"sanitize: {report.relative_to(ROOT)}:\n{report.read_text()}", file=sys.stderr)
    elapsed = time.monotonic() - start
    if found or tests.returncode:
        why = f"{len(found)} sanitizer report(s)" if found else f"the tests failed (rc {tests.returncode})"
        print(f"sanitize: FAILED: {why} ({elapsed:.0f} s)", file=sys.stderr)
        return 1
    print(f"sanitize: no sanitizer report; build {built - start:.1f} s, all {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
