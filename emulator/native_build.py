"""cffi (API mode) build of the native core: ``emulator/native/chm_core.h`` (the public header, the cdef) and
the sources beside it (``SOURCES``: every ``*.c`` there, behind the private ``chm_core_internal.h`` and
``policy.h``).

The cdef is cut out of the header (between its cdef markers), so every
constant, struct and signature is written once, in C. The module's name
carries a digest of the sources, the headers and the flags (``emulator._chm_core_<digest>``):
a process never loads a module built from other sources, and a changed
source builds a new module on first import. Built by ``make`` (``python -m
emulator.native``) and, failing that, on first import of
:mod:`emulator.native`.

Test-only variants (``mutation="LRU_RANK"``, a ``CHM_MUTATION_*`` name of the
header) compile one planted wrong decision in, as a module of their own:
``tests/rtl_model/test_native_mutations.py`` checks the RTL benches catch it.
"""

from __future__ import annotations

from pathlib import Path

import cffi

from driver import native
from driver.native import cdef_of, compile_into, source_digest

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "native"
HEADER = NATIVE / "chm_core.h"
SOURCES = tuple(sorted(NATIVE.glob("*.c")))  # the replay's loop links these too (host_runtime/replay/native_build.py)
DIGESTED = tuple(sorted(NATIVE.glob("*.h"))) + SOURCES  # what the module's name is a digest of
PACKAGE = "emulator"
# No fused multiply-add: the timing model's doubles must round as emulator/timing.py's do.
CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off"]
MUTATION_ENV = "CHM_CORE_MUTATION"  # tests only: emulator.native loads the variant this names


def module_name(mutation: str | None = None) -> str:
    """``emulator._chm_core_<digest of sources and flags>``, with ``_<mutation>`` for a test variant."""
    name = f"{PACKAGE}._chm_core_{source_digest(DIGESTED, CFLAGS)}"
    return f"{name}_{mutation.lower()}" if mutation else name


def make_ffi(mutation: str | None = None) -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(HEADER))
    macros = [("CHM_MUTATION", f"CHM_MUTATION_{mutation.upper()}")] if mutation else []
    ffi.set_source(module_name(mutation), '#include "chm_core.h"', sources=[str(p) for p in SOURCES],
                   include_dirs=[str(NATIVE)], define_macros=macros, extra_compile_args=CFLAGS)
    return ffi


def build(mutation: str | None = None) -> Path:
    """Compile the module into ``emulator/`` (``compile_into``). Returns its path."""
    return compile_into(make_ffi(mutation), HERE)


def stale_modules() -> list[Path]:
    """Modules built from earlier sources (``make`` removes them)."""
    return native.stale_modules(HERE, module_name())

