"""Every field of struct chm_sqe at the boundaries of its own width, on both serving paths (issue #21).

Each test drives one field through 0, 1, max-1, max (and 2^32, 2^63, 2^64-1 for the 64-bit ones, and
the negatives of the signed reading) for every opcode that reads it, from a raw client of its own, and
asserts that the device is alive, that a libchm client beside it still writes and reads its own bytes,
and that the bad client got the errno the wire's rules (chm_wire.h) give, counted under that field."""

from __future__ import annotations

import ctypes
import errno
import os
import random
from collections import Counter

import pytest

import libchm
from driver.wire import ffi, lib, read_node
from tests.driver.rawclient import RawClient
from tests.emulator.serve.serving import Server

MiB = 1 << 20
READ, WRITE, PREFETCH, WAIT, RELEASE = (lib.CHM_OP_READ, lib.CHM_OP_WRITE, lib.CHM_OP_PREFETCH, lib.CHM_OP_WAIT,
                                        lib.CHM_OP_RELEASE)
STATS_JSON = lib.CHM_OP_STATS_JSON
MAP_FAULT, MAP_ACK = lib.CHM_OP_MAP_FAULT, lib.CHM_OP_MAP_ACK
FLAGS_ALLOWED = {WAIT: lib.CHM_WAIT_LOOK, MAP_FAULT: lib.CHM_FAULT_WRITE, MAP_ACK: lib.CHM_ACK_FAILED}
OPCODES = range(1, lib.CHM_OP_MAX + 1)
STAGING = MiB  # the bad clients' staging buffer
BAD_ADDR = 32 * MiB  # where the bad clients' valid reads and writes go
GOOD_ADDR = 5 * 2**30 + 7 * 65536  # the good client's bytes: no bad client's boundary value reaches them

# Boundary values of each width. The unsigned ones include the negatives read as signed (-1 = max, -2 = max-1,
# the most negative = 2^(bits-1), -2^32); the signed ones are given as the signed numbers themselves.
U8 = [0, 1, 2, 127, 128, 254, 255]
U16 = [0, 1, 2**15, 2**16 - 2, 2**16 - 1]
U32 = [0, 1, 2**31, 2**32 - 2, 2**32 - 1]
U64 = [0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 2**32, 2**64 - 2, 2**64 - 1]
I64 = [0, 1, 2**32, 2**63 - 2, 2**63 - 1, -1, -2, -2**32, -2**63 + 1, -2**63]
WIDTHS = {"opcode": U8, "flags": U8, "rsvd0": U16, "rsvd1": U32, "user_data": U64, "addr": U64, "len": U64,
          "buf_offset": U64, "handle": I64, "timeout_ns": I64, "rsvd2": U64}


def wire_refusal(e: dict, cap: int, staging: int) -> tuple[str, int] | None:
    """The field the device must refuse in entry ``e`` and its errno, by chm_wire.h's rules (in Python's
    unbounded integers: an independent statement of chm_srv_check), or None if the entry is well formed."""
    g = e.get
    op = g("opcode", 0)
    if not 1 <= op <= lib.CHM_OP_MAX:
        return "opcode", errno.EINVAL
    if g("flags", 0) & ~FLAGS_ALLOWED.get(op, 0):
        return "flags", errno.EINVAL
    for name in ("rsvd0", "rsvd1", "rsvd2"):
        if g(name, 0):
            return name, errno.EINVAL
    addr, length, off = g("addr", 0), g("len", 0), g("buf_offset", 0)
    if op in (READ, WRITE, PREFETCH):
        if length == 0:
            return "len", errno.EINVAL
        if addr >= cap:
            return "addr", errno.ERANGE
        if addr + length > cap:
            return "len", errno.ERANGE
    if op in (READ, WRITE, STATS_JSON):
        if length > staging:
            return "len", errno.EFAULT
        if off + length > staging:
            return "buf_offset", errno.EFAULT
    if op in (WAIT, RELEASE) and g("handle", 0) < 1:
        return "handle", errno.EINVAL
    if op in (MAP_FAULT, MAP_ACK):
        if addr >= cap:
            return "addr", errno.ERANGE
        if (length == 0) if op == MAP_FAULT else (length != 0):
            return "len", errno.EINVAL
        if off:
            return "buf_offset", errno.EINVAL
        if (g("handle", 0) != 0) if op == MAP_FAULT else (g("handle", 0) < 1):
            return "handle", errno.EINVAL
        if g("timeout_ns", 0):
            return "timeout_ns", errno.EINVAL
        return "opcode", errno.EINVAL  # well formed, but this raw client sent no map request (chm_mmap)
    return None


class Device:
    """A served device, a libchm client on it, and what the tests check after every probe."""

    def __init__(self, srv: Server):
        self.srv, self.node = srv, srv.node
        self.cap = read_node(srv.node)["capacity_bytes"]
        self.good = libchm.Device(srv.path, staging_bytes=MiB)
        self.rng = random.Random(21)

    def check(self) -> None:
        """The device is alive and the good client writes and reads its own bytes back."""
        assert self.srv.proc.poll() is None, self.srv.proc.stderr.read()
        data = self.rng.randbytes(8192)
        assert self.good.write(GOOD_ADDR, data) == len(data)
        assert self.good.read(GOOD_ADDR, len(data)) == data


@pytest.fixture(scope="module", params=[True, False], ids=["native-loop", "python-loop"])
def device(request, tmp_path_factory):
    args = () if request.param else ("--no-native-hits",)
    with Server(tmp_path_factory.mktemp("media"), None, *args) as srv:
        dev = Device(srv)
        yield dev
        dev.good.close()


def submit(c: RawClient, user_data: int, **fields) -> int:
    c.push(user_data=user_data, **fields)
    (ud, res), = c.reap(1)
    assert ud == user_data
    return res


def base_entry(op: int, handle: int = 0) -> dict:
    """A well-formed entry of opcode ``op`` (the probes change one field of it)."""
    if op in (READ, WRITE):
        return dict(opcode=op, addr=BAD_ADDR, len=4096, buf_offset=0)
    if op == PREFETCH:
        return dict(opcode=op, addr=BAD_ADDR, len=65536)
    if op == WAIT:
        return dict(opcode=op, handle=handle, timeout_ns=-1)
    if op == RELEASE:
        return dict(opcode=op, handle=handle)
    if op == STATS_JSON:
        return dict(opcode=op, len=65536, buf_offset=0)
    if op == MAP_FAULT:
        return dict(opcode=op, addr=BAD_ADDR, len=65536)
    if op == MAP_ACK:
        return dict(opcode=op, addr=BAD_ADDR, handle=1 << 32)
    return dict(opcode=op)


def probe(dev: Device, op: int, field: str, values, entry=None, extra=None) -> Counter:
    """Submit ``entry`` (default: opcode ``op``'s base entry) with ``field`` set to each of ``values``, from a raw
    client of its own (``extra``: more fields of every entry); check each result against the wire's rules and the per-field count the device keeps.
    Returns the bad entries it counted."""
    bad = RawClient(dev.node, staging=STAGING)
    own: set[int] = set()
    counted: Counter = Counter()
    try:
        handle = 0
        if op in (WAIT, RELEASE):  # a handle of its own, staged (so any timeout_ns finds it ready)
            handle = submit(bad, 1, opcode=PREFETCH, addr=BAD_ADDR, len=65536)
            assert handle > 0
            own.add(handle)
            assert submit(bad, 2, opcode=WAIT, handle=handle, timeout_ns=-1) == 0
        for i, value in enumerate(values):
            e = {**(entry if entry is not None else base_entry(op, handle)), **(extra or {}), field: value}
            ud = e.pop("user_data", (i + 1) * 0x0101010101)  # echoed: it says which entry a completion answers
            res = submit(bad, ud, **e)
            refusal = wire_refusal(e, dev.cap, STAGING)
            if refusal is not None:
                assert res == -refusal[1], (e, res, refusal)
                counted[refusal[0]] += 1
                continue
            assert_served(bad, e, res, own)
        stats = bad.stats_json()
        assert stats["bad_entries"] == dict(counted), stats["last_error"]
        assert stats["client_id"] == bad.hdr.client_id
        for h in own:  # leave the window as found
            submit(bad, 3, opcode=RELEASE, handle=h)
    finally:
        bad.close()
    dev.check()
    return counted


def assert_served(c: RawClient, e: dict, res: int, own: set[int]) -> None:
    """The result of a well-formed entry."""
    op = e["opcode"]
    if op == READ:
        assert res == e["len"], (e, res)
    elif op == WRITE:
        assert res in (e["len"], -errno.EAGAIN), (e, res)  # EAGAIN: the write buffer is full (a state, not a field)
    elif op == PREFETCH:
        if res > 0:
            assert submit(c, 4, opcode=RELEASE, handle=res) == 0
        else:  # larger than this client's share of the window: the device's limit, not a malformed field
            assert res in (-errno.EINVAL, -errno.EBUSY) and e["len"] > 4 * MiB, (e, res)
    elif op in (WAIT, RELEASE):
        assert res == (0 if e["handle"] in own else -errno.EINVAL), (e, res)
        if op == RELEASE and res == 0:
            own.discard(e["handle"])
    elif op == STATS_JSON:
        assert res > 0 or (res == -errno.ENOSPC and e.get("len", 0) < 4096), (e, res)
    else:
        assert res == 0, (e, res)


def test_the_field_indices_are_the_struct_order():
    # chm_srv_check names a field by its CHM_SQE_* index; server.py turns it into a name from the struct itself.
    names = [name for name, _ in ffi.typeof("struct chm_sqe").fields]
    assert list(WIDTHS) == names
    from emulator.serve.server import lib as srv_lib
    assert [getattr(srv_lib, f"CHM_SQE_{n.upper()}") for n in names] == list(range(len(names)))


def test_opcode(device):
    # Every other field 0: valid opcodes whose len or handle may not be 0 are refused for that field.
    counted = probe(device, 0, "opcode", sorted(set(U8) | set(OPCODES) | {lib.CHM_OP_MAX + 1}), entry={})
    assert counted["opcode"] == len(set(U8) - set(OPCODES) | {lib.CHM_OP_MAX + 1})


@pytest.mark.parametrize("field", ["flags", "rsvd0", "rsvd1", "rsvd2"])
def test_flags_and_reserved_fields(device, field):
    for op in OPCODES:  # every opcode reads them
        counted = probe(device, op, field, WIDTHS[field])
        allowed = {0, FLAGS_ALLOWED[op]} if field == "flags" and op in FLAGS_ALLOWED else {0}
        assert counted[field] == len(set(WIDTHS[field]) - allowed), op


def test_user_data_is_echoed_whatever_it_is(device):
    for op in (lib.CHM_OP_NOP, READ, 0):  # 0: a bad entry echoes it too
        probe(device, op, "user_data", U64, entry=base_entry(op) if op else {"opcode": 0})


def test_addr(device):
    cap = device.cap
    edges = [cap - 4096, cap - 4095, cap - 1, cap, cap + 1]
    for op in (READ, WRITE, PREFETCH):
        counted = probe(device, op, "addr", U64 + edges)
        length = base_entry(op)["len"]
        assert counted["addr"] == sum(v >= cap for v in U64 + edges)
        assert counted["len"] == sum(cap - length < v < cap for v in U64 + edges)  # addr + len past the end
    probe(device, lib.CHM_OP_NOP, "addr", U64)  # read by nothing else: never refused


def test_len(device):
    cap = device.cap
    edges = [STAGING - 1, STAGING, STAGING + 1, cap - BAD_ADDR, cap - BAD_ADDR + 1, cap, cap + 1]
    for op in (READ, WRITE, PREFETCH, STATS_JSON):
        counted = probe(device, op, "len", U64 + edges)
        assert counted["len"] > 0
    probe(device, lib.CHM_OP_FLUSH, "len", U64)


def test_buf_offset(device):
    for op in (READ, WRITE, STATS_JSON):
        length = base_entry(op)["len"]
        edges = [STAGING - length - 1, STAGING - length, STAGING - length + 1, STAGING]
        counted = probe(device, op, "buf_offset", U64 + edges)
        assert counted["buf_offset"] == sum(v > STAGING - length for v in U64 + edges)
    probe(device, PREFETCH, "buf_offset", U64)  # a prefetch has no staging range


def test_handle(device):
    for op in (WAIT, RELEASE):
        counted = probe(device, op, "handle", I64)
        assert counted["handle"] == sum(v < 1 for v in I64)
    probe(device, READ, "handle", I64)


def test_timeout_ns(device):
    # Any i64 is a timeout (< 0: none); the handle is staged, so every wait is answered at once.
    assert probe(device, WAIT, "timeout_ns", I64) == Counter()
    assert probe(device, WAIT, "timeout_ns", I64, extra={"flags": lib.CHM_WAIT_LOOK}) == Counter()
    probe(device, lib.CHM_OP_STATS, "timeout_ns", I64)


def test_a_wait_with_the_longest_timeout_on_media_reads(device):
    # Parked on its media reads with timeout_ns 2^63-1: answered when they land, and no clock runs off.
    bad = RawClient(device.node, staging=STAGING)
    try:
        h = submit(bad, 1, opcode=PREFETCH, addr=4 * 2**30 + 3 * 65536, len=65536)
        assert h > 0
        assert submit(bad, 2, opcode=WAIT, handle=h, timeout_ns=2**63 - 1) == 0
        bad.push(user_data=3, opcode=lib.CHM_OP_NOP)
        bad.reap(1)
        clock = bad.cq[(bad.head - 1) % bad.cq_entries].clock_ns
        assert clock < 2**40, clock  # modelled nanoseconds of a few commands, not the timeout
    finally:
        bad.close()
    device.check()


def _qp_mapping_start(client_id: int) -> int:
    """lo: the start of this process's mapping of queue pair ``client_id`` (the issue's /proc/self/maps step)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith((f"/memfd:chm-qp-{client_id} (deleted)", f"/memfd:chm-qp-{client_id}")):
                return int(line.split("-", 1)[0], 16)
    raise AssertionError(f"no chm-qp-{client_id} mapping")


def test_the_issue_reproduction(device):
    """Issue #21: one READ with len 2^64-1, written straight into the ring, ended `chm serve` (OverflowError),
    and a client that had written 16 MiB, acknowledged but not yet flushed, lost the device."""
    acked = random.Random(2121).randbytes(16 * MiB)
    acked_at = device.cap // 2 // MiB * MiB
    assert device.good.write(acked_at, acked) == len(acked)
    bad = RawClient(device.node, staging=STAGING)
    try:
        lo = _qp_mapping_start(bad.hdr.client_id)
        u32 = lambda off: ctypes.c_uint32.from_address(lo + off)  # noqa: E731
        sq_off = ctypes.c_uint64.from_address(lo + 24).value
        n, tail = u32(12).value, u32(192).value
        entry = __import__("struct").pack("<BBHIQQQQqqQ", 2, 0, 0, 0, 7, 0, 2**64 - 1, 0, 0, 0, 0)
        ctypes.memmove(lo + sq_off + 64 * (tail % n), entry, len(entry))
        u32(192).value = tail + 1
        os.eventfd_write(bad.evfd, 1)
        assert bad.reap(1) == [(7, -errno.ERANGE)]  # len: addr 0 + len passes the device's end
        bad.tail = tail + 1
        assert submit(bad, 8, opcode=lib.CHM_OP_NOP) == 0  # one bad entry does not detach it
        assert bad.stats_json()["bad_entries"] == {"len": 1}
    finally:
        bad.close()
    device.check()
    assert device.good.read(acked_at, len(acked)) == acked  # the other client's bytes
    with libchm.Device(device.srv.path, staging_bytes=MiB) as other:  # a new client attaches: no ENODEV
        assert other.write(0, b"after") == 5 and other.read(0, 5) == b"after"
