"""MAP_FAULT and MAP_ACK from a raw client that holds a mapping (chm_mmap's wire, issue 26): every field at its
width's boundaries, then a seeded fuzzer of both, against an independent statement of the rules.

The rules (chm_wire.h; mapping.py for those only the device's state can judge): first the stateless checks of
test_ring_fields.wire_refusal; then, for MAP_FAULT, addr a multiple of page_size (else -EINVAL) inside the mapped
[dev_addr, dev_addr + len) (else -ERANGE), len exactly page_size (-EINVAL), all counted as bad entries of that
field; a client cut off for expired leases gets -EPERM and one that holds as many leases as its ring has
entries -EBUSY (states, not fields); otherwise a lease > 0 whose frame (low 32 bits) is below the device's DRAM
frames, never repeated for the client, pinned with the faulted page in it until acked. MAP_ACK: the handle must
be a lease this client holds for page addr, else -EINVAL counted under "handle"; an acked lease ends.

After every test the device is alive, a libchm client beside it writes and reads its own bytes, and once the raw
client is gone a libchm client reads every page of a range twice the size of DRAM (no frame stayed pinned)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import random
import socket
from collections import Counter

import pytest

import libchm
from driver.wire import ffi, lib, read_node
from emulator.serve.limits import MAP_LEASE_MS_RANGE
from tests.driver.rawclient import RawClient, device_barrier, wait_for
from tests.emulator.serve.serving import Server
from tests.emulator.serve.test_ring_fields import (I64, MAP_ACK, MAP_FAULT, STAGING, U64, WIDTHS,
                                                   Device, wire_refusal)
from tests.libchm.test_mmap import SMALL_DRAM

SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}[platform.machine()]
UFFD_API = 0xAA
UFFDIO_API = (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
BASE = 1 << 40  # the raw clients' address of their mapping: never registered, so write-protecting it fails harmlessly
FLUSH = lib.CHM_OP_FLUSH
MAP_PAGES = 64  # the probes' and the fuzzer's mapping
SEED = int(os.environ.get("CHM_FUZZ_SEED", "2600"))
ROUNDS = int(os.environ.get("CHM_FUZZ_ROUNDS", "300"))
_libc = ctypes.CDLL(None, use_errno=True)


def userfaultfd() -> int:
    """A real userfaultfd, its API handshake done (the device checks that the fd is one)."""
    fd = _libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        pytest.skip(f"userfaultfd: {os.strerror(ctypes.get_errno())}")
    api = (ctypes.c_uint64 * 3)(UFFD_API, 0, 0)  # struct uffdio_api {api, features, ioctls}
    if _libc.ioctl(fd, ctypes.c_ulong(UFFDIO_API), api):
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"UFFDIO_API: {os.strerror(err)}")
    return fd


def tag(addr: int, page: int) -> bytes:
    """The bytes the good client wrote at the start of the page at ``addr``."""
    return (addr // page).to_bytes(8, "little") * 2


class MapDevice(Device):
    """A served device of small DRAM, its libchm client, and the checks after each test."""

    def __init__(self, srv: Server):
        super().__init__(srv)
        node = read_node(srv.node)
        self.page, self.frames = node["page_size"], node["dram_bytes"] // node["page_size"]
        self.scan_addr = 1 << 30  # the mappings are inside this range of twice DRAM, every page tagged
        self.scan_pages = 2 * self.frames
        for i in range(self.scan_pages):
            addr = self.scan_addr + i * self.page
            assert self.good.write(addr, tag(addr, self.page)) == 16

    def scan(self) -> None:
        """A libchm client reads every page of twice DRAM: fails (-EBUSY) if leaked leases pin the frames."""
        for i in range(self.scan_pages):
            addr = self.scan_addr + i * self.page
            assert self.good.read(addr, 16) == tag(addr, self.page), addr

    def after(self) -> None:
        """What every test ends with, once its raw clients have closed."""
        device_barrier(self.node)  # their detach was handled
        self.check()
        self.scan()
        stats = self.good.stats()
        assert stats["map_leases_expired"] == 0 and stats["map_clients_cut_off"] == 0, stats  # no timing in it


@pytest.fixture(scope="module", params=[True, False], ids=["native-loop", "python-loop"])
def device(request, tmp_path_factory):
    # Leases outlive the tests (so no timing decides an answer); no detach for bad entries (the fuzzer sends many).
    args = ("--format", *SMALL_DRAM, "--map-lease-ms", str(MAP_LEASE_MS_RANGE[1]), "--max-bad-entries", "0",
            *(() if request.param else ("--no-native-hits",)))
    with Server(tmp_path_factory.mktemp("media"), None, *args) as srv:
        dev = MapDevice(srv)
        yield dev
        dev.good.close()
        rc, _, err = srv.stop()
        assert rc == 0, err
        assert "Traceback" not in err and "internal error" not in err, err


class Mapped:
    """A raw client that sent a valid map request of [dev_addr, dev_addr + pages * page_size), and the model of
    what the device must answer its entries: the leases it holds and the bad entries it was counted."""

    def __init__(self, dev: MapDevice, pages: int = MAP_PAGES, entries: int = 16):
        self.dev, self.page = dev, dev.page
        self.dev_addr = dev.scan_addr
        self.length = pages * self.page
        self.raw = RawClient(dev.node, entries=entries, staging=STAGING)
        self.entries = entries
        req = ffi.new("struct chm_map_req *", {"magic": lib.CHM_WIRE_MAGIC, "op": lib.CHM_CTL_MAP,
                                               "dev_addr": self.dev_addr, "len": self.length, "base": BASE})
        uffd = userfaultfd()
        try:
            socket.send_fds(self.raw.sock, [bytes(ffi.buffer(req))], [uffd])
        finally:
            os.close(uffd)  # the device holds its own copy
        msg, fds, _, _ = socket.recv_fds(self.raw.sock, ffi.sizeof("struct chm_map_resp"), 1)
        resp = ffi.cast("struct chm_map_resp *", ffi.from_buffer(msg))
        assert resp.status == 0 and len(fds) == 1, (resp.status, fds)
        assert (resp.frames, resp.page_size) == (dev.frames, dev.page)
        self.dram = fds[0]  # the DRAM memfd: a lease's frame must hold the faulted page
        self.leases: dict[int, int] = {}  # lease -> the device address of its page
        self.seen: set[int] = set()  # every lease this client was given
        self.counted: Counter = Counter()  # bad entries by field
        self.results: Counter = Counter()  # what the well-formed entries got (the tests check they were reached)
        # Timing's part, which only the cut-off test lets happen (the others' leases outlive them): set by it
        # once the device's stats say so.
        self.expired: set[int] = set()  # leases not acked within --map-lease-ms
        self.cut_off = False  # --map-max-expired of them: no more leases

    # ---- the rules -------------------------------------------------------------------------------------------
    def refusal(self, e: dict) -> tuple[str | None, int] | None:
        """The field refused in ``e`` and its errno (field None: a state of the client, not a bad entry), or None."""
        stateless = wire_refusal(e, self.dev.cap, STAGING)
        op = e.get("opcode", 0)
        if op not in (MAP_FAULT, MAP_ACK) or stateless != ("opcode", errno.EINVAL):
            return stateless  # ("opcode", EINVAL) of a map entry: well formed, for a client without a mapping
        addr, page = e.get("addr", 0), self.page
        if op == MAP_FAULT:
            if addr % page:
                return "addr", errno.EINVAL
            if not self.dev_addr <= addr < self.dev_addr + self.length:
                return "addr", errno.ERANGE
            if e.get("len", 0) != page:
                return "len", errno.EINVAL
            if self.cut_off:
                return None, errno.EPERM
            if len(self.leases) >= self.entries:
                return None, errno.EBUSY
            return None
        if self.leases.get(e.get("handle", 0)) != addr:
            return "handle", errno.EINVAL
        if e["handle"] in self.expired:
            return None, errno.ETIMEDOUT  # it ends all the same
        return None

    def expect(self, e: dict, res: int) -> None:
        """Check the device's answer ``res`` to ``e`` against the rules and take it into the model."""
        refusal = self.refusal(e)
        if refusal is not None:
            assert res == -refusal[1], f"entry {e}: expected -{errno.errorcode[refusal[1]]} ({refusal[0]}), got {res}"
            if refusal[0] is not None:
                self.counted[refusal[0]] += 1
            else:
                self.results[refusal[1]] += 1
            if refusal[1] == errno.ETIMEDOUT:
                del self.leases[e["handle"]]
            return
        op = e["opcode"]
        if op == MAP_FAULT:
            assert res > 0, f"entry {e}: expected a lease, got {res}"
            frame = res & lib.CHM_LEASE_FRAME_MASK
            assert frame < self.dev.frames, f"entry {e}: lease {res:#x}: frame {frame} of {self.dev.frames}"
            assert res not in self.seen, f"entry {e}: lease {res:#x} was given before"
            assert res >> lib.CHM_LEASE_SEQ_SHIFT >= 1, f"entry {e}: lease {res:#x} has no sequence"
            held = {lease & lib.CHM_LEASE_FRAME_MASK: a for lease, a in self.leases.items()}
            assert held.get(frame, e["addr"]) == e["addr"], f"entry {e}: frame {frame} is leased for page {held}"
            got = os.pread(self.dram, 16, frame * self.page)
            assert got == tag(e["addr"], self.page), f"entry {e}: frame {frame} holds {got.hex()}"
            self.seen.add(res)
            self.leases[res] = e["addr"]
            self.results["lease"] += 1
        elif op == MAP_ACK:
            assert res == 0, f"entry {e}: expected 0, got {res}"
            del self.leases[e["handle"]]
            self.results["acked"] += 1
        else:
            assert res == 0, f"entry {e}: expected 0, got {res}"

    # ---- the ring ----------------------------------------------------------------------------------------------
    def run(self, batch: list[dict]) -> list[int]:
        """Submit ``batch`` (each entry's user_data given, or made) in one publish; check every answer in order."""
        raw = self.raw
        assert len(batch) <= self.entries
        uds = []
        for k, e in enumerate(batch):
            slot = raw.sq[(raw.tail + k) % self.entries]
            ffi.memmove(ffi.addressof(slot), bytes(ffi.sizeof("struct chm_sqe")), ffi.sizeof("struct chm_sqe"))
            ud = e.get("user_data", (raw.tail + k + 1) * 0x0101010101 & (2**64 - 1))
            uds.append(ud)
            for name, v in {**e, "user_data": ud}.items():
                setattr(slot, name, v)
        raw.publish(raw.tail + len(batch))
        out = []
        for e, ud, (got_ud, res) in zip(batch, uds, raw.reap(len(batch))):
            assert got_ud == ud, (e, got_ud, ud)
            self.expect({k: v for k, v in e.items() if k != "user_data"}, res)
            out.append(res)
        return out

    def submit(self, **e) -> int:
        return self.run([e])[0]

    def fault(self, addr: int, **fields) -> int:
        lease = self.submit(opcode=MAP_FAULT, addr=addr, len=self.page, **fields)
        assert lease > 0, (addr, fields, lease)
        return lease

    def ack_all(self) -> None:
        for lease, addr in list(self.leases.items()):
            assert self.submit(opcode=MAP_ACK, addr=addr, handle=lease) == 0

    def check_counts(self) -> None:
        """The device counted this client's bad entries by field as the rules did."""
        stats = self.raw.stats_json()
        assert stats["bad_entries"] == dict(self.counted), stats["last_error"]
        assert stats["client_id"] == self.raw.hdr.client_id

    def close(self) -> None:
        self.raw.close()
        os.close(self.dram)


def page_addrs(m: Mapped, i: int) -> int:
    """The i-th probe's page: they go round the mapping, so many frames are leased."""
    return m.dev_addr + (i % (m.length // m.page)) * m.page


def probe(dev: MapDevice, op: int, field: str, values, extra: dict | None = None) -> Mapped:
    """Each of ``values`` in ``field`` of a well-formed ``op`` entry (a MAP_ACK acks a lease faulted just before),
    from a mapped raw client of its own; every answer checked against the rules, then the counts the device kept.
    Returns the client's model (closed)."""
    m = Mapped(dev)
    try:
        for i, value in enumerate(values):
            addr = page_addrs(m, i)
            if op == MAP_FAULT:
                e = dict(opcode=MAP_FAULT, addr=addr, len=dev.page)
            else:
                e = dict(opcode=MAP_ACK, addr=addr, handle=m.fault(addr))
            e.update(extra or {})
            e[field] = value
            m.submit(**e)
            m.ack_all()  # whatever is still held: the next value starts from no lease
        m.check_counts()
    finally:
        m.close()
    dev.after()
    return m


def addr_edges(dev: MapDevice, m_start: int, m_end: int) -> list[int]:
    p, cap = dev.page, dev.cap
    return sorted({m_start - p, m_start - 1, m_start, m_start + 1, m_start + p - 1, m_start + p, m_end - p,
                   m_end - p + 1, m_end - 1, m_end, m_end + 1, m_end + p, cap - p, cap - 1, cap, cap + 1})


# ---- the fields, one at a time -----------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [MAP_FAULT, MAP_ACK], ids=["fault", "ack"])
@pytest.mark.parametrize("field", ["flags", "rsvd0", "rsvd1", "rsvd2"])
def test_flags_and_reserved_fields(device, op, field):
    m = probe(device, op, field, WIDTHS[field])
    allowed = {0, lib.CHM_FAULT_WRITE if op == MAP_FAULT else lib.CHM_ACK_FAILED} if field == "flags" else {0}
    assert m.counted == Counter({field: len(set(WIDTHS[field]) - allowed)})


@pytest.mark.parametrize("op", [MAP_FAULT, MAP_ACK], ids=["fault", "ack"])
def test_user_data_is_echoed_whatever_it_is(device, op):
    m = probe(device, op, "user_data", U64)
    assert m.counted == Counter() and m.results["acked"] >= len(U64)


def test_fault_addr(device):
    start, end = device.scan_addr, device.scan_addr + MAP_PAGES * device.page
    values = sorted(set(U64) | set(addr_edges(device, start, end)))
    m = probe(device, MAP_FAULT, "addr", values)
    aligned_in = [v for v in values if v % device.page == 0 and start <= v < end]
    assert m.results["lease"] == len(aligned_in) >= 3  # the first page, the second, the last
    assert m.counted["addr"] == len(values) - len(aligned_in)


def test_fault_addr_with_write(device):
    start, end = device.scan_addr, device.scan_addr + MAP_PAGES * device.page
    m = probe(device, MAP_FAULT, "addr", addr_edges(device, start, end), extra={"flags": lib.CHM_FAULT_WRITE})
    assert m.results["lease"] >= 3 and m.counted["addr"] > 0


def test_fault_len(device):
    p = device.page
    values = sorted(set(U64) | {p - 1, p, p + 1, 2 * p, STAGING, STAGING + 1, device.cap - 1, device.cap})
    m = probe(device, MAP_FAULT, "len", values)
    assert m.counted == Counter({"len": len(values) - 1}) and m.results["lease"] == 1


@pytest.mark.parametrize("op", [MAP_FAULT, MAP_ACK], ids=["fault", "ack"])
@pytest.mark.parametrize("field", ["buf_offset", "timeout_ns"])
def test_fields_that_must_be_zero(device, op, field):
    values = WIDTHS[field]
    m = probe(device, op, field, values)
    assert m.counted == Counter({field: len(set(values) - {0})})


def test_fault_handle(device):
    m = probe(device, MAP_FAULT, "handle", I64)
    assert m.counted == Counter({"handle": len(set(I64) - {0})})


def test_ack_len(device):
    m = probe(device, MAP_ACK, "len", sorted(set(U64) | {device.page}))
    assert m.counted == Counter({"len": len(U64)})  # every nonzero value


def test_ack_addr(device):
    # Acks of leases faulted at pages round the mapping, at every boundary: only the lease's own page acks it.
    start, end = device.scan_addr, device.scan_addr + MAP_PAGES * device.page
    values = sorted(set(U64) | set(addr_edges(device, start, end)))
    m = probe(device, MAP_ACK, "addr", values)
    assert m.counted["addr"] == sum(v >= device.cap for v in values) > 0
    assert m.counted["handle"] > 0  # aligned or not, inside the device, not the lease's page


def test_ack_handle(device):
    # Boundary values (and leases it was given: 2^32 is the first lease of frame 0), never the one just faulted.
    m = probe(device, MAP_ACK, "handle", I64 + [1 << lib.CHM_LEASE_SEQ_SHIFT, (2 << lib.CHM_LEASE_SEQ_SHIFT) | 1])
    assert m.counted["handle"] == len(I64) + 2


def test_ack_twice_and_of_another_client(device):
    a, b = Mapped(device), Mapped(device)
    try:
        addr = device.scan_addr + 3 * device.page
        lease = a.fault(addr)
        assert b.submit(opcode=MAP_ACK, addr=addr, handle=lease) == -errno.EINVAL  # not b's lease
        assert a.submit(opcode=MAP_ACK, addr=addr + device.page, handle=lease) == -errno.EINVAL  # not its page
        assert a.submit(opcode=MAP_ACK, addr=addr, handle=lease, flags=lib.CHM_ACK_FAILED) == 0
        assert a.submit(opcode=MAP_ACK, addr=addr, handle=lease) == -errno.EINVAL  # ended
        assert (a.counted, b.counted) == (Counter(handle=2), Counter(handle=1))
        again = a.fault(addr)
        assert again != lease and again & lib.CHM_LEASE_FRAME_MASK == lease & lib.CHM_LEASE_FRAME_MASK
        a.ack_all()
        a.check_counts()
        b.check_counts()
    finally:
        a.close()
        b.close()
    device.after()


def test_faults_beyond_the_ring_are_ebusy(device):
    m = Mapped(device, entries=8)
    try:
        page = device.page
        assert m.run([dict(opcode=MAP_FAULT, addr=device.scan_addr + i * page, len=page) for i in range(8)])
        assert len(m.leases) == 8
        # Held at the ring's depth: a good fault is -EBUSY, a bad field is still that field's bad entry.
        m.run([dict(opcode=MAP_FAULT, addr=device.scan_addr, len=page),
               dict(opcode=MAP_FAULT, addr=device.scan_addr + 1, len=page),
               dict(opcode=MAP_FAULT, addr=device.scan_addr, len=page - 1),
               dict(opcode=MAP_FAULT, addr=device.scan_addr + 9 * page, len=page, flags=lib.CHM_FAULT_WRITE)])
        assert m.results[errno.EBUSY] == 2 and m.counted == Counter(addr=1, len=1)
        lease, addr = next(iter(m.leases.items()))
        m.run([dict(opcode=MAP_ACK, addr=addr, handle=lease), dict(opcode=MAP_FAULT, addr=addr, len=page)])
        assert len(m.leases) == 8  # one acked made room for one
        m.check_counts()
    finally:
        m.close()
    device.after()


def test_a_client_holding_every_frame_leaves_none_pinned(device):
    """A ring as deep as DRAM: the raw client pins every frame (a chm_read of another page is -EBUSY meanwhile),
    then closes without acking one: every frame is free again."""
    frames = device.frames
    m = Mapped(device, pages=2 * frames, entries=frames)
    try:
        page = device.page
        results = m.run([dict(opcode=MAP_FAULT, addr=device.scan_addr + i * page, len=page) for i in range(frames)])
        assert all(r > 0 for r in results) and len(m.leases) == frames
        with pytest.raises(libchm.ChmError) as exc:
            device.good.read(device.scan_addr + frames * page, 16)
        assert exc.value.errno == errno.EBUSY
        m.check_counts()
    finally:
        m.close()
    device.after()  # the scan needs the frames back


# ---- the fuzzer ---------------------------------------------------------------------------------------------------
class MapFuzzer:
    """Random MAP_FAULT/MAP_ACK entries, mostly well formed, a field at a boundary now and then; acks of leases
    held, acked already, of another page, and made up; flushes between (they write-protect written frames)."""

    def __init__(self, m: Mapped, seed: int):
        self.m, self.rng = m, random.Random(seed)
        self.acked: list[int] = []

    def value(self, field: str, sane: int) -> int:
        rng = self.rng
        if rng.random() < 0.94:
            return sane
        if rng.random() < 0.8:
            return rng.choice(WIDTHS[field])
        bits = {"opcode": 8, "flags": 8, "rsvd0": 16, "rsvd1": 32}.get(field, 64)
        v = rng.getrandbits(bits)
        return v - (1 << 64) if field in ("handle", "timeout_ns") and v >= 1 << 63 else v

    def page(self) -> int:
        m, rng = self.m, self.rng
        if rng.random() < 0.9:
            return m.dev_addr + rng.randrange(m.length // m.page) * m.page
        return rng.choice(addr_edges(m.dev, m.dev_addr, m.dev_addr + m.length) + [rng.getrandbits(64)])

    def entry(self) -> dict:
        m, rng = self.m, self.rng
        r = rng.random()
        if r < 0.04:
            return dict(opcode=FLUSH)
        if r < 0.5:
            sane = dict(opcode=MAP_FAULT, addr=self.page(), len=m.page,
                        flags=lib.CHM_FAULT_WRITE if rng.random() < 0.3 else 0)
        else:
            kind = rng.random()
            if m.leases and kind < 0.75:
                handle = rng.choice(list(m.leases))
                addr = m.leases[handle] if rng.random() < 0.85 else self.page()
            elif self.acked and kind < 0.85:
                handle, addr = rng.choice(self.acked), self.page()
            else:  # made up: a sequence it may not have reached, any frame
                handle = (rng.randrange(1, 1 << 12) << lib.CHM_LEASE_SEQ_SHIFT) | rng.randrange(m.dev.frames + 8)
                addr = self.page()
            sane = dict(opcode=MAP_ACK, addr=addr, handle=handle,
                        flags=lib.CHM_ACK_FAILED if rng.random() < 0.3 else 0)
        e = {f: self.value(f, sane.get(f, 0)) for f in WIDTHS if f not in ("opcode", "user_data")}
        e["opcode"] = sane["opcode"]
        e["user_data"] = rng.getrandbits(64)
        return e

    def round(self) -> None:
        m = self.m
        batch = [self.entry() for _ in range(self.rng.randint(1, m.entries))]
        before = dict(m.leases)
        m.run(batch)
        self.acked += [lease for lease in before if lease not in m.leases]


def test_fuzz_map_entries(device, request):
    m = Mapped(device)
    fz = MapFuzzer(m, SEED + (request.node.callspec.id == "python-loop"))
    try:
        for i in range(ROUNDS):
            fz.round()
            if i % 50 == 49:
                device.check()
                device.scan()  # evicts every unpinned frame: leased ones must stay (their bytes are checked)
                for lease, addr in m.leases.items():
                    got = os.pread(m.dram, 16, (lease & lib.CHM_LEASE_FRAME_MASK) * m.page)
                    assert got == tag(addr, m.page), (hex(lease), addr, got.hex())
        # Every kind of answer came up.
        assert m.results["lease"] and m.results["acked"] and m.results[errno.EBUSY], m.results
        assert {"addr", "len", "handle", "flags"} <= set(m.counted), m.counted
        m.check_counts()
    finally:
        m.close()
    device.after()


# ---- the cut-off -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False], ids=["native-loop", "python-loop"])
def test_a_cut_off_client_gets_eperm_and_its_fields_still_checked(tmp_path, native):
    """--map-max-expired leases not acked in --map-lease-ms: later well-formed faults are -EPERM (a state, not a
    bad entry), bad fields are still named, and the expired leases are acked with -ETIMEDOUT (they end)."""
    args = ("--format", *SMALL_DRAM, "--map-lease-ms", str(MAP_LEASE_MS_RANGE[0]), "--map-max-expired", "2")
    with Server(tmp_path / "media", None, *args, *(() if native else ("--no-native-hits",))) as srv:
        dev = MapDevice(srv)
        m = Mapped(dev)
        try:
            addr, page = dev.scan_addr, dev.page
            leases = [m.fault(addr), m.fault(addr + page)]  # two expiries cut it off: both faults come first
            wait_for(lambda: dev.good.stats()["map_clients_cut_off"] == 1, "the client was not cut off", srv.node)
            assert dev.good.stats()["map_leases_expired"] == 2
            m.expired.update(leases)
            m.cut_off = True
            for e, want in ((dict(opcode=MAP_FAULT, addr=addr + 2 * page, len=page), -errno.EPERM),
                            (dict(opcode=MAP_FAULT, addr=addr + 1, len=page), -errno.EINVAL),
                            (dict(opcode=MAP_FAULT, addr=addr - page, len=page), -errno.ERANGE),
                            (dict(opcode=MAP_FAULT, addr=addr, len=page + 1), -errno.EINVAL),
                            (dict(opcode=MAP_ACK, addr=addr, handle=leases[0]), -errno.ETIMEDOUT),
                            (dict(opcode=MAP_ACK, addr=addr, handle=leases[0]), -errno.EINVAL),
                            (dict(opcode=MAP_ACK, addr=addr + page, handle=leases[1], flags=lib.CHM_ACK_FAILED),
                             -errno.ETIMEDOUT)):
                assert m.submit(**e) == want, e
            assert not m.leases and m.counted == Counter(addr=2, len=1, handle=1)
            m.check_counts()
        finally:
            m.close()
        device_barrier(srv.node)
        dev.check()
        dev.scan()
        dev.good.close()
        rc, _, err = srv.stop()
    assert rc == 0, err
    assert "Traceback" not in err and "internal error" not in err, err
