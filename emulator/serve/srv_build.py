"""cffi (API mode) build of ``emulator.serve._srv_<digest>``: the device side of the rings and the C serving
loop (``chm_srv.c``) with the wire structs they work on. The cdefs are cut out of the headers
(``driver.wire_build.cdef_of``), so the layouts stay written once, in ``driver/include/chm_wire.h``.

The module's name carries a digest of its sources and flags, as the native core's does: a process never
loads a module built from other sources (a stale build would disagree with ``server.py`` on the structs
they share), and a changed source builds a new module on first import. Built by ``make`` and, failing that,
on first import of :mod:`emulator.serve.server`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import cffi

from driver.native import compile_into
from driver.wire_build import INCLUDE, cdef_of

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "chm_srv.h", HERE / "chm_srv.c", INCLUDE / "chm_wire.h", INCLUDE / "chm_stats.h",
           INCLUDE / "chm_sync.h")
CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-std=gnu11"]
PREFIX = "_srv_"


def module_name() -> str:
    """``emulator.serve._srv_<digest of the sources and flags>``."""
    digest = hashlib.sha256()
    for part in [p.read_bytes() for p in SOURCES] + [" ".join(CFLAGS).encode()]:
        digest.update(part)
    return f"emulator.serve.{PREFIX}{digest.hexdigest()[:12]}"


MODULE = module_name()


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(INCLUDE / "chm_wire.h"))
    ffi.cdef(cdef_of(HERE / "chm_srv.h"))
    # The helpers' source is compiled inline, in a scratch folder: no object files land in the tree.
    ffi.set_source(MODULE, (HERE / "chm_srv.c").read_text(), include_dirs=[str(INCLUDE), str(HERE)],
                   extra_compile_args=CFLAGS)
    return ffi


def build() -> Path:
    """Compile the module next to this file (``compile_into``); remove the modules built from earlier sources.
    Returns its path."""
    target = compile_into(make_ffi(), HERE)
    current = MODULE.rsplit(".", 1)[1]
    for old in HERE.glob(f"{PREFIX}*.so"):
        if not old.name.startswith(current):
            old.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    build()
