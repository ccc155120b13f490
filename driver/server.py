"""The device process: an emulator ``Controller`` served to libchm clients.

One thread does everything: it takes commands from every client's submission
ring, runs them on the controller and posts completions; when no ring has
work it spins briefly (in C, GIL released), then sleeps in ``poll()`` on the
doorbell eventfd, the control socket and the client connections.

Time. Each client has its own virtual clock: a command starts at
``max(client clock, device floor)`` and the client's clock moves to its
finish. The device floor is the latest virtual time any command finished at,
plus the wall time the device spent idle (so the background flusher runs
while nobody calls). With ``pacing`` the floor is wall time mapped to virtual
time, and a completion is held until wall time reaches its modelled finish.

Trust. Everything a client can write (ring entries, its tail, its head) is
copied to private memory and checked before use; sizes and indices the
server owns live in ``struct chm_srv_qp`` in server memory. A client's
commands can only reach its own staging buffer (a memoryview of its own
mapping, bounds-checked), and only its own prefetch handles.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import json
import mmap
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

from emulator.config import Config
from emulator.controller import Controller
from emulator.errors import ChmError

from .wire import ffi, lib, node_path, socket_path

STATS_FIELDS = [name for name, _ in ffi.typeof("struct chm_wire_stats").fields]
ATTACH_REQ_SIZE = ffi.sizeof("struct chm_attach_req")
MAX_BATCH = 32
IDLE_TICK_S = 0.005   # wake this often while the write buffer holds data
CONTROL_POLL_S = 0.002  # look at the control socket at least this often while busy
ATTACH_TIMEOUT_S = 2.0  # a half-sent attach request is dropped after this
PAGE = 4096


class Client:
    """One attached queue pair and what the device keeps about it."""

    def __init__(self, cid: int, conn: socket.socket, pid: int, qp_map: mmap.mmap, srv, staging_offset: int,
                 staging_bytes: int, stats_offset: int, clock: float):
        self.id, self.conn, self.pid = cid, conn, pid
        self.map, self.srv = qp_map, srv
        self.view = memoryview(qp_map)
        self.staging = self.view[staging_offset: staging_offset + staging_bytes]
        self.staging_bytes = staging_bytes
        self.stats_slot = ffi.cast("struct chm_wire_stats *", ffi.from_buffer(self.view[stats_offset:]))
        self.handles: set[int] = set()
        self.clock = clock
        self.commands = 0
        self.errors = 0

    def buffer(self, offset: int, length: int) -> memoryview:
        """The client's own staging bytes [offset, offset+length), or EFAULT."""
        if length > self.staging_bytes or offset > self.staging_bytes - length:
            raise ChmError(errno.EFAULT, f"staging range [{offset}, {offset + length}) is outside this client's "
                                         f"buffer of {self.staging_bytes} bytes")
        return self.staging[offset: offset + length]

    def close(self) -> None:
        self.stats_slot = None
        for v in (self.staging, self.view):
            try:
                v.release()
            except BufferError:  # a slice escaped; the map goes with the last reference
                pass
        try:
            self.map.close()
        except BufferError:
            pass
        self.conn.close()


class NodeOwner:
    """The device node file: exclusive while this server lives (flock), 0600."""

    def __init__(self, node: str, log):
        self.path = node_path(node)
        self.sock_path = socket_path(self.path)
        size = ffi.sizeof("struct chm_node")
        old_umask = os.umask(0o077)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ChmError(exc.errno or errno.EIO, f"cannot create device node {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old_umask)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = self._old_pid(size)
            os.close(self.fd)
            raise ChmError(errno.EBUSY, f"device node {self.path} is already served by pid {pid}; "
                                        f"stop that server or choose another --node") from None
        old = self._old_pid(size)
        if old is not None:
            log(f"replacing stale device node {self.path} left by pid {old}")
        os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, size)
        os.fchmod(self.fd, 0o600)
        self.map = mmap.mmap(self.fd, size)
        self._cdata = ffi.from_buffer(self.map)
        self.node = ffi.cast("struct chm_node *", self._cdata)

    def _old_pid(self, size: int) -> int | None:
        try:
            raw = os.pread(self.fd, size, 0)
        except OSError:
            return None
        if len(raw) < size:
            return None
        n = ffi.cast("struct chm_node *", ffi.from_buffer(raw))
        return n.server_pid if n.magic == lib.CHM_WIRE_MAGIC else None

    def publish(self, cfg: Config, pacing: bool) -> None:
        n = self.node
        n.version = lib.CHM_WIRE_VERSION
        n.server_pid = os.getpid()
        n.capacity_bytes = cfg.capacity_bytes
        n.dram_bytes = cfg.dram.size_bytes
        n.page_size = cfg.device.page_size_bytes
        n.write_buffer_bytes = cfg.write_buffer_frames * cfg.device.page_size_bytes
        n.prefetch_window_bytes = cfg.policy.prefetch_window_bytes
        n.ssd_count = cfg.ssd.count
        n.prefetch_max_handles = cfg.policy.prefetch_max_handles
        n.data = int(cfg.emulation.data)
        n.pacing = int(pacing)
        n.policy = cfg.policy.name.encode()[: lib.CHM_NAME_MAX - 1]
        n.profile = cfg.source.encode()[: lib.CHM_PROFILE_MAX - 1]
        n.magic = lib.CHM_WIRE_MAGIC  # last: a reader that sees it sees the rest (x86 keeps store order)

    def withdraw(self) -> None:
        """Stop new clients: clear the magic and remove the names (the lock goes last, in close)."""
        self.node.magic = 0
        for p in (self.sock_path, self.path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.node = None
        del self._cdata
        self.map.close()
        os.close(self.fd)


class DeviceServer:
    def __init__(self, cfg: Config, media_dir: str | os.PathLike | None, node: str = "chm0", pacing: bool = False,
                 spin_us: float = 50.0, log=None):
        self.cfg = cfg
        self.log = log or (lambda msg: print(f"chm serve: {msg}", file=sys.stderr, flush=True))
        self.pacing = pacing
        self.spin_ns = int(spin_us * 1000)
        self.owner = NodeOwner(node, self.log)
        self.ctl: Controller | None = None
        self.listener: socket.socket | None = None
        self.evfd = -1
        try:
            self.ctl = Controller(cfg, media_dir)
            self.evfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                os.unlink(self.owner.sock_path)  # a stale socket: the flock says nobody serves it
            except FileNotFoundError:
                pass
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            old_umask = os.umask(0o077)
            try:
                self.listener.bind(str(self.owner.sock_path))
            finally:
                os.umask(old_umask)
            self.listener.listen(64)
        except BaseException:
            self._teardown(0.0)
            raise
        self.clients: dict[int, Client] = {}
        self.by_fd: dict[int, Client] = {}
        self.pending: dict[int, tuple[socket.socket, bytes, float]] = {}  # fd -> attach request so far
        self._qp_array = ffi.new("struct chm_srv_qp *[]", 1)
        self._order: list[Client] = []
        self._batch = ffi.new("struct chm_sqe[]", MAX_BATCH)
        self._next_id = 1
        self.floor = 0.0  # device virtual time: latest finish, plus idle time
        self.wall0 = time.monotonic_ns()
        self.held: list[tuple[float, int, int, Client, int, int, float, float]] = []  # pacing heap
        self._held_seq = 0
        self.stop_requested = False
        self.poller = select.poll()
        self.poller.register(self.evfd, select.POLLIN)
        self.poller.register(self.listener.fileno(), select.POLLIN)
        self.owner.publish(cfg, pacing)

    # ---- lifecycle ---------------------------------------------------------------
    @property
    def node_path(self) -> Path:
        return self.owner.path

    def request_stop(self, *_):
        self.stop_requested = True
        try:
            os.eventfd_write(self.evfd, 1)
        except OSError:
            pass

    def serve_forever(self) -> float:
        """Serve until ``request_stop`` (SIGTERM/SIGINT); then drain and remove the node. Returns the drain time."""
        last_control = time.monotonic()
        try:
            while not self.stop_requested:
                if self._run_ready():
                    now = time.monotonic()
                    if now - last_control > CONTROL_POLL_S:
                        self._control(self.poller.poll(0))
                        last_control = now
                    continue
                if self.held:
                    self._post_due()
                if self._order and lib.chm_srv_pending(self._qp_array, len(self._order), self.spin_ns) >= 0:
                    continue
                self._sleep()
                last_control = time.monotonic()
        finally:
            done = self.shutdown()
        return done

    def shutdown(self) -> float:
        if self.ctl is None:
            return self.floor
        self.owner.withdraw()
        for conn, _, _ in self.pending.values():
            conn.close()
        self.pending.clear()
        for c in list(self.clients.values()):
            self._detach(c, "device shutting down")
        return self._teardown(self._now())

    def _teardown(self, now: float) -> float:
        done = now
        try:
            if self.ctl is not None:
                ctl, self.ctl = self.ctl, None
                done = ctl.close(now)  # drains the write buffer onto the media
        finally:  # even if the drain failed, the node must not stay behind looking alive
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            if self.evfd >= 0:
                os.close(self.evfd)
                self.evfd = -1
            if self.owner is not None:
                self.owner.withdraw()
                self.owner.close()
                self.owner = None
        return done

    # ---- time --------------------------------------------------------------------
    def _wall_virtual(self) -> float:
        return float(time.monotonic_ns() - self.wall0)

    def _now(self) -> float:
        return max(self.floor, self._wall_virtual()) if self.pacing else self.floor

    # ---- the data path -------------------------------------------------------------
    def _run_ready(self) -> bool:
        """One pass over all queue pairs; True if any command ran."""
        did = False
        for c in self._order:
            n = lib.chm_srv_fetch(c.srv, self._batch, MAX_BATCH)
            if n < 0:  # corrupted tail: the helper resynced and posted -EPROTO
                c.errors += 1
                did = True
                continue
            for i in range(n):
                self._command(c, self._batch[i])
            did = did or n > 0
        if self.held:
            self._post_due()
        return did

    def _command(self, c: Client, e) -> None:
        start = max(c.clock, self._now())
        c.commands += 1
        try:
            res, finish = self._execute(c, e, start)
        except ChmError as exc:
            c.errors += 1
            res, finish = -exc.errno, start
            if exc.errno == errno.ETIMEDOUT and e.timeout_ns >= 0:
                finish = start + e.timeout_ns  # the caller did wait that long
        except Exception:  # a device bug must not take every client down
            c.errors += 1
            self.log(f"internal error on a command of client {c.id}:\n{traceback.format_exc()}")
            res, finish = -errno.EIO, start
        c.clock = finish
        if finish > self.floor and not self.pacing:
            self.floor = finish
        latency = max(0, int(finish - start))
        if self.pacing and finish > self._wall_virtual():
            c.srv.held += 1
            self._held_seq += 1
            heapq.heappush(self.held, (finish, self._held_seq, c.id, c, e.user_data, res, latency, finish))
            return
        lib.chm_srv_post(c.srv, e.user_data, res, latency, int(finish))

    def _post_due(self) -> None:
        now = self._wall_virtual()
        while self.held and self.held[0][0] <= now:
            _, _, cid, c, user_data, res, latency, finish = heapq.heappop(self.held)
            if self.clients.get(cid) is c:
                c.srv.held -= 1
                lib.chm_srv_post(c.srv, user_data, res, latency, int(finish))

    def _execute(self, c: Client, e, start: float) -> tuple[int, float]:
        """Run one validated command; returns (result, finish time). Raises ChmError."""
        op = e.opcode
        if e.flags or e.rsvd0 or e.rsvd1 or e.rsvd2:
            raise ChmError(errno.EINVAL, f"reserved fields must be 0 (flags={e.flags}, rsvd0={e.rsvd0}, "
                                         f"rsvd1={e.rsvd1}, rsvd2={e.rsvd2})")
        ctl = self.ctl
        if op == lib.CHM_OP_READ:
            ctl.check_range(e.addr, e.len)
            out = c.buffer(e.buf_offset, e.len)
            return e.len, ctl.read(e.addr, e.len, start, out if ctl.data else None)
        if op == lib.CHM_OP_WRITE:
            ctl.check_range(e.addr, e.len)
            src = c.buffer(e.buf_offset, e.len)
            return e.len, ctl.write(e.addr, src if ctl.data else None, e.len, start)
        if op == lib.CHM_OP_PREFETCH:
            handle, ack = ctl.prefetch(e.addr, e.len, start)
            c.handles.add(handle)
            return handle, ack
        if op == lib.CHM_OP_WAIT:
            self._own(c, e.handle)
            return 0, ctl.wait(e.handle, start, None if e.timeout_ns < 0 else float(e.timeout_ns))
        if op == lib.CHM_OP_RELEASE:
            self._own(c, e.handle)
            finish = ctl.release(e.handle, start)
            c.handles.discard(e.handle)
            return 0, finish
        if op == lib.CHM_OP_FLUSH:
            return 0, ctl.flush(start)
        if op == lib.CHM_OP_NOP:
            return 0, start
        if op == lib.CHM_OP_STATS:
            snap = ctl.snapshot()
            slot = c.stats_slot
            for name in STATS_FIELDS:
                setattr(slot, name, int(snap.get(name, 0)))
            slot.clients = len(self.clients)
            slot.clock_ns = int(start)
            return 0, start
        if op == lib.CHM_OP_STATS_JSON:
            snap = ctl.snapshot()
            snap.update(clock_ns=start, clients=len(self.clients), client_id=c.id)
            text = json.dumps(snap).encode()
            out = c.buffer(e.buf_offset, e.len)
            if len(text) > e.len:
                raise ChmError(errno.ENOSPC, f"stats need {len(text)} bytes, the command gave {e.len}")
            out[: len(text)] = text
            return len(text), start
        raise ChmError(errno.EINVAL, f"unknown opcode {op} (valid: 1..{lib.CHM_OP_MAX})")

    @staticmethod
    def _own(c: Client, handle: int) -> None:
        if handle not in c.handles:
            raise ChmError(errno.EINVAL, f"unknown or released prefetch handle {handle}")

    # ---- sleeping and the control path ----------------------------------------------
    def _sleep(self) -> None:
        node = self.owner.node
        lib.chm_srv_set_sleeping(node, 1)
        if self._order and lib.chm_srv_pending(self._qp_array, len(self._order), 0) >= 0:
            lib.chm_srv_set_sleeping(node, 0)
            return
        timeout_ms = None
        if self.held:
            timeout_ms = max(0.0, (self.held[0][0] - self._wall_virtual()) / 1e6)
        elif self.ctl.dirty or self.ctl.flights:
            timeout_ms = IDLE_TICK_S * 1000
        if self.pending:
            timeout_ms = min(timeout_ms if timeout_ms is not None else 1e9, ATTACH_TIMEOUT_S * 1000)
        t0 = time.monotonic_ns()
        events = self.poller.poll(timeout_ms)
        lib.chm_srv_set_sleeping(node, 0)
        if not self.pacing:
            self.floor += time.monotonic_ns() - t0  # idle wall time passes on the device too
        self.ctl.tick(self._now())
        self._control(events)
        if self.pending:
            self._drop_stalled_handshakes()

    def _control(self, events) -> None:
        for fd, mask in events:
            if fd == self.evfd:
                try:
                    os.eventfd_read(self.evfd)
                except BlockingIOError:
                    pass
            elif self.listener is not None and fd == self.listener.fileno():
                self._accept()
            elif fd in self.pending:
                self._handshake(fd)
            else:
                c = self.by_fd.get(fd)
                if c is None:
                    continue
                try:
                    data = c.conn.recv(64)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:  # EOF: the client closed or died
                    self._detach(c, "disconnected")
                # Anything else on an attached connection has no meaning; it is ignored.

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            # The request is collected without blocking: a client that connects and says
            # nothing holds nobody up (it is dropped after ATTACH_TIMEOUT_S).
            conn.setblocking(False)
            self.pending[conn.fileno()] = (conn, b"", time.monotonic())
            self.poller.register(conn.fileno(), select.POLLIN)

    def _handshake(self, fd: int) -> None:
        conn, raw, since = self.pending[fd]
        try:
            chunk = conn.recv(ATTACH_REQ_SIZE - len(raw))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if chunk and len(raw) + len(chunk) < ATTACH_REQ_SIZE:
            self.pending[fd] = (conn, raw + chunk, since)
            return
        del self.pending[fd]
        self.poller.unregister(fd)
        if not chunk:
            conn.close()
            return
        try:
            conn.setblocking(True)
            conn.settimeout(1.0)
            self._attach(conn, raw + chunk)
        except OSError as exc:
            self.log(f"attach failed: {exc}")
            conn.close()

    def _drop_stalled_handshakes(self) -> None:
        now = time.monotonic()
        for fd, (conn, _, since) in list(self.pending.items()):
            if now - since > ATTACH_TIMEOUT_S:
                del self.pending[fd]
                self.poller.unregister(fd)
                conn.close()

    def _reply(self, conn: socket.socket, status: int, cid: int = 0, qp_bytes: int = 0, fds=()) -> None:
        resp = ffi.new("struct chm_attach_resp *", {"status": status, "client_id": cid, "qp_bytes": qp_bytes})
        payload = bytes(ffi.buffer(resp))
        if fds:
            socket.send_fds(conn, [payload], list(fds))
        else:
            conn.sendall(payload)

    def _attach(self, conn: socket.socket, raw: bytes) -> None:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        req = ffi.cast("struct chm_attach_req *", ffi.from_buffer(raw))
        status = self._check_attach(req, uid)
        if status:
            self._reply(conn, -status)
            conn.close()
            return
        sq, cq = req.sq_entries, req.cq_entries
        staging = -(-req.staging_bytes // PAGE) * PAGE
        offs = ffi.new("uint64_t[4]")
        total = lib.chm_srv_qp_layout(sq, cq, staging, offs + 0, offs + 1, offs + 2, offs + 3)
        cid = self._next_id
        self._next_id += 1
        fd = os.memfd_create(f"chm-qp-{cid}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, total)
            # Sealed: the client cannot shrink the mapping under the device (SIGBUS) or grow it.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            qp_map = mmap.mmap(fd, total)
            srv = ffi.new("struct chm_srv_qp *")
            base = ffi.from_buffer(qp_map)
            lib.chm_srv_qp_init(srv, base, cid, sq, cq, staging)
            del base
            c = Client(cid, conn, pid, qp_map, srv, offs[3], staging, offs[2], self._now())
            self.clients[cid] = c
            self.by_fd[conn.fileno()] = c
            self.poller.register(conn.fileno(), select.POLLIN)
            self._rebuild()
            self.owner.node.clients = len(self.clients)
            self.owner.node.clients_total += 1
            try:
                self._reply(conn, 0, cid, total, (fd, self.evfd))
            except OSError:
                self._detach(c, "attach reply failed")
                raise
        finally:
            os.close(fd)
        conn.setblocking(False)

    def _check_attach(self, req, uid: int) -> int:
        """0, or the errno that refuses this attach request."""
        if uid != os.getuid() and uid != 0:
            return errno.EACCES
        if req.magic != lib.CHM_WIRE_MAGIC or req.version != lib.CHM_WIRE_VERSION:
            return errno.EPROTO
        for n in (req.sq_entries, req.cq_entries):
            if n < lib.CHM_MIN_ENTRIES or n > lib.CHM_MAX_ENTRIES or n & (n - 1):
                return errno.EINVAL
        if req.cq_entries < req.sq_entries:
            return errno.EINVAL
        if req.staging_bytes == 0 or req.staging_bytes > lib.CHM_MAX_STAGING_BYTES:
            return errno.EINVAL
        return 0

    def _detach(self, c: Client, why: str) -> None:
        """Reclaim a client's queue pair and release its prefetch handles."""
        if self.clients.pop(c.id, None) is None:
            return
        fd = c.conn.fileno()
        self.by_fd.pop(fd, None)
        try:
            self.poller.unregister(fd)
        except KeyError:
            pass
        for handle in sorted(c.handles):
            try:
                self.ctl.release(handle, max(c.clock, self._now()))
            except ChmError as exc:
                self.log(f"releasing handle {handle} of client {c.id}: {exc}")
        c.handles.clear()
        self.held = [h for h in self.held if h[3] is not c]
        heapq.heapify(self.held)
        c.close()
        self._rebuild()
        if self.owner is not None and self.owner.node is not None:
            self.owner.node.clients = len(self.clients)

    def _rebuild(self) -> None:
        self._order = list(self.clients.values())
        self._qp_array = ffi.new("struct chm_srv_qp *[]", max(1, len(self._order)))
        for i, c in enumerate(self._order):
            self._qp_array[i] = c.srv


def install_signal_handlers(server: DeviceServer) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.request_stop)
