"""cffi (API mode) build of the replay's native index: ``native/master_table.h`` (its calls) and the sources beside it
(``SOURCES``: every ``*.c`` there, behind the private ``mt_internal.h``).

As ``emulator/native_build.py`` builds the emulator's core: the cdef is cut out of the header (between its
cdef markers), the module's name carries a digest of the sources and flags
(``host_runtime.hymcache._master_table_<digest>``), so a process never loads a module built from other
sources and a changed source builds a new one on first import (``native_master.py``, through
``driver.native.load_or_build``, under a file lock). ``python -m host_runtime.hymcache.native_master_build``
builds it for the current sources and removes the modules built from earlier ones (``make native``).

Test-only variants (``mutation="EVICT_MRU"``, an ``MT_MUTATION_*`` name of the header) compile one planted
wrong decision in, as a module of their own: the side-by-side tests must catch it.
"""

from __future__ import annotations

from pathlib import Path

import cffi

from driver import native
from driver.native import cdef_of, compile_into, source_digest

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "native"
HEADER = NATIVE / "master_table.h"
SOURCES = tuple(sorted(NATIVE.glob("*.c")))  # the replay's loop links these too (host_runtime/replay/native_build.py)
DIGESTED = tuple(sorted(NATIVE.glob("*.h"))) + SOURCES  # what the module's name is a digest of
PACKAGE = "host_runtime.hymcache"
CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off"]
LOCK = NATIVE / "build.lock"  # git-ignored (native/.gitignore)


def module_name(mutation: str | None = None) -> str:
    """``host_runtime.hymcache._master_table_<digest of sources and flags>``, ``_<mutation>`` for a test
    variant."""
    name = f"{PACKAGE}._master_table_{source_digest(DIGESTED, CFLAGS)}"
    return f"{name}_{mutation.lower()}" if mutation else name


def make_ffi(mutation: str | None = None) -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(HEADER))
    macros = [("MT_MUTATION", f"MT_MUTATION_{mutation.upper()}")] if mutation else []
    ffi.set_source(module_name(mutation), '#include "master_table.h"', sources=[str(p) for p in SOURCES],
                   include_dirs=[str(NATIVE)], define_macros=macros, extra_compile_args=CFLAGS,
                   libraries=["m"])
    return ffi


def build(mutation: str | None = None) -> Path:
    """Compile the module into ``host_runtime/hymcache/`` (``compile_into``). Returns its path."""
    return compile_into(make_ffi(mutation), HERE)


def stale_modules() -> list[Path]:
    """Modules built from earlier sources (and test variants of them)."""
    return native.stale_modules(HERE, module_name())


def main() -> None:
    module = native.load_or_build(module_name(), build, LOCK)
    for old in stale_modules():
        old.unlink()
    print(module.__file__)


if __name__ == "__main__":
    main()
