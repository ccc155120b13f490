"""cffi (API mode) build of the replay's request loop, ``host_runtime/replay/native/replay_loop.{h,c}``.

The loop calls the device core (``emulator/native/chm_core.c``) and the Master table
(``host_runtime/hymcache/native/master_table.c``) directly, on the structs the emulator's and the Master's own
modules made (passed in as pointers), so it is compiled with their sources: the same C, the same flags
(``-ffp-contract=off``: the timing model's doubles round as emulator/timing.py's do). As the other native
modules: the cdef is cut out of the header, the module's name carries a digest of every source and the flags
(``host_runtime.replay._replay_loop_<digest>``), ``python -m host_runtime.replay.replay_loop_build`` builds it
(``make native``) and removes modules built from earlier sources.
"""

from __future__ import annotations

from pathlib import Path

import cffi

from driver.native import build_main, cdef_of, compile_into, source_digest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NATIVE = HERE / "native"
CORE = ROOT / "emulator" / "native"
MASTER = ROOT / "host_runtime" / "hymcache" / "native"
HEADER = NATIVE / "replay_loop.h"
SOURCES = (HEADER, NATIVE / "replay_loop.c", CORE / "chm_core.h", CORE / "chm_core.c", MASTER / "master_table.h",
           MASTER / "master_table.c")
PACKAGE = "host_runtime.replay"
CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off"]
LOCK = NATIVE / "build.lock"  # git-ignored (native/.gitignore)


def module_name() -> str:
    """``host_runtime.replay._replay_loop_<digest of sources and flags>``."""
    return f"{PACKAGE}._replay_loop_{source_digest(SOURCES, CFLAGS)}"


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(HEADER))
    ffi.set_source(module_name(), '#include "replay_loop.h"',
                   sources=[str(p) for p in SOURCES if p.suffix == ".c"],
                   include_dirs=[str(NATIVE), str(CORE), str(MASTER)], extra_compile_args=CFLAGS, libraries=["m"])
    return ffi


def build() -> Path:
    """Compile the module into ``host_runtime/replay/`` (``compile_into``). Returns its path."""
    return compile_into(make_ffi(), HERE)


def main() -> None:
    build_main(module_name(), build, LOCK, HERE)


if __name__ == "__main__":
    main()
