"""cffi (API mode) builds of the replay's native modules (``driver.native.ApiModule``: the cdef cut out of each
header, the module's name carrying a digest of its sources and flags, so a process never loads a module built
from other sources and a changed source builds a new one on first import):

* ``TRACE_READER``: the trace reader, ``native/trace_reader.{h,c}`` (``native_reader.py``);
* ``REPLAY_LOOP``: the request loop, ``native/replay_loop.h`` (the cdef) and ``LOOP_SOURCES`` behind the private
  ``native/replay_loop_internal.h`` (``native_replay.py``). It calls the device core
  (``emulator/native/``) and the Master table (``host_runtime/hymcache/native/``) on the structs the
  emulator's and the Master's own modules made, so it is compiled with their sources (``SOURCES`` of
  emulator/native_build.py and hymcache/native_master_build.py: one list each) and their flags
  (``-ffp-contract=off``: the timing model's doubles round as emulator/timing.py's do).

``python -m host_runtime.replay.native_build`` builds both (``make native``) and removes modules built from
earlier sources.
"""

from __future__ import annotations

from pathlib import Path

from driver.native import ApiModule
from emulator import native_build as core_build
from host_runtime.hymcache import native_master_build as master_build

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "native"
CORE, MASTER = core_build.NATIVE, master_build.NATIVE
LOCK = NATIVE / "build.lock"  # git-ignored (native/.gitignore)
CFLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra", "-Werror")

TRACE_READER = ApiModule(
    "host_runtime.replay", "trace_reader", HERE, NATIVE / "trace_reader.h", (NATIVE / "trace_reader.c",),
    (NATIVE / "trace_reader.h", NATIVE / "trace_reader.c", NATIVE / "xxh3.h"), (NATIVE,), CFLAGS, LOCK)

# The loop's own files: its calls and streams (feed), the heap and a request's steps (loop), the rows (results).
LOOP_SOURCES = (NATIVE / "replay_feed.c", NATIVE / "replay_loop.c", NATIVE / "replay_results.c")
REPLAY_LOOP = ApiModule(
    "host_runtime.replay", "replay_loop", HERE, NATIVE / "replay_loop.h",
    LOOP_SOURCES + core_build.SOURCES + master_build.SOURCES,
    (NATIVE / "replay_loop.h", NATIVE / "replay_loop_internal.h", *LOOP_SOURCES, *core_build.DIGESTED,
     *master_build.DIGESTED),
    (NATIVE, CORE, MASTER), CFLAGS + ("-ffp-contract=off",), LOCK, ("m",))

MODULES = (TRACE_READER, REPLAY_LOOP)

if __name__ == "__main__":
    for module in MODULES:
        module.main()
