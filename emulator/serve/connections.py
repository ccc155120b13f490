"""Connections: the control socket's listener, attach handshakes (a queue pair and a doorbell per client),
detaches, and the limits that keep floods and fd exhaustion from taking the device down. Methods of
DeviceServer.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import mmap
import os
import select
import socket
import struct

from emulator.errors import ChmError

from .clients import Client
from .mapping import MAP_REQ_SIZE
from .rings import ATTACH_REQ_SIZE, MAX_BATCH, ffi, lib

ATTACH_TIMEOUT_S = 2.0  # a half-sent attach request is dropped after this
PAGE = 4096
MAX_PENDING_ATTACHES = 64  # half-open connections held at once; more are closed at once
MAX_FDS_PER_MESSAGE = 4  # fds taken from one control message (a map request carries 1; more are refused)
LOG_INTERVAL_S = 10.0  # a repeating complaint (fd exhaustion, connection flood) is logged at most this often


class Connections:
    """The control path: connections, attaches and detaches (a DeviceServer mixin)."""

    def _control(self, events) -> None:
        self._map_expire()  # looked at as often as the control path (CONTROL_POLL_S, and after every sleep)
        for fd, mask in events:
            if fd == self._media_fd:
                continue  # a media completion: the serve loop collects it
            if fd == self.evfd or fd in self.by_bell:
                try:
                    os.eventfd_read(fd)
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
                    data, fds, _, _ = socket.recv_fds(c.conn, MAP_REQ_SIZE, MAX_FDS_PER_MESSAGE)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data, fds = b"", []
                if not data:  # EOF: the client closed or died
                    for passed in fds:
                        os.close(passed)
                    self._detach(c, "disconnected")
                else:  # the only request on an attached connection: chm_mmap's
                    self._map_request(c, data, fds)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._shed_one(exc):
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):  # the peer gave up before we took it
                    continue
                self._log_limited("accept", f"accepting a connection failed: {exc}")
                return
            if len(self.pending) >= MAX_PENDING_ATTACHES:
                self._refuse(conn, errno.EAGAIN)
                self._log_limited("flood", f"{MAX_PENDING_ATTACHES} attach requests are already pending: "
                                           f"a new connection was closed at once")
                continue
            # The request is collected without blocking: a client that connects and says
            # nothing holds nobody up (it is dropped after ATTACH_TIMEOUT_S).
            conn.setblocking(False)
            self.pending[conn.fileno()] = (conn, b"", self.clock.monotonic())
            self.poller.register(conn.fileno(), select.POLLIN)

    def _shed_one(self, exc: OSError) -> bool:
        """Out of fds: give up the reserve fd to accept one connection and close it, so the listener
        does not stay readable forever. True if one was shed."""
        self._log_limited("emfile", f"out of file descriptors ({exc.strerror}): closing new connections "
                                    f"until some are free ({len(self.clients)} clients, {len(self.pending)} pending)")
        if self._reserve_fd < 0:
            return False
        os.close(self._reserve_fd)
        self._reserve_fd = -1
        try:
            conn, _ = self.listener.accept()
        except OSError:
            conn = None
        if conn is not None:
            self._refuse(conn, exc.errno)
        try:
            self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # tried again on the next exhaustion
        return conn is not None

    def _refuse(self, conn: socket.socket, err: int) -> None:
        """Answer an attach not taken (best effort: the request may not even have been sent) and close."""
        try:
            conn.setblocking(False)
            self._reply(conn, -err)
        except OSError:
            pass
        conn.close()

    def _log_limited(self, key: str, msg: str) -> None:
        now = self.clock.monotonic()
        last, repeats = self._last_logged.get(key, (-LOG_INTERVAL_S, 0))
        if now - last < LOG_INTERVAL_S:
            self._last_logged[key] = (last, repeats + 1)
            return
        self.log(msg + (f" (and {repeats} more times in the last {now - last:.0f} s)" if repeats else ""))
        self._last_logged[key] = (now, 0)

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
        except OSError as exc:  # the client went away mid-handshake (EPIPE, ...): rate-limited, any client can
            self._log_limited("attach-failed", f"attach failed: {exc}")
            conn.close()

    def _drop_stalled_handshakes(self) -> None:
        now = self.clock.monotonic()
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
        status, why = self._check_attach(req, uid)
        if status:
            self._log_limited("attach", f"attach of pid {pid} refused: {why}")
            self._reply(conn, -status)
            conn.close()
            return
        sq, cq = req.sq_entries, req.cq_entries
        staging = -(-req.staging_bytes // PAGE) * PAGE
        offs = ffi.new("uint64_t[4]")
        total = lib.chm_srv_qp_layout(sq, cq, staging, offs + 0, offs + 1, offs + 2, offs + 3)
        cid = self._next_id
        try:
            fd = os.memfd_create(f"chm-qp-{cid}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            self._refuse_attach(conn, pid, exc, "no queue pair memfd")
            return
        bell = -1
        try:
            try:  # one doorbell per client: no client can swallow the wake-ups of another
                bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            except OSError as exc:
                self._refuse_attach(conn, pid, exc, "no doorbell eventfd")
                return
            try:  # backed now: a full memory or shm gives ENOSPC here, never SIGBUS on a later access
                os.ftruncate(fd, total)
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                self._log_limited("qp", f"attach of pid {pid} refused: cannot allocate its queue pair of {total} "
                                        f"bytes: {exc.strerror}")
                self._refuse(conn, exc.errno or errno.EIO)
                return
            # Sealed: the client cannot shrink the mapping under the device (SIGBUS) or grow it.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            try:
                qp_map = mmap.mmap(fd, total)  # it dups fd: one more descriptor, which may not be there
            except OSError as exc:
                self._refuse_attach(conn, pid, exc, "cannot map its queue pair")
                return
            self._next_id += 1
            srv = ffi.new("struct chm_srv_qp *")
            batch = srv.batch = ffi.new("struct chm_sqe[]", MAX_BATCH)
            base = ffi.from_buffer(qp_map)
            lib.chm_srv_qp_init(srv, base, cid, sq, cq, staging)
            del base
            share = req.prefetch_share_ppm or round(self.cfg.policy.prefetch_client_share * lib.CHM_PPM)
            # The share applies alike to the window's pages and to the handles; each limit is at least one.
            c = Client(cid, conn, pid, qp_map, srv, batch, offs[3], staging, offs[2], self._now(), share,
                       max(1, self.ctl.prefetch_window_pages * share // lib.CHM_PPM),
                       max(1, self.ctl.prefetch_max_handles * share // lib.CHM_PPM))
            c.bell, bell = bell, -1  # the client owns it now (closed in Client.close)
            self.clients[cid] = c
            self.by_fd[conn.fileno()] = c
            self.by_bell[c.bell] = c
            self.poller.register(conn.fileno(), select.POLLIN)
            self.poller.register(c.bell, select.POLLIN)
            self._rebuild()
            self.owner.node.clients = len(self.clients)
            self.owner.node.clients_total += 1
            try:
                self._reply(conn, 0, cid, total, (fd, c.bell))
            except OSError:
                self._detach(c, "attach reply failed")
                raise
        finally:
            os.close(fd)
            if bell >= 0:
                os.close(bell)
        conn.setblocking(False)

    def _refuse_attach(self, conn: socket.socket, pid: int, exc: OSError, what: str) -> None:
        """Refuse an attach with the errno of the call that failed; fd exhaustion is logged as accept's is."""
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            self._log_limited("emfile", f"out of file descriptors ({exc.strerror}): refusing attaches until some "
                                        f"are free ({len(self.clients)} clients, {len(self.pending)} pending)")
        else:
            self._log_limited("qp", f"attach of pid {pid} refused: {what}: {exc.strerror}")
        self._refuse(conn, exc.errno or errno.EIO)

    def _check_attach(self, req, uid: int) -> tuple[int, str]:
        """(0, ""), or the errno that refuses this attach request and why."""
        if uid != os.getuid() and uid != 0:
            return errno.EACCES, f"uid {uid} may not use a device served by uid {os.getuid()}"
        if req.magic != lib.CHM_WIRE_MAGIC or req.version != lib.CHM_WIRE_VERSION:
            return errno.EPROTO, (f"magic {req.magic:#x} version {req.version}; this device speaks "
                                  f"magic {lib.CHM_WIRE_MAGIC:#x} version {lib.CHM_WIRE_VERSION}")
        for name in ("sq_entries", "cq_entries"):
            n = getattr(req, name)
            if n < lib.CHM_MIN_ENTRIES or n > lib.CHM_MAX_ENTRIES or n & (n - 1):
                return errno.EINVAL, (f"{name} {n} is not a power of two in "
                                      f"[{lib.CHM_MIN_ENTRIES}, {lib.CHM_MAX_ENTRIES}]")
        if req.cq_entries < req.sq_entries:
            return errno.EINVAL, f"cq_entries {req.cq_entries} is below sq_entries {req.sq_entries}"
        if req.staging_bytes == 0 or req.staging_bytes > lib.CHM_MAX_STAGING_BYTES:
            return errno.EINVAL, f"staging_bytes {req.staging_bytes} is outside [1, {lib.CHM_MAX_STAGING_BYTES}]"
        if req.prefetch_share_ppm > lib.CHM_PPM:
            return errno.EINVAL, (f"prefetch_share_ppm {req.prefetch_share_ppm} is outside [0, {lib.CHM_PPM}] "
                                  f"(0: the device default)")
        if req.rsvd0:
            return errno.EINVAL, f"rsvd0 {req.rsvd0} must be 0"
        return 0, ""

    def _detach(self, c: Client, why: str) -> None:
        """Reclaim a client's queue pair and release its prefetch handles."""
        if self.clients.pop(c.id, None) is None:
            return
        fd = c.conn.fileno()
        self.by_fd.pop(fd, None)
        self.by_bell.pop(c.bell, None)
        for polled in (fd, c.bell):
            try:
                self.poller.unregister(polled)
            except KeyError:
                pass
        for handle in sorted(c.handles):
            try:
                self.ctl.release(handle, max(c.clock, self._now()))
            except ChmError as exc:
                self.log(f"releasing handle {handle} of client {c.id}: {exc}")
        c.handles.clear()
        c.pages_held = 0
        self._map_detach(c)
        if c.parked is not None:
            self._unpark(c)
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
        loop = self._loop
        loop.qps, loop.n = self._qp_array, len(self._order)
        loop.turn = loop.in_turn = loop.ran = 0  # a new pass
