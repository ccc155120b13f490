"""chm_mmap on the device side (docs/mmap.md): map requests, MAP_FAULT and MAP_ACK, leases, write-protection
of clients' writable pages before a frame is snapshotted, and the punch that withdraws every client's mapping
of a frame before it holds another page. Methods of DeviceServer.

The one rule: a client's page-table entry for frame f exists only through a lease of f, f is pinned while a
lease of it is held (acked, detached or dead ends it, an expiry does not), and when a page leaves a frame that
was leased (the frame table records it, chm_ft_dropped) the frame is punched out of the DRAM memfd before any
frame is given to another page. So a client never sees a page that is not the one it faulted on.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from emulator.errors import ChmError
from emulator.native import ffi as core_ffi, lib as core_lib
from emulator.errors import WriteBufferFull

from .limits import MAP_LEASE_MS_RANGE, MAP_MAX_EXPIRED_RANGE
from .rings import MAP_HIT, MAP_UNPIN, ffi, lib

if TYPE_CHECKING:
    from .clients import Client

MAP_REQ_SIZE = ffi.sizeof("struct chm_map_req")


class MapFieldError(ChmError):
    """A MAP_FAULT/MAP_ACK field that only the device's state can judge (page alignment, the mapping's range,
    whose lease): a bad entry of that field."""

    def __init__(self, err: int, name: str, message: str):
        super().__init__(err, message)
        self.field = name


@dataclass
class MapState:
    """What the device keeps about one client's mapping (its leases are in its struct chm_srv_qp, where the C
    loop serves DRAM-hit faults and acks too)."""

    uffd: int
    dev_addr: int
    length: int
    base: int
    leases: object  # struct chm_srv_lease[], the table c.srv.leases points at
    writable: set[int] = field(default_factory=set)  # frames it may write without a fault
    expired: int = 0
    cut_off: bool = False

    def vaddr(self, page: int, page_size: int) -> int:
        return self.base + page * page_size - self.dev_addr


class Mapping:
    """chm_mmap's device side (a DeviceServer mixin)."""

    def _map_init(self, lease_ms: float, max_expired: int) -> None:
        lo, hi = MAP_LEASE_MS_RANGE
        if not isinstance(lease_ms, (int, float)) or isinstance(lease_ms, bool) or not lo <= lease_ms <= hi:
            raise ChmError(errno.EINVAL, f"map_lease_ms {lease_ms!r} is outside [{lo:g}, {hi:g}]")
        lo, hi = MAP_MAX_EXPIRED_RANGE
        if not isinstance(max_expired, int) or isinstance(max_expired, bool) or not lo <= max_expired <= hi:
            raise ChmError(errno.EINVAL, f"map_max_expired {max_expired!r} is outside [{lo}, {hi}]")
        self.map_lease_s = lease_ms / 1000.0
        self.map_max_expired = max_expired
        self.map_counts = dict.fromkeys(("map_faults", "map_write_faults", "map_leases_expired", "map_punches",
                                         "map_writeprotects", "map_clients_cut_off"), 0)
        self._writers: dict[int, dict[int, int]] = {}  # frame -> {client id: its address of the frame's page}
        self._map_tables = None  # [(area base, table cdata, mapped u8*)] once a client maps
        self._dropped_n = core_ffi.new("uint32_t *")
        self._lease_taken = ffi.new("uint32_t[2]")  # chm_srv_lease_take's frame and expired

    def _map_loop_setup(self, native: bool) -> None:
        """The C loop's part: DRAM-hit faults and acks served there too when it serves hits (``native``)."""
        loop = self._loop
        loop.page_size = self.ctl.page
        loop.lease_ns = int(self.map_lease_s * 1e9)
        loop.map_hit = MAP_HIT if native else ffi.NULL
        loop.map_unpin = MAP_UNPIN if native else ffi.NULL

    def map_problem(self) -> str | None:
        """Why this device cannot be mapped (None: it can)."""
        ctl = self.ctl
        if not ctl.data:
            return "emulation.data is off: the device holds no bytes to map"
        return None

    # ---- the control path ----------------------------------------------------------------
    def _map_request(self, c: Client, raw: bytes, fds: list[int]) -> None:
        """A map request on an attached connection: check it, keep the client's userfaultfd, answer."""
        status, why = self._check_map_req(c, raw, fds)
        if status:
            for fd in fds:
                os.close(fd)
            self._log_limited("map", f"map request of client {c.id} (pid {c.pid}) refused: {why}")
            c.last_error = f"map request refused: {why}"
            self._map_reply(c, -status)
            return
        req = ffi.cast("struct chm_map_req *", ffi.from_buffer(raw))
        if self._map_tables is None:
            self._map_track()
        srv = c.srv
        leases = ffi.new("struct chm_srv_lease[]", srv.sq_entries)  # at most a ring's worth held at once
        c.mapping = MapState(fds[0], req.dev_addr, req.len, req.base, leases)
        srv.leases, srv.lease_cap, srv.lease_count = leases, srv.sq_entries, 0
        srv.map_dev_addr, srv.map_len = req.dev_addr, req.len
        self._map_reply(c, 0)

    def _check_map_req(self, c: Client, raw: bytes, fds: list[int]) -> tuple[int, str]:
        if len(raw) != MAP_REQ_SIZE:
            return errno.EINVAL, f"a map request is {MAP_REQ_SIZE} bytes, got {len(raw)}"
        req = ffi.cast("struct chm_map_req *", ffi.from_buffer(raw))
        page, cap = self.ctl.page, self.ctl.capacity
        if req.magic != lib.CHM_WIRE_MAGIC:
            return errno.EPROTO, f"magic {req.magic:#x}, expected {lib.CHM_WIRE_MAGIC:#x}"
        if req.op != lib.CHM_CTL_MAP:
            return errno.EINVAL, f"op {req.op}: the only control request is CHM_CTL_MAP ({lib.CHM_CTL_MAP})"
        if len(fds) != 1:
            return errno.EINVAL, f"a map request carries exactly one fd (the client's userfaultfd), got {len(fds)}"
        problem = self.map_problem()
        if problem:
            return errno.EOPNOTSUPP, problem
        if c.mapping is not None:
            return errno.EBUSY, "this queue pair has a mapping already (one per queue pair)"
        if req.dev_addr % page or req.dev_addr >= cap:
            return errno.EINVAL, f"dev_addr {req.dev_addr}: a multiple of page_size {page} in [0, {cap})"
        if req.len == 0 or req.len % page or req.len > cap - req.dev_addr:
            return errno.EINVAL, (f"len {req.len}: a multiple of page_size {page} in [{page}, "
                                  f"{cap - req.dev_addr}]")
        if req.base == 0 or req.base % page or req.base > lib.CHM_MAP_USER_END - req.len:
            return errno.EINVAL, (f"base {req.base:#x}: a nonzero multiple of page_size {page} with base + len "
                                  f"at most {lib.CHM_MAP_USER_END:#x}")
        if req.rsvd0:
            return errno.EINVAL, f"rsvd0 {req.rsvd0} must be 0"
        if not lib.chm_srv_is_userfaultfd(fds[0]):
            return errno.EINVAL, "the fd sent is not a userfaultfd"
        return 0, ""

    def _map_reply(self, c: Client, status: int) -> None:
        resp = ffi.new("struct chm_map_resp *", {"status": status, "frames": self.cfg.dram_frames,
                                                 "page_size": self.ctl.page})
        payload = bytes(ffi.buffer(resp))
        try:
            if status == 0:
                socket.send_fds(c.conn, [payload], [self.ctl.dram.fd])
            else:
                c.conn.send(payload)
        except OSError as exc:
            self._log_limited("map", f"answering the map request of client {c.id} failed: {exc}")
            self._detach(c, "map reply failed")

    def _map_track(self) -> None:
        tables = []
        for area in self.ctl.policy.areas:
            t = area.table._c
            if core_lib.chm_ft_track_mapped(t):
                raise MemoryError("chm_mmap: no memory for the frame table's mapping state")
            tables.append((area.base, t, core_lib.chm_ft_mapped(t)))
        self._map_tables = tables
        self._mapped_by_base = {base: mapped for base, _, mapped in tables}
        frames = self.ctl.frames
        frames.before_snapshot, frames.before_reuse = self._map_quiesce, self._map_reused

    # ---- the ring ------------------------------------------------------------------------
    def _map_fault(self, c: Client, e, start: float) -> tuple[int, float]:
        m = self._map_of(c, e)
        ctl, page_size = self.ctl, self.ctl.page
        if e.addr % page_size or not m.dev_addr <= e.addr < m.dev_addr + m.length:
            raise MapFieldError(errno.ERANGE if e.addr % page_size == 0 else errno.EINVAL, "addr",
                                f"MAP_FAULT addr {e.addr}: a multiple of page_size {page_size} in this client's "
                                f"mapping [{m.dev_addr}, {m.dev_addr + m.length})")
        if e.len != page_size:
            raise MapFieldError(errno.EINVAL, "len", f"MAP_FAULT len {e.len}: exactly page_size {page_size}")
        if m.cut_off:
            raise ChmError(errno.EPERM, f"client {c.id} is cut off: {self.map_max_expired} of its leases expired")
        if c.srv.lease_count >= c.srv.lease_cap:
            raise ChmError(errno.EBUSY, f"client {c.id} holds {c.srv.lease_count} leases, as many as its ring holds")
        write = bool(e.flags & lib.CHM_FAULT_WRITE)
        finish = ctl.read(e.addr, page_size, start).finish  # the access a chm_read of the page makes
        page = e.addr // page_size
        frame = ctl.policy.lookup(page)
        if frame is None:
            raise ChmError(errno.EIO, f"page {page} is not resident after its read")
        ctl.frames.settle(frame)
        ctl.frames.check_read(frame)
        if write:
            frame, finish = self._map_write(page, frame, finish)
            self.map_counts["map_write_faults"] += 1
        self.map_counts["map_faults"] += 1
        ctl.policy.pin(frame)
        self._map_mark(frame)
        lease = lib.chm_srv_lease_add(c.srv, frame, page, self.clock.monotonic_ns() + self._loop.lease_ns)
        if write:
            m.writable.add(frame)
            self._writers.setdefault(frame, {})[c.id] = m.vaddr(page, page_size)
        return lease, finish

    def _map_write(self, page: int, frame: int, now: float) -> tuple[int, float]:
        """A write fault on ``page`` (resident in ``frame``): admitted as a one-page chm_write (write buffer,
        refusal, dirty, the flusher's queue) of the page's own bytes, so that where the write path gives the
        page a frame of its own (hymcache's write buffer) it starts with them. Returns the frame the client may
        write and the finish; the page keeps no second copy that another mapping could go stale on."""
        ctl, policy, page_size = self.ctl, self.ctl.policy, self.ctl.page
        data = None if policy.write_lookup(page) == frame else bytes(ctl.frames.view(frame))
        try:
            finish = ctl.write(page * page_size, data, page_size, now).finish
        except WriteBufferFull as exc:
            raise ChmError(errno.EAGAIN, str(exc)) from None
        frame = policy.write_lookup(page)
        copy = policy.read_copy(page)
        if copy is not None and copy != frame:  # stores through the mapping reach `frame` only: the copy goes
            if policy.pins(copy):
                raise ChmError(errno.EBUSY, f"page {page}'s read copy in frame {copy} is pinned (a read or a "
                                            f"lease holds it): ask again")
            policy.drop(copy)
            self._map_punch_dropped()
        return frame, finish

    def _map_ack(self, c: Client, e, start: float) -> tuple[int, float]:
        self._map_of(c, e)
        page_size = self.ctl.page
        taken = self._lease_taken
        if e.addr % page_size or lib.chm_srv_lease_take(c.srv, e.handle, e.addr // page_size, taken, taken + 1):
            raise MapFieldError(errno.EINVAL, "handle", f"MAP_ACK handle {e.handle} addr {e.addr}: no lease of "
                                                        f"this client for that page")
        self.ctl.policy.unpin(taken[0])
        if taken[1]:
            raise ChmError(errno.ETIMEDOUT, f"lease {e.handle} had expired ({self.map_lease_s * 1e3:g} ms)")
        return 0, start

    def _map_of(self, c: Client, e) -> MapState:
        m = c.mapping
        if m is None:
            raise MapFieldError(errno.EINVAL, "opcode", f"opcode {e.opcode} needs a map request on this queue pair "
                                                        f"first (chm_mmap)")
        return m

    def _map_mark(self, frame: int) -> None:
        base = self.ctl.policy.area_of(frame).base
        self._mapped_by_base[base][frame - base] = 1

    # ---- timers --------------------------------------------------------------------------
    def _map_leases(self):
        """(client, its mapping, lease) of every lease held."""
        for c in self._order:
            m, srv = c.mapping, c.srv
            if m is not None:
                for i in range(srv.lease_count):
                    yield c, m, srv.leases[i]

    def _map_next_deadline(self) -> float | None:
        """Monotonic seconds of the next lease expiry, if any lease is held."""
        if self._map_tables is None:
            return None
        return min((ls.deadline_ns / 1e9 for _, _, ls in self._map_leases() if not ls.expired), default=None)

    def _map_expire(self) -> None:
        """Expire leases past their deadline; cut a client off at map_max_expired expiries. An expired lease
        keeps its frame pinned until its ACK or the client's detach: a late install then still finds the page
        it asked for, and no other page can be in the frame."""
        if self._map_tables is None:
            return
        now = self.clock.monotonic_ns()
        for c, m, lease in self._map_leases():
            if not lease.expired and lease.deadline_ns <= now:
                lease.expired = 1
                m.expired += 1
                self.map_counts["map_leases_expired"] += 1
                self._log_limited("lease", f"client {c.id} (pid {c.pid}) did not ack lease {lease.id} of page "
                                           f"{lease.page} within {self.map_lease_s * 1e3:g} ms")
                if not m.cut_off and m.expired >= self.map_max_expired:
                    m.cut_off = True
                    c.srv.map_cut_off = 1
                    self.map_counts["map_clients_cut_off"] += 1
                    self._log_limited("cut-off", f"client {c.id} (pid {c.pid}) cut off: {m.expired} leases "
                                                 f"expired (--map-max-expired {self.map_max_expired})")

    def map_stats(self) -> dict[str, int]:
        """The map_* counters (chm_stats.h's CHM_STATS_MAP), the C loop's faults included."""
        counts = dict(self.map_counts)
        counts["map_faults"] += self._loop.map_faults
        return counts

    # ---- the frame hooks (dram.Frames) ----------------------------------------------------
    def _map_quiesce(self, frame: int) -> None:
        """Before a frame's bytes go to the media: write-protect its writers' pages, so a later write faults
        and is admitted (and marks the frame dirty) again."""
        writers = self._writers.pop(frame, None)
        if not writers:
            return
        for cid, vaddr in writers.items():
            c = self.clients.get(cid)
            m = c.mapping if c is not None else None
            if m is None:
                continue
            m.writable.discard(frame)
            self.map_counts["map_writeprotects"] += 1
            rc = lib.chm_srv_writeprotect(m.uffd, vaddr, self.ctl.page)
            if rc and rc != -errno.ENOENT:  # ENOENT: the client unmapped that page meanwhile (nothing to protect)
                self._log_limited("wp", f"write-protecting client {cid}'s page at {vaddr:#x} failed: "
                                        f"{os.strerror(-rc)}")

    def _map_reused(self, frame: int) -> None:
        self._map_punch_dropped()

    def _map_punch_dropped(self) -> None:
        """Punch every frame whose page left it since it was leased: no client maps it any more."""
        n = self._dropped_n
        page = self.ctl.page
        fd = self.ctl.dram.fd
        for base, table, _ in self._map_tables:
            frames = core_lib.chm_ft_dropped(table, n)
            if not n[0]:
                continue
            for i in range(n[0]):
                f = base + frames[i]
                self._map_quiesce(f)
                rc = lib.chm_srv_punch(fd, f * page, page)
                if rc:  # the frame's old bytes stay mapped: fatal to the one rule, so the device stops
                    raise RuntimeError(f"punching DRAM frame {f} failed: {os.strerror(-rc)}")
                self.map_counts["map_punches"] += 1
            core_lib.chm_ft_clear_dropped(table)

    def _map_detach(self, c: Client) -> None:
        m = c.mapping
        if m is None:
            return
        c.mapping = None
        srv = c.srv
        for i in range(srv.lease_count):  # its leases end: their frames may be reused (its mm is gone or detached)
            self.ctl.policy.unpin(srv.leases[i].frame)
        srv.lease_count = srv.map_len = 0
        if not any(o.mapping is not None for o in self._order if o is not c):
            # No mapping is left anywhere, so no page table maps a frame: nothing needs a punch any more.
            for _, table, _ in self._map_tables:
                core_lib.chm_ft_clear_mapped(table)
        for frame in m.writable:
            writers = self._writers.get(frame)
            if writers is not None:
                writers.pop(c.id, None)
                if not writers:
                    del self._writers[frame]
        os.close(m.uffd)
