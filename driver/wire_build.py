"""cffi (API mode) build of ``driver._wire``: the wire structs of
``include/chm_wire.h`` (the device side builds its ring helpers on the same cdef:
``emulator/serve/srv_build.py``).

The cdef is cut out of the headers themselves (between the "cdef" markers),
so the layout is written once, in C; the C compiler checks it when this
module is built. Built by ``make`` (``python -m driver.wire_build``) and,
failing that, on first import of :mod:`driver.wire`.
"""

import re
from pathlib import Path

import cffi

from driver import native

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
MODULE = "driver._wire"


STATS_HEADER = INCLUDE / "chm_stats.h"


def stats_fields(kind: str) -> tuple[str, ...]:
    """The field names of ``CHM_STATS_<kind>`` (COUNTERS, GAUGES or MAP) in chm_stats.h, in order."""
    text = STATS_HEADER.read_text()
    start = text.index(f"#define CHM_STATS_{kind}(X)")
    body = text[start: text.index("\n\n", start)]
    return tuple(re.findall(r"X\((\w+)\)", body))


def expand_stats_fields(text: str) -> str:
    """cffi's cdef parser takes no function-like macros: spell out ``CHM_STATS_FIELDS(CHM_STATS_U64)``."""
    fields = stats_fields("COUNTERS") + stats_fields("GAUGES") + stats_fields("MAP")
    return text.replace("CHM_STATS_FIELDS(CHM_STATS_U64)", " ".join(f"uint64_t {name};" for name in fields))


def cdef_of(header: Path) -> str:
    """The cffi-parsable part of a header (driver.native.cdef_of), its stats field list expanded."""
    return expand_stats_fields(native.cdef_of(header))


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(INCLUDE / "chm_wire.h"))
    ffi.set_source(MODULE, '#include "chm_wire.h"', include_dirs=[str(INCLUDE)], extra_compile_args=["-O2", "-Wall", "-std=gnu11"])
    return ffi


def build() -> None:
    """Compile next to this package (the repository is the install)."""
    root = HERE.parent
    make_ffi().compile(tmpdir=str(root), verbose=False)


if __name__ == "__main__":
    build()
