"""cffi (API mode) build of the native trace reader, ``host_runtime/replay/native/trace_reader.{h,c}``.

The cdef is cut out of the header (between its cdef markers), as ``emulator/native_build.py`` does for the
device core. The module's name carries a digest of the sources and flags
(``host_runtime.replay._trace_reader_<digest>``): a process never loads a module built from other sources, and
a changed source builds a new one on first import of :mod:`host_runtime.replay.native_reader`.
``python -m host_runtime.replay.native_reader_build`` builds it (``make native``) and removes modules built from
earlier sources; it prints the module's path.
"""

from __future__ import annotations

from pathlib import Path

import cffi

from driver.native import build_main, cdef_of, compile_into, source_digest

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "native"
HEADER = NATIVE / "trace_reader.h"
SOURCE = NATIVE / "trace_reader.c"
SOURCES = (HEADER, SOURCE, NATIVE / "xxh3.h")  # what the module is built from (its name's digest)
PACKAGE = "host_runtime.replay"
CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"]
LOCK = NATIVE / "build.lock"  # git-ignored (native/.gitignore)


def module_name() -> str:
    """``host_runtime.replay._trace_reader_<digest of sources and flags>``."""
    return f"{PACKAGE}._trace_reader_{source_digest(SOURCES, CFLAGS)}"


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(HEADER))
    ffi.set_source(module_name(), '#include "trace_reader.h"', sources=[str(SOURCE)],
                   include_dirs=[str(NATIVE)], extra_compile_args=CFLAGS)
    return ffi


def build() -> Path:
    """Compile the module into ``host_runtime/replay/`` (``compile_into``). Returns its path."""
    return compile_into(make_ffi(), HERE)


def main() -> None:
    build_main(module_name(), build, LOCK, HERE)


if __name__ == "__main__":
    main()
