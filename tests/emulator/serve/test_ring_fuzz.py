"""A seeded fuzzer of everything a client can write into its own queue pair: entries, its sq tail, its cq
head, the rest of the header, doorbells; and the detach after --max-bad-entries (issue #21).

Bounded in rounds, not time (CHM_FUZZ_ROUNDS and CHM_FUZZ_SEED set up a longer hunt). After every round it
synchronizes on a marker command's completion, then asserts that the device process is alive; every
few rounds, that a libchm client beside it writes and reads its own bytes; and that every entry the
wire's rules refuse (test_ring_fields.wire_refusal) was answered with that errno and counted."""

from __future__ import annotations

import errno
import os
import random
import time
from collections import Counter

import pytest

import libchm
from emulator.cli import main as chm_main
from driver.wire import ffi, lib, read_node
from tests.driver.rawclient import LIVENESS_SLICE_S, RawClient
from tests.emulator.serve.serving import Server
from tests.emulator.serve.test_ring_fields import (GOOD_ADDR, MiB, OPCODES, STAGING, WIDTHS, base_entry, submit,
                                                   wire_refusal)

ROUNDS = int(os.environ.get("CHM_FUZZ_ROUNDS", "2000"))
SEED = int(os.environ.get("CHM_FUZZ_SEED", "2100"))  # another seed, another hunt
ENTRIES = 16
TIMEOUT = 30.0  # seconds a completion may take: far beyond any (a slow CI), short of a hang
MARKER = 0xC0FFEE << 40  # user_data of the sync commands: no generated entry has these top bits
HDR_BYTES = ffi.sizeof("struct chm_qp_hdr")
SQ_TAIL = ffi.offsetof("struct chm_qp_hdr", "sq") + ffi.offsetof("struct chm_ring_ctl", "tail")
CQ_HEAD = ffi.offsetof("struct chm_qp_hdr", "cq") + ffi.offsetof("struct chm_ring_ctl", "head")
CQ_TAIL = ffi.offsetof("struct chm_qp_hdr", "cq") + ffi.offsetof("struct chm_ring_ctl", "tail")
SQ_HEAD = ffi.offsetof("struct chm_qp_hdr", "sq") + ffi.offsetof("struct chm_ring_ctl", "head")
INDICES = (SQ_HEAD, SQ_TAIL, CQ_HEAD, CQ_TAIL)


@pytest.fixture(scope="module", params=[True, False], ids=["native-loop", "python-loop"])
def served(request, tmp_path_factory):
    args = ("--max-bad-entries", "0") + (() if request.param else ("--no-native-hits",))
    with Server(tmp_path_factory.mktemp("media"), None, *args) as srv:
        yield srv


class Fuzzer:
    def __init__(self, srv: Server, seed: int):
        self.srv, self.rng = srv, random.Random(seed)
        self.cap = read_node(srv.node)["capacity_bytes"]
        self.good = libchm.Device(srv.path, staging_bytes=MiB)
        self.bad = self.attach()
        self.refused: Counter = Counter()  # what the wire's rules refuse, of the entries this client wrote
        self.rounds = 0
        self.markers = 0

    def attach(self) -> RawClient:
        c = RawClient(self.srv.node, entries=ENTRIES, staging=STAGING)
        assert c.status == 0
        self.handles: list[int] = []
        return c

    def value(self, field: str, sane: int) -> int:
        r = self.rng.random()
        if r < 0.75:
            return sane
        width = WIDTHS[field]
        if r < 0.95:
            return self.rng.choice(width)
        bits = {"opcode": 8, "flags": 8, "rsvd0": 16, "rsvd1": 32}.get(field, 64)
        v = self.rng.getrandbits(bits)
        return v - (1 << 64) if field in ("handle", "timeout_ns") and v >= 1 << 63 else v

    def entry(self) -> dict:
        rng = self.rng
        op = rng.choice(OPCODES) if rng.random() < 0.85 else rng.choice(WIDTHS["opcode"])
        handle = rng.choice(self.handles) if self.handles and rng.random() < 0.7 else rng.randrange(1, 100)
        sane = base_entry(op, handle) if 1 <= op <= lib.CHM_OP_MAX else {}
        if op in (lib.CHM_OP_READ, lib.CHM_OP_WRITE):
            sane.update(addr=rng.randrange(0, self.cap - 8 * MiB) & ~7, len=rng.choice([1, 4096, 65536, STAGING]))
        if op == lib.CHM_OP_WAIT:
            sane["timeout_ns"] = rng.choice([-1, 0, 10**6, 2**63 - 1])
        e = {f: self.value(f, sane.get(f, 0)) for f in WIDTHS if f != "user_data"}
        e["opcode"] = op
        e["user_data"] = rng.getrandbits(40)
        return e

    def round(self) -> None:
        rng, bad = self.rng, self.bad
        action = rng.choices(["entries", "sq_tail", "cq_head", "header", "doorbell", "vanish"],
                             [60, 10, 10, 10, 7, 3])[0]
        if action == "entries":
            batch = [self.entry() for _ in range(rng.randint(1, ENTRIES))]
            for k, e in enumerate(batch):
                slot = bad.sq[(bad.tail + k) % bad.entries]
                for name, v in e.items():
                    setattr(slot, name, v)
            bad.publish(bad.tail + len(batch))
            for e, (ud, res) in zip(batch, bad.reap(len(batch), timeout=TIMEOUT)):
                assert ud == e["user_data"]
                refusal = wire_refusal(e, self.cap, STAGING)
                if refusal is not None:
                    assert res == -refusal[1], (e, res, refusal)
                    self.refused[refusal[0]] += 1
                elif e["opcode"] == lib.CHM_OP_PREFETCH and res > 0:
                    self.handles.append(res)
                elif e["opcode"] == lib.CHM_OP_RELEASE and res == 0:
                    self.handles.remove(e["handle"])
        elif action == "sq_tail":  # anywhere: within the ring (stale slots run again) or beyond it (-EPROTO)
            jump = rng.choice([rng.randrange(1, ENTRIES + 1), ENTRIES + 1, rng.getrandbits(32)])
            bad.publish(bad.tail + jump)
        elif action == "cq_head":  # stalls its own completions (or shrinks their room) until it is put back
            bad.hdr.cq.head = rng.getrandbits(32)
            for _ in range(rng.randint(0, 3)):
                bad.push(user_data=MARKER - 1, opcode=lib.CHM_OP_NOP)
            bad.hdr.cq.head = bad.head & 0xFFFFFFFF
        elif action == "header":  # every other byte of the header, its ring indices the server owns included
            saved = bytes(bad.map[:HDR_BYTES])
            junk = bytearray(rng.randbytes(HDR_BYTES))
            for off in (SQ_TAIL, CQ_HEAD):  # the indices the client owns have rounds of their own
                junk[off:off + 4] = saved[off:off + 4]
            bad.map[:HDR_BYTES] = bytes(junk)
            os.eventfd_write(bad.evfd, 1)
            # The device never reads back the indices it owns (nothing was in flight: it wrote none meanwhile);
            # this client does, to find its completions (and sync, to see the device caught up).
            for off in (SQ_HEAD, CQ_TAIL):
                bad.map[off:off + 4] = saved[off:off + 4]
            self.sync()  # the device ran the marker with that header in place
            now = bytes(bad.map[:HDR_BYTES])
            restored = bytearray(saved)
            for off in INDICES:  # as the marker left them
                restored[off:off + 4] = now[off:off + 4]
            bad.map[:HDR_BYTES] = bytes(restored)
            return
        elif action == "doorbell":
            for _ in range(rng.randint(1, 4)):
                try:
                    if rng.random() < 0.3:
                        os.eventfd_read(bad.evfd)  # a client may even drain the doorbell
                    else:
                        os.eventfd_write(bad.evfd, rng.randrange(1, 2**64 - 1))
                except BlockingIOError:
                    pass
        elif action == "vanish":  # leave with commands in flight (a wait parked, maybe): the device reclaims
            for e in (self.entry() for _ in range(rng.randint(1, 4))):
                bad.push(**e)
            bad.close()
            self.bad = self.attach()
            self.refused = Counter()
        self.sync()

    def sync(self) -> None:
        """Push a marker and take completions until it comes back (whatever ran before it)."""
        bad = self.bad
        # First the device takes everything up to this client's tail (a marker published with a tail beyond
        # the ring would be skipped along with the rest), while this client takes what completes meanwhile.
        deadline = time.monotonic() + TIMEOUT
        while bad.hdr.sq.head != bad.tail & 0xFFFFFFFF:
            while bad.hdr.cq.tail != bad.head & 0xFFFFFFFF:
                bad.reap(1)
            assert time.monotonic() < deadline, "the device never took the ring's entries"
            bad.wait_completion(LIVENESS_SLICE_S)  # what it takes, it answers (the sq head moves first)
        self.markers += 1
        marker = MARKER + self.markers
        bad.push(user_data=marker, opcode=lib.CHM_OP_NOP)
        for _ in range(10_000):
            (ud, res), = bad.reap(1, timeout=TIMEOUT)
            if ud == marker:
                assert res == 0
                break
        else:
            raise AssertionError("the marker never came back")
        assert self.srv.proc.poll() is None, self.srv.proc.stderr.read()

    def check_good(self) -> None:
        data = self.rng.randbytes(4096)
        assert self.good.write(GOOD_ADDR, data) == len(data)
        assert self.good.read(GOOD_ADDR, len(data)) == data


def test_fuzz_the_queue_pair(served, request):
    fz = Fuzzer(served, seed=SEED + (request.node.callspec.id == "python-loop"))
    try:
        for i in range(ROUNDS):
            fz.round()
            if i % 25 == 0:
                fz.check_good()
        fz.check_good()
        stats = fz.bad.stats_json()
        counted = stats["bad_entries"]
        for field, n in fz.refused.items():  # stale slots run again may add more; never fewer
            assert counted.get(field, 0) >= n, (field, counted, fz.refused)
        assert sum(stats["device_bad_entries"].values()) >= sum(fz.refused.values()) > 0
    finally:
        fz.bad.close()
        fz.good.close()
    rc, _, err = served.stop()
    assert rc == 0, err
    assert "Traceback" not in err and "internal error" not in err, err


@pytest.mark.parametrize("native", [True, False], ids=["native-loop", "python-loop"])
def test_bad_entries_detach_the_client_and_nobody_else(tmp_path, capsys, native):
    n = 8
    args = ("--max-bad-entries", str(n)) + (() if native else ("--no-native-hits",))
    with Server(tmp_path / "media", None, *args) as srv:
        good = libchm.Device(srv.path, staging_bytes=MiB)
        bad = RawClient(srv.node, entries=ENTRIES, staging=STAGING)
        neighbour = RawClient(srv.node, entries=ENTRIES, staging=STAGING)
        for i in range(n - 1):  # bad entries below the limit, then a good one: still attached
            assert submit(bad, i + 1, opcode=lib.CHM_OP_READ, addr=0, len=2**64 - 1) == -errno.ERANGE
        assert submit(bad, 50, opcode=lib.CHM_OP_NOP) == 0
        assert submit(neighbour, 1, opcode=0) == -errno.EINVAL  # its own count: nobody else's
        assert submit(bad, 51, opcode=lib.CHM_OP_WAIT, handle=-1) == -errno.EINVAL  # the n-th: answered, then detached
        bad.push(user_data=52, opcode=lib.CHM_OP_NOP)
        with pytest.raises(OSError) as exc:
            bad.reap(1)
        assert exc.value.errno == errno.ENODEV
        assert good.write(0, b"still here") == 10 and good.read(0, 10) == b"still here"
        assert submit(neighbour, 2, opcode=lib.CHM_OP_NOP) == 0
        stats = good.stats()
        assert stats["device_bad_entries"] == {"len": n - 1, "handle": 1, "opcode": 1}
        assert stats["clients_detached_bad"] == 1 and stats["bad_entries_by_client"] == {
            str(neighbour.hdr.client_id): {"opcode": 1}}
        assert read_node(srv.node)["clients"] == 2
        assert chm_main(["stats", srv.node]) == 0  # `chm stats` shows them
        out = capsys.readouterr().out
        assert f"bad entries: {n + 1} (len {n - 1}, " in out and "clients detached for them: 1 (limit 8 " in out
        assert f"    client {neighbour.hdr.client_id}: 1 (opcode 1)" in out
        bad.close()
        neighbour.close()
        good.close()
        rc, _, err = srv.stop()
    assert rc == 0, err
    assert f"detached after {n} bad entries" in err
    assert err.count("submitted a bad entry: READ len") == 1  # logged once per 10 s, not once per entry


def test_max_bad_entries_is_checked(capsys):
    from emulator.config import load_profile
    from emulator.errors import ChmError
    from emulator.serve.server import DeviceServer

    for bad in (-1, 2**32 + 1, 1.5, True, "8"):
        with pytest.raises(ChmError) as exc:  # before anything is made: no node, no media
            DeviceServer(load_profile("small"), None, node="never-made", max_bad_entries=bad)
        assert exc.value.errno == errno.EINVAL and f"max_bad_entries {bad!r} is outside [0, {2**32}]" in str(exc.value)
    for text in ("-1", "4294967297", "eight"):
        try:
            rc = chm_main(["serve", "--max-bad-entries", text])
        except SystemExit as exc:
            rc = exc.code
        err = capsys.readouterr().err
        assert rc == 2 and "argument --max-bad-entries: " in err and text in err, err
        assert "must be in [0, 4294967296] (0: never detach)" in err or f"{text!r} is not a whole number" in err, err
