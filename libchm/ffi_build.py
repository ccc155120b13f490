"""cffi (API mode) build of ``libchm._chm``, the Python binding's C side.

It links the real ``libchm.so`` (built by ``make -C libchm``; found at run
time through an rpath to ``libchm/build``) and takes its declarations from
``include/chm.h`` itself (the text between the cdef markers).
"""

import subprocess
from pathlib import Path

import cffi

from driver.wire_build import expand_stats_fields

HERE = Path(__file__).resolve().parent
MODULE = "libchm._chm"


def make_ffi() -> cffi.FFI:
    text = (HERE / "include" / "chm.h").read_text()
    begin = text.index("*/", text.index("---- cdef begin ----")) + 2
    end = text.index("/* ---- cdef end ---- */")
    ffi = cffi.FFI()
    ffi.cdef(expand_stats_fields(text[begin:end]))
    ffi.cdef("static const int SUN_PATH_BYTES;")  # a node's socket path must fit (with its NUL), for errors
    ffi.set_source(MODULE, '#include "chm.h"\n#include <sys/un.h>\n'
                           'static const int SUN_PATH_BYTES = sizeof(((struct sockaddr_un *)0)->sun_path);',
                   include_dirs=[str(HERE / "include")],
                   library_dirs=[str(HERE / "build")], libraries=["chm"],
                   extra_link_args=["-Wl,-rpath,$ORIGIN/build"])
    return ffi


def build() -> None:
    subprocess.run(["make", "-s", "-C", str(HERE)], check=True)
    make_ffi().compile(tmpdir=str(HERE.parent), verbose=False)


if __name__ == "__main__":
    build()
