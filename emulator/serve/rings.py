"""The device side's native module (``chm_srv.c``, built by srv_build.py): the wire's structs and constants,
the ring helpers and the C serving loop, and the names the server takes from them."""

from __future__ import annotations

from pathlib import Path

from emulator.native import ffi as core_ffi, lib as core_lib

from driver.native import load_or_build

from . import srv_build

_srv = load_or_build(srv_build.MODULE, srv_build.build, Path(srv_build.__file__).with_suffix(".lock"))
ffi, lib = _srv.ffi, _srv.lib  # the wire's structs and constants, the ring helpers and the C loop
# The controller's DRAM-hit read, as the C loop calls it (a pointer out of the native core's module).
READ_HIT = ffi.cast("chm_read_hit_fn",
                    int(core_ffi.cast("uintptr_t", core_ffi.addressof(core_lib, "chm_dev_read_hit"))))

# chm_mmap's DRAM-hit fault and its ack, likewise (the C loop serves them beside hit reads).
MAP_HIT = ffi.cast("chm_map_hit_fn", int(core_ffi.cast("uintptr_t", core_ffi.addressof(core_lib, "chm_dev_map_hit"))))
MAP_UNPIN = ffi.cast("chm_map_unpin_fn",
                     int(core_ffi.cast("uintptr_t", core_ffi.addressof(core_lib, "chm_dev_map_unpin"))))

STATS_FIELDS = [name for name, _ in ffi.typeof("struct chm_wire_stats").fields]
SQE_FIELDS = [name for name, _ in ffi.typeof("struct chm_sqe").fields]  # chm_srv_check's field index names these
TAIL_FIELD = "sq_tail"  # a bad entry count of its own: the sq tail further ahead than the ring holds
U64_MAX = (1 << 64) - 1
OPCODE_NAMES = {getattr(lib, n): n[len("CHM_OP_"):] for n in dir(lib) if n.startswith("CHM_OP_") and n != "CHM_OP_MAX"}
ATTACH_REQ_SIZE = ffi.sizeof("struct chm_attach_req")
MAX_BATCH = lib.CHM_SRV_BATCH
BULK_OPCODES = frozenset((lib.CHM_OP_READ, lib.CHM_OP_WRITE, lib.CHM_OP_PREFETCH))  # their work grows with len


def _u64(x: float) -> int:
    """A virtual time or duration as a completion's u64 field (never an exception: NaN is 0)."""
    return int(x) if 0 <= x <= U64_MAX else (U64_MAX if x > U64_MAX else 0)
