"""cffi (API mode) build of ``emulator.serve._srv``: the device side of the rings (``chm_srv.c``) with the
wire structs it works on. The cdefs are cut out of the headers (``driver.wire_build.cdef_of``), so the
layouts stay written once, in ``driver/include/chm_wire.h``. Built by ``make`` and, failing that, on
first import of :mod:`emulator.serve.server`."""

from pathlib import Path

import cffi

from driver.wire_build import INCLUDE, cdef_of

HERE = Path(__file__).resolve().parent
MODULE = "emulator.serve._srv"


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(INCLUDE / "chm_wire.h"))
    ffi.cdef(cdef_of(HERE / "chm_srv.h"))
    # The helpers' source is compiled inline: no object files land in the tree.
    ffi.set_source(MODULE, (HERE / "chm_srv.c").read_text(), include_dirs=[str(INCLUDE), str(HERE)],
                   extra_compile_args=["-O2", "-Wall", "-std=gnu11"])
    return ffi


def build() -> None:
    """Compile next to the package (the repository is the install)."""
    make_ffi().compile(tmpdir=str(HERE.parents[1]), verbose=False)


if __name__ == "__main__":
    build()
