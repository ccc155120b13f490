"""cffi (API mode) build of ``driver._wire``: the wire structs of
``include/chm_wire.h`` and the server's ring helpers (``src/chm_srv.c``).

The cdef is cut out of the headers themselves (between the "cdef" markers),
so the layout is written once, in C; the C compiler checks it when this
module is built. Built by ``make`` (``python -m driver.wire_build``) and,
failing that, on first import of :mod:`driver.wire`.
"""

from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
MODULE = "driver._wire"


def cdef_of(header: Path) -> str:
    """The cffi-parsable part of a header: the text between its cdef markers."""
    text = header.read_text()
    begin, end = "/* ---- cdef begin ---- */", "/* ---- cdef end ---- */"
    return text[text.index(begin) + len(begin): text.index(end)]


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(INCLUDE / "chm_wire.h"))
    ffi.cdef(cdef_of(INCLUDE / "chm_srv.h"))
    # The helpers' source is compiled inline: no object files land in the tree.
    ffi.set_source(MODULE, (HERE / "src" / "chm_srv.c").read_text(), include_dirs=[str(INCLUDE)], extra_compile_args=["-O2", "-Wall", "-std=gnu11"])
    return ffi


def build() -> None:
    """Compile next to this package (the repository is the install)."""
    root = HERE.parent
    make_ffi().compile(tmpdir=str(root), verbose=False)


if __name__ == "__main__":
    build()
