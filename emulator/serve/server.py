"""The device process: an emulator ``Controller`` served to libchm clients.

One thread does everything: it takes commands from every client's submission
ring, runs them on the controller and posts completions; when no ring has
work it spins briefly (in C, GIL released), then sleeps in ``poll()`` on the
clients' doorbell eventfds (one each), its own stop eventfd, the control
socket and the client connections.

Native hit path. Where the controller serves DRAM-hit reads in C (a built-in
policy, see ``Controller.native_read``) and there is no pacing, the turns
below are taken by a C loop (``chm_srv_serve`` in chm_srv.c): it serves each
read whose pages all hit DRAM -- ring, checks, the controller's hit read,
memcpy into the staging buffer, completion -- and hands Python every other
command (misses, writes, flushes, prefetches, control, errors) and every
piece of a large command, one at a time, in the same turn order. A command
is served in C only while the controller has no background work due before
it (``Controller.quiet_until``): the first one after runs in Python, whose
tick does that work.

Time. Each client has its own virtual clock: a command starts at
``max(client clock, device floor)`` and the client's clock moves to its
finish. The device floor is the latest virtual time any command finished at,
plus the wall time the device spent idle (so the background flusher runs
while nobody calls). With ``pacing`` the floor is wall time mapped to virtual
time, and a completion is held until wall time reaches its modelled finish.

Fairness. Each pass gives every client one turn: one CHUNK_BYTES piece of its
large read (or large write where no write buffer can refuse it; hymcache's
all-or-nothing admission keeps its writes whole), or its queued commands
until they have moved about that many bytes. Every piece is charged from its
command's own start time, so modelled time is that of one call. Prefetch
window and handles are shared by a per-client share (attach field
``prefetch_share_ppm``, default ``policy.prefetch_client_share``), applied
alike to pages and handles.

Resources. Files are allocated before they are mapped (ENOSPC, not SIGBUS);
one spare fd lets the listener shed connections when the fd table is full;
at most MAX_PENDING_ATTACHES connections wait half-open.

Trust. Everything a client can write (ring entries, its tail, its head) is
copied to private memory and checked before use; sizes and indices the
server owns live in ``struct chm_srv_qp`` in server memory. Every field of
every entry is checked by one C function, ``chm_srv_check`` (chm_srv.c), on
both paths; a bad entry completes with -EINVAL, -ERANGE or -EFAULT, is
logged (rate-limited) and counted per field (CHM_OP_STATS_JSON's
``bad_entries``), and after ``max_bad_entries`` of them the client is
detached: its connection is closed, so its next call gets -ENODEV. A
client's commands can only reach its own staging buffer (a memoryview of its
own mapping, bounds-checked), and only its own prefetch handles.
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
from typing import NamedTuple

from emulator.config import Config
from emulator.controller import DRAIN_TIMEOUT_S, Controller
from emulator.errors import ChmError
from emulator.native import ffi as core_ffi, lib as core_lib

from driver.native import load_or_build
from driver.wire import node_path, socket_path

from . import srv_build
from .cli import DEFAULT_MAX_BAD_ENTRIES, MAX_BAD_ENTRIES_LIMIT

_srv = load_or_build(srv_build.MODULE, srv_build.build, Path(srv_build.__file__).with_suffix(".lock"))
ffi, lib = _srv.ffi, _srv.lib  # the wire's structs and constants, the ring helpers and the C loop
# The controller's DRAM-hit read, as the C loop calls it (a pointer out of the native core's module).
READ_HIT = ffi.cast("chm_read_hit_fn",
                    int(core_ffi.cast("uintptr_t", core_ffi.addressof(core_lib, "chm_dev_read_hit"))))

STATS_FIELDS = [name for name, _ in ffi.typeof("struct chm_wire_stats").fields]
SQE_FIELDS = [name for name, _ in ffi.typeof("struct chm_sqe").fields]  # chm_srv_check's field index names these
TAIL_FIELD = "sq_tail"  # a bad entry count of its own: the sq tail further ahead than the ring holds
U64_MAX = (1 << 64) - 1
OPCODE_NAMES = {getattr(lib, n): n[len("CHM_OP_"):] for n in dir(lib) if n.startswith("CHM_OP_") and n != "CHM_OP_MAX"}
ATTACH_REQ_SIZE = ffi.sizeof("struct chm_attach_req")
MAX_BATCH = lib.CHM_SRV_BATCH
CONTROL_POLL_S = 0.002  # look at the control socket at least this often while busy
CONTROL_POLL_NS = int(CONTROL_POLL_S * 1e9)
PARKED_POLL_NS = 50_000  # while a wait is parked, the C loop hands back this often to look at its media reads
# After a prefetch wait is answered the device spins at least this long before sleeping: reads of the staged
# object usually follow (often from another client: a KV Manager stages, its worker reads), and a sleeping
# device takes a wake-up, tens of microseconds to a millisecond on a virtual machine, to serve them.
STAGED_SPIN_NS = 500_000
ATTACH_TIMEOUT_S = 2.0  # a half-sent attach request is dropped after this
PAGE = 4096
# A read (or a write no write buffer can refuse) longer than this is served one piece per turn,
# round-robin with the other clients, so a small command never waits behind a whole large one.
CHUNK_BYTES = 1 << 20
# While no other client has work, a large command goes in pieces of this (a Python call per piece
# costs ~5 us); a client arriving then waits for at most one such piece.
MAX_PIECE_ALONE = 8 << 20
MAX_PENDING_ATTACHES = 64  # half-open connections held at once; more are closed at once
LOG_INTERVAL_S = 10.0  # a repeating complaint (fd exhaustion, connection flood) is logged at most this often
BULK_OPCODES = frozenset((lib.CHM_OP_READ, lib.CHM_OP_WRITE, lib.CHM_OP_PREFETCH))  # their work grows with len


def _u64(x: float) -> int:
    """A virtual time or duration as a completion's u64 field (never an exception: NaN is 0)."""
    return int(x) if 0 <= x <= U64_MAX else (U64_MAX if x > U64_MAX else 0)


def idle_wall_wait_ns(event_ns: float, floor_ns: float, wall_virtual_ns: float, pacing: bool) -> float:
    """Wall nanoseconds an idle device waits until its virtual time reaches ``event_ns``. Without pacing,
    virtual time (``floor_ns``) advances by the idle wall time; with pacing it is ``max(floor, wall)``,
    which stands still until the wall clock (``wall_virtual_ns``, on the same origin) passes the floor."""
    if pacing:
        return 0.0 if event_ns <= floor_ns else max(0.0, event_ns - wall_virtual_ns)
    return max(0.0, event_ns - floor_ns)


class Job:
    """A large read or write in progress: served one CHUNK_BYTES-aligned piece per turn, every piece
    charged from the command's own start time, so the modelled pipes serialize as for one call."""

    __slots__ = ("opcode", "user_data", "addr", "end", "next", "piece", "buf", "start", "finish")

    def __init__(self, e, buf: memoryview, start: float, piece: int):
        self.opcode, self.user_data, self.addr, self.end = e.opcode, e.user_data, e.addr, e.addr + e.len
        self.next, self.piece, self.buf, self.start, self.finish = e.addr, piece, buf, start, start


def _in_srv(name: str) -> property:
    """A client's field kept in its ``struct chm_srv_qp`` (``self.srv``), where the C loop reads and updates it."""
    return property(lambda self: getattr(self.srv, name), lambda self, value: setattr(self.srv, name, value))


class ParkedWait(NamedTuple):
    """A prefetch wait whose object still has media reads in flight: the device serves others meanwhile."""
    user_data: int
    handle: int
    timeout_ns: int   # < 0: none
    start: float      # the command's virtual start: its finish is computed from it, as if it had not waited


class _Park(Exception):
    """Raised by _execute for a wait that would block on media reads (see ParkedWait)."""


class Client:
    """One attached queue pair and what the device keeps about it."""

    batch_next = _in_srv("batch_next")  # batch[batch_next:batch_len]: fetched, not yet run
    batch_len = _in_srv("batch_len")
    clock = _in_srv("clock")  # the client's virtual clock
    commands = _in_srv("commands")
    errors = _in_srv("errors")

    def __init__(self, cid: int, conn: socket.socket, pid: int, qp_map: mmap.mmap, srv, batch, staging_offset: int,
                 staging_bytes: int, stats_offset: int, clock: float, share_ppm: int, prefetch_pages_limit: int,
                 prefetch_handles_limit: int):
        """``srv``: the queue pair, set up by chm_srv_qp_init with ``batch`` (``struct chm_sqe[MAX_BATCH]``)."""
        self.id, self.conn, self.pid = cid, conn, pid
        self.bell = -1  # its own doorbell eventfd: a client that drains its bell silences only itself
        self.map, self.srv = qp_map, srv
        self.srv_one = ffi.new("struct chm_srv_qp *[1]", [srv])  # this queue pair alone, for chm_srv_pending
        self.view = memoryview(qp_map)
        self.staging = self.view[staging_offset: staging_offset + staging_bytes]
        self.staging_bytes = staging_bytes
        self.stats_slot = ffi.cast("struct chm_wire_stats *", ffi.from_buffer(self.view[stats_offset:]))
        self.handles: dict[int, int] = {}  # prefetch handle -> pages it holds
        self.pages_held = 0
        self.share_ppm = share_ppm
        self.prefetch_pages_limit = prefetch_pages_limit
        self.prefetch_handles_limit = prefetch_handles_limit
        self.batch = batch  # commands fetched, not yet run
        self._job: Job | None = None
        self._parked: ParkedWait | None = None
        self.clock = clock
        self.last_error = ""
        self.bad_entries: dict[str, int] = {}  # field name -> bad entries of it (TAIL_FIELD: corrupted tails)
        self.bad_total = 0
        self.tails_counted = 0  # srv.bad_tails already in bad_entries
        self.closed = False  # detached: nothing of it may be touched any more

    @property
    def job(self) -> Job | None:
        """Its large command in progress, if any (the C loop sees that there is one)."""
        return self._job

    @job.setter
    def job(self, job: Job | None) -> None:
        self._job = job
        self.srv.has_job = job is not None

    @property
    def parked(self) -> ParkedWait | None:
        """Its prefetch wait, while the object's media reads are in flight (the C loop skips it meanwhile)."""
        return self._parked

    @parked.setter
    def parked(self, wait: ParkedWait | None) -> None:
        self._parked = wait
        self.srv.parked = wait is not None

    def buffer(self, offset: int, length: int) -> memoryview:
        """The client's own staging bytes [offset, offset+length), or EFAULT."""
        if length > self.staging_bytes or offset > self.staging_bytes - length:
            raise ChmError(errno.EFAULT, f"staging range [{offset}, {offset + length}) is outside this client's "
                                         f"buffer of {self.staging_bytes} bytes")
        return self.staging[offset: offset + length]

    def close(self) -> None:
        self.closed = True
        self.stats_slot = None
        self.job = None
        for v in (self.staging, self.view):
            try:
                v.release()
            except BufferError:  # a slice escaped; the map goes with the last reference
                pass
        try:
            self.map.close()
        except BufferError:
            pass
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1
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
        try:
            os.ftruncate(self.fd, 0)
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)  # backed now: a full /dev/shm is ENOSPC here, not SIGBUS later
            os.fchmod(self.fd, 0o600)
            self.map = mmap.mmap(self.fd, size)
        except OSError as exc:
            os.unlink(self.path)  # ours: we hold its lock
            os.close(self.fd)
            raise ChmError(exc.errno or errno.EIO, f"cannot set up device node {self.path}: {exc.strerror}") from None
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

    def publish(self, cfg: Config, pacing: bool, device_epoch: int = 0) -> None:
        n = self.node
        n.device_epoch = device_epoch
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
                 spin_us: float = 50.0, log=None, format_media: bool = False,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, native_hits: bool = True,
                 max_bad_entries: int = DEFAULT_MAX_BAD_ENTRIES):
        """``native_hits=False`` serves every command in Python (tests compare the two paths).
        ``max_bad_entries``: a client that submits this many bad entries is detached (0: never)."""
        if (not isinstance(max_bad_entries, int) or isinstance(max_bad_entries, bool)
                or not 0 <= max_bad_entries <= MAX_BAD_ENTRIES_LIMIT):
            raise ChmError(errno.EINVAL, f"max_bad_entries {max_bad_entries!r} is outside [0, {MAX_BAD_ENTRIES_LIMIT}] "
                                         f"(0: never detach)")
        self.max_bad_entries = max_bad_entries
        self._loop = ffi.new("struct chm_srv_loop *")  # the C loop's state; floor lives here
        self.cfg = cfg
        self.drain_timeout_s = drain_timeout_s
        self.drain_error: ChmError | None = None  # what the drain at shutdown could not do (UnflushedData, ...)
        self.log = log or (lambda msg: print(f"chm serve: {msg}", file=sys.stderr, flush=True))
        self.pacing = pacing
        self.spin_ns = int(spin_us * 1000)
        self._staged_spin_until = 0  # monotonic ns: spin at least until then (STAGED_SPIN_NS); 0 with --spin-us 0
        self.owner = NodeOwner(node, self.log)
        self.ctl: Controller | None = None
        self.listener: socket.socket | None = None
        self.evfd = -1  # wakes the serve loop for a stop request (each client rings its own bell)
        self._reserve_fd = -1  # spare fd: closed to accept (and shed) a connection when the fd table is full
        try:
            self.ctl = Controller(cfg, media_dir, log=self.log, format_media=format_media)
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
            self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self._teardown(0.0)
            raise
        self.clients: dict[int, Client] = {}
        self.by_fd: dict[int, Client] = {}
        self.by_bell: dict[int, Client] = {}  # doorbell eventfd -> its client
        self.pending: dict[int, tuple[socket.socket, bytes, float]] = {}  # fd -> attach request so far
        self._qp_array = ffi.new("struct chm_srv_qp *[]", 1)
        self._order: list[Client] = []
        page = cfg.device.page_size_bytes
        self.chunk_bytes = -(-CHUNK_BYTES // page) * page  # whole pages: a piece never splits a page
        self._last_logged: dict[str, tuple[float, int]] = {}  # complaint -> (when last logged, repeats since)
        self._next_id = 1
        self.bad_entries: dict[str, int] = {}  # device-wide, detached clients' included
        self.clients_detached_bad = 0  # clients detached for max_bad_entries
        self._bad_field = ffi.new("uint32_t *")
        self.floor = 0.0  # device virtual time: latest finish, plus idle time
        # The C loop serves DRAM hits where the controller reads them natively and nothing is paced.
        self.native_loop = native_hits and self.ctl.native_read and not pacing
        loop = self._loop
        loop.chunk_bytes = self.chunk_bytes
        loop.capacity = self.ctl.capacity
        loop.read_hit = READ_HIT if self.native_loop else ffi.NULL
        loop.dev = ffi.cast("void *", int(core_ffi.cast("uintptr_t", self.ctl.native_dev)))
        self.wall0 = time.monotonic_ns()
        self.held: list[tuple[float, int, int, Client, int, int, float, float]] = []  # pacing heap
        self.parked: list[Client] = []  # clients whose prefetch wait waits for media reads, oldest first
        self._media_fd = self.ctl.media.fileno()  # polled while a wait is parked: a completion wakes us
        self._held_seq = 0
        self.stop_requested = False
        self.poller = select.poll()
        self.poller.register(self.evfd, select.POLLIN)
        self.poller.register(self.listener.fileno(), select.POLLIN)
        self.owner.publish(cfg, pacing, self.ctl.device_epoch)

    # ---- lifecycle ---------------------------------------------------------------
    @property
    def node_path(self) -> Path:
        return self.owner.path

    @property
    def floor(self) -> float:
        """Device virtual time: the latest finish, plus the wall time spent idle (the C loop moves it too)."""
        return self._loop.floor

    @floor.setter
    def floor(self, value: float) -> None:
        self._loop.floor = value

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
                if self.parked:
                    self._unpark_landed()
                if self.native_loop:
                    if self._serve_native() == lib.CHM_SRV_IDLE:
                        self._sleep()
                        last_control = time.monotonic()
                        continue
                    now = time.monotonic()
                    if now - last_control > CONTROL_POLL_S:
                        self._control(self.poller.poll(0))
                        last_control = now
                    continue
                if self._run_ready():
                    now = time.monotonic()
                    if now - last_control > CONTROL_POLL_S:
                        self._control(self.poller.poll(0))
                        last_control = now
                    continue
                if self.held:
                    self._post_due()
                if self._order and lib.chm_srv_pending(self._qp_array, len(self._order), self._spin_ns()) >= 0:
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
        self._loop.read_hit = ffi.NULL  # the controller goes
        self.native_loop = False
        try:
            if self.ctl is not None:
                ctl, self.ctl = self.ctl, None
                try:  # drains the write buffer onto the media, retrying failed flushes for at most drain_timeout_s
                    done = ctl.close(now, self.drain_timeout_s)
                except ChmError as exc:
                    self.drain_error = exc
                    self.log(f"drain at shutdown incomplete: {exc.message}")
        finally:  # even if the drain failed, the node must not stay behind looking alive
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            if self.evfd >= 0:
                os.close(self.evfd)
                self.evfd = -1
            if self._reserve_fd >= 0:
                os.close(self._reserve_fd)
                self._reserve_fd = -1
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

    def _idle_timeout_ms(self) -> float | None:
        """How long an idle sleep may last: until a held completion is due (pacing), the controller's next
        background event (a flush landing or falling due), or a media-error backoff ends; None: until a
        client or the control socket wakes us. Half-open attaches are looked at every ATTACH_TIMEOUT_S."""
        waits_ns = []
        if self.held:
            waits_ns.append(self.held[0][0] - self._wall_virtual())
        event = self.ctl.next_event_ns(self._now())
        if event is not None:
            waits_ns.append(idle_wall_wait_ns(event, self.floor, self._wall_virtual(), self.pacing))
        retry_s = self.ctl.retry_wait_s()
        if retry_s is not None and self.ctl.dirty:
            waits_ns.append(retry_s * 1e9)
        if self.parked:  # a media completion wakes us through its descriptor; one the test delay holds back does not
            held_back_s = self.ctl.media.held_back_s()
            if held_back_s is not None:
                waits_ns.append(held_back_s * 1e9)
        if self.pending:
            waits_ns.append(ATTACH_TIMEOUT_S * 1e9)
        return max(0.0, min(waits_ns) / 1e6) if waits_ns else None

    # ---- the data path -------------------------------------------------------------
    def _run_ready(self) -> bool:
        """One turn for every queue pair: one piece of its large command, or its fetched commands until
        they have moved about a piece's worth of bytes or reached a large one. True if anything ran."""
        did = False
        for c in self._order:
            if c.parked is not None:
                continue  # nothing of it runs before its wait is answered
            if c.job is not None:
                self._step(c)
                did = True
                continue
            if c.batch_next == c.batch_len:  # fetch only when nothing fetched is left: the CQ room was counted for it
                n = lib.chm_srv_fetch(c.srv, c.batch, MAX_BATCH)
                if n < 0:  # corrupted tail: the helper resynced and posted -EPROTO
                    c.errors += 1
                    did = True
                    self._count_tails(c)
                    continue
                c.batch_next, c.batch_len = 0, n
            budget = self.chunk_bytes  # many medium commands in one turn would hold others up like a large one
            while c.batch_next < c.batch_len and c.job is None and budget > 0 and not c.closed:
                e = c.batch[c.batch_next]
                c.batch_next += 1
                if e.opcode in BULK_OPCODES:
                    budget -= e.len
                self._command(c, e)
                did = True
        if self.held:
            self._post_due()
        return did

    def _serve_native(self) -> int:
        """One call of the C loop, and the Python work it hands back; returns the C loop's status (a client's
        index when it handed one back)."""
        loop = self._loop
        loop.quiet_until = self.ctl.quiet_until(loop.floor)
        # A parked wait is looked at between calls: while one is, the C loop comes back sooner.
        i = lib.chm_srv_serve(loop, self._spin_ns(), PARKED_POLL_NS if self.parked else CONTROL_POLL_NS)
        if i >= 0:
            c = self._order[i]
            if c.job is not None:  # its next piece is its whole turn
                self._step(c)
                loop.in_turn, loop.turn = 0, i + 1
            else:
                e = c.batch[c.batch_next]
                c.batch_next += 1
                if e.opcode in BULK_OPCODES:  # at most a turn's worth: budget is an int64_t, len a u64
                    loop.budget -= min(e.len, self.chunk_bytes)
                self._command(c, e)
        else:  # the C loop resyncs corrupted tails itself: count them now (it comes back every few ms)
            for c in self._order:
                if c.srv.bad_tails != c.tails_counted:
                    self._count_tails(c)
        return i

    def _spin_ns(self) -> int:
        """How long to spin for new commands before sleeping: ``spin_us``, longer just after a staged wait."""
        if self._staged_spin_until:
            left = self._staged_spin_until - time.monotonic_ns()
            if left > self.spin_ns:
                return left
            self._staged_spin_until = 0
        return self.spin_ns

    def _staged(self) -> None:
        """A prefetch wait was answered: its object's reads are likely next (see STAGED_SPIN_NS)."""
        if self.spin_ns:
            self._staged_spin_until = time.monotonic_ns() + STAGED_SPIN_NS

    def _command(self, c: Client, e) -> None:
        try:
            self._run_command(c, e)
        except Exception:  # a device bug must not take every client down: this one goes
            self._log_limited("internal", f"internal error on a command of client {c.id}, detached:\n"
                                          f"{traceback.format_exc()}")
            self._detach(c, "internal error")

    def _run_command(self, c: Client, e) -> None:
        start = max(c.clock, self._now())
        c.commands += 1
        err = lib.chm_srv_check(ffi.addressof(e), self.ctl.capacity, c.staging_bytes, self._bad_field)
        if err:
            self._bad_entry(c, e, -err, SQE_FIELDS[self._bad_field[0]], start)
            return
        try:
            job = self._large(c, e, start)
            if job is not None:
                c.job = job
                self._step(c)  # its first piece now, the rest on the client's next turns
                return
            res, finish = self._execute(c, e, start)
        except _Park:
            self._park(c, ParkedWait(e.user_data, e.handle, e.timeout_ns, start))
            return
        except ChmError as exc:
            res, finish = self._failed(c, exc, start, e.timeout_ns if e.opcode == lib.CHM_OP_WAIT else -1)
        except Exception:  # a device bug must not take every client down
            res, finish = self._crashed(c, start)
        self._complete(c, e.user_data, start, res, finish)

    def _bad_entry(self, c: Client, e, err: int, field: str, start: float) -> None:
        """Answer an entry chm_srv_check refused, log and count it; detach the client at max_bad_entries."""
        why = self._bad_why(c, e, err, field)
        c.errors += 1
        c.last_error = f"bad entry: {why}"
        self._complete(c, e.user_data, start, -err, start)
        self._count_bad(c, field, f"client {c.id} (pid {c.pid}) submitted a bad entry: {why}")

    def _bad_why(self, c: Client, e, err: int, field: str) -> str:
        """What is wrong with field ``field`` of ``e``: the field, its value and the range allowed."""
        op, value = e.opcode, getattr(e, field)
        name = OPCODE_NAMES.get(op, "entry")  # "entry opcode 0 ...": no name of its own
        cap, staging = self.ctl.capacity, c.staging_bytes
        if field == "opcode":
            allowed = f"valid: 1..{lib.CHM_OP_MAX}"
        elif field == "flags":
            allowed = (f"WAIT allows 0 or CHM_WAIT_LOOK ({lib.CHM_WAIT_LOOK})" if op == lib.CHM_OP_WAIT
                       else f"{name} allows only 0")
        elif field.startswith("rsvd"):
            allowed = "reserved: must be 0"
        elif field == "addr":
            allowed = f"outside the device [0, {cap})"
        elif field == "len" and err == errno.EINVAL:
            allowed = "must be at least 1"
        elif field == "len" and err == errno.ERANGE:
            allowed = f"addr {e.addr} + len passes the device's end: at most {cap - e.addr}"
        elif field == "len":
            allowed = f"longer than this client's staging buffer: at most {staging}"
        elif field == "buf_offset":
            allowed = f"[buf_offset, +len {e.len}) leaves this client's staging buffer of {staging} bytes: " \
                      f"at most {staging - e.len}"
        elif field == "handle":
            allowed = f"a prefetch handle is in [1, {2**63 - 1}]"
        else:  # chm_srv_check refuses no other field
            allowed = "refused"
        return f"{name} {field} {value} ({os.strerror(err)}): {allowed}"

    def _count_tails(self, c: Client) -> None:
        """Count the client's corrupted sq tails (chm_srv_fetch resynced and answered each with -EPROTO)."""
        new, c.tails_counted = c.srv.bad_tails - c.tails_counted, c.srv.bad_tails
        for _ in range(new):
            if c.closed:
                return
            self._count_bad(c, TAIL_FIELD, f"client {c.id} (pid {c.pid}): its sq tail was further ahead of the "
                                           f"device's head than its ring of {c.srv.sq_entries} entries holds "
                                           f"(answered -EPROTO, resynced)")

    def _count_bad(self, c: Client, field: str, msg: str) -> None:
        c.bad_entries[field] = c.bad_entries.get(field, 0) + 1
        c.bad_total += 1
        self.bad_entries[field] = self.bad_entries.get(field, 0) + 1
        self._log_limited(f"bad:{field}", msg)
        if self.max_bad_entries and c.bad_total >= self.max_bad_entries:
            self.clients_detached_bad += 1
            fields = ", ".join(f"{f} {n}" for f, n in c.bad_entries.items())
            self._log_limited("bad-detach", f"client {c.id} (pid {c.pid}) detached after {c.bad_total} bad entries "
                                            f"(--max-bad-entries {self.max_bad_entries}): {fields}")
            self._detach(c, "too many bad entries")

    def _failed(self, c: Client, exc: ChmError, start: float, timeout_ns: int) -> tuple[int, float]:
        c.errors += 1
        c.last_error = str(exc)  # the wire carries only the errno; CHM_OP_STATS_JSON shows the message
        if exc.errno == errno.ETIMEDOUT and timeout_ns >= 0:
            return -exc.errno, start + timeout_ns  # the caller did wait that long
        return -exc.errno, start

    def _crashed(self, c: Client, start: float) -> tuple[int, float]:
        c.errors += 1
        self.log(f"internal error on a command of client {c.id}:\n{traceback.format_exc()}")
        return -errno.EIO, start

    def _complete(self, c: Client, user_data: int, start: float, res: int, finish: float) -> None:
        c.clock = finish
        if finish > self.floor and not self.pacing:
            self.floor = finish
        latency = _u64(finish - start)
        if self.pacing and finish > self._wall_virtual():
            c.srv.held += 1
            self._held_seq += 1
            heapq.heappush(self.held, (finish, self._held_seq, c.id, c, user_data, res, latency, finish))
            return
        lib.chm_srv_post(c.srv, user_data, res, latency, _u64(finish))

    def _large(self, c: Client, e, start: float) -> Job | None:
        """A validated Job if ``e`` is a read or write to serve in pieces, else None.

        Writes are split only where nothing can refuse them (no write buffer): with hymcache's
        buffer, admission is all-or-nothing per call, so a write runs whole (and the buffer's
        size bounds it)."""
        if e.len <= self.chunk_bytes:
            return None
        if e.opcode != lib.CHM_OP_READ and (e.opcode != lib.CHM_OP_WRITE or self.cfg.write_buffer_frames):
            return None
        self.ctl.check_range(e.addr, e.len)
        piece = self.chunk_bytes if self._others_waiting(c) else MAX_PIECE_ALONE
        return Job(e, c.buffer(e.buf_offset, e.len), start, piece)

    def _step(self, c: Client) -> None:
        """Serve the next piece of the client's job, and more while no other client has work waiting;
        post its completion after the last."""
        job, ctl = c.job, self.ctl
        read = job.opcode == lib.CHM_OP_READ
        while True:
            addr = job.next  # pieces end on multiples of chunk_bytes, so they never split a page
            end = min(job.end, (addr // self.chunk_bytes) * self.chunk_bytes + job.piece)
            piece = job.buf[addr - job.addr: end - job.addr]
            try:
                if read:
                    finish = ctl.read(addr, end - addr, job.start, piece if ctl.data else None, whole=False).finish
                else:
                    finish = ctl.write(addr, piece if ctl.data else None, end - addr, job.start, whole=False).finish
            except ChmError as exc:
                res, finish = self._failed(c, exc, job.start, -1)
            except Exception:
                res, finish = self._crashed(c, job.start)
            else:
                res = None
            job.finish = max(job.finish, finish)
            job.next = end
            if res is not None or end == job.end:
                break
            if self._others_waiting(c):
                job.piece = self.chunk_bytes
                return  # the rest on the client's next turns
            job.piece = MAX_PIECE_ALONE  # alone: fewer, larger pieces cost less
        c.job = None
        if res is None:
            res = job.end - job.addr
            ctl.count_command("read" if read else "write", job.finish - job.start)  # one command, counted once
        self._complete(c, job.user_data, job.start, res, job.finish)

    def _others_waiting(self, c: Client) -> bool:
        """Has any client but ``c`` work fetched, in progress or in its ring? (Alone, a large command
        runs on without the cost of a pass per piece.)"""
        for other in self._order:
            if other is not c and (other.job is not None or other.batch_next < other.batch_len
                                   or lib.chm_srv_pending(other.srv_one, 1, 0) >= 0):
                return True
        return False

    def _post_due(self) -> None:
        now = self._wall_virtual()
        while self.held and self.held[0][0] <= now:
            _, _, cid, c, user_data, res, latency, finish = heapq.heappop(self.held)
            if self.clients.get(cid) is c:
                c.srv.held -= 1
                lib.chm_srv_post(c.srv, user_data, res, latency, _u64(finish))

    def _execute(self, c: Client, e, start: float) -> tuple[int, float]:
        """Run one command chm_srv_check passed; returns (result, finish time). Raises ChmError."""
        op = e.opcode
        ctl = self.ctl
        if op == lib.CHM_OP_READ:
            ctl.check_range(e.addr, e.len)
            out = c.buffer(e.buf_offset, e.len)
            return e.len, ctl.read(e.addr, e.len, start, out if ctl.data else None).finish
        if op == lib.CHM_OP_WRITE:
            ctl.check_range(e.addr, e.len)
            src = c.buffer(e.buf_offset, e.len)
            return e.len, ctl.write(e.addr, src if ctl.data else None, e.len, start).finish
        if op == lib.CHM_OP_PREFETCH:
            ctl.check_range(e.addr, e.len, "size")
            pages = (e.addr + e.len - 1) // ctl.page - e.addr // ctl.page + 1
            self._check_share(c, pages)
            issued = ctl.prefetch(e.addr, e.len, start)
            c.handles[issued.handle] = pages
            c.pages_held += pages
            return issued.handle, issued.ack
        if op == lib.CHM_OP_WAIT:
            self._own(c, e.handle)
            timeout = None if e.timeout_ns < 0 else float(e.timeout_ns)
            if ctl.wait_would_block(e.handle, start, timeout):
                if e.flags & lib.CHM_WAIT_LOOK:
                    raise ChmError(errno.EAGAIN, f"prefetch handle {e.handle}: its media reads have not landed yet")
                raise _Park  # waiting here would hold up every other client until the reads land
            finish = ctl.wait(e.handle, start, timeout)
            self._staged()
            return 0, finish
        if op == lib.CHM_OP_RELEASE:
            self._own(c, e.handle)
            finish = ctl.release(e.handle, start)
            c.pages_held -= c.handles.pop(e.handle)
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
            snap.update(clock_ns=start, clients=len(self.clients), client_id=c.id, last_error=c.last_error,
                        parked_waits=len(self.parked), bad_entries=dict(c.bad_entries),
                        device_bad_entries=dict(self.bad_entries),
                        bad_entries_by_client={str(o.id): dict(o.bad_entries) for o in self._order if o.bad_entries},
                        clients_detached_bad=self.clients_detached_bad, max_bad_entries=self.max_bad_entries,
                        prefetch={"share_ppm": c.share_ppm, "pages_held": c.pages_held,
                                  "pages_limit": c.prefetch_pages_limit, "handles_held": len(c.handles),
                                  "handles_limit": c.prefetch_handles_limit})
            text = json.dumps(snap).encode()
            out = c.buffer(e.buf_offset, e.len)
            if len(text) > e.len:
                raise ChmError(errno.ENOSPC, f"stats need {len(text)} bytes, the command gave {e.len}")
            out[: len(text)] = text
            return len(text), start
        raise ChmError(errno.EINVAL, f"unknown opcode {op} (valid: 1..{lib.CHM_OP_MAX})")

    def _check_share(self, c: Client, pages: int) -> None:
        """Refuse a prefetch beyond this client's share of the window (pages) or of the handles.

        Checked only where the share is below the device's own limit; otherwise the device's window
        and handle checks (emulator/prefetch.py) speak."""
        window_pages, max_handles = self.ctl.prefetch_window_pages, self.ctl.prefetch_max_handles
        share = f"share {c.share_ppm} ppm of the device's {window_pages} pages and {max_handles} handles"
        if c.prefetch_pages_limit < window_pages:
            if pages > c.prefetch_pages_limit:
                raise ChmError(errno.EINVAL, f"object of {pages} pages can never fit this client's prefetch share "
                                             f"of {c.prefetch_pages_limit} pages ({share})")
            if c.pages_held + pages > c.prefetch_pages_limit:
                raise ChmError(errno.EBUSY, f"this client's prefetch share is full: it holds {c.pages_held} of its "
                                            f"{c.prefetch_pages_limit} pages, {pages} more requested ({share}); "
                                            f"release a handle first")
        if c.prefetch_handles_limit < max_handles and len(c.handles) >= c.prefetch_handles_limit:
            raise ChmError(errno.EBUSY, f"this client's prefetch share is full: it holds {len(c.handles)} of its "
                                        f"{c.prefetch_handles_limit} handles ({share}); release a handle first")

    @staticmethod
    def _own(c: Client, handle: int) -> None:
        if handle not in c.handles:
            raise ChmError(errno.EINVAL, f"unknown or released prefetch handle {handle}")

    # ---- parked waits ----------------------------------------------------------------
    def _park(self, c: Client, wait: ParkedWait) -> None:
        """Answer ``c``'s wait once its object's media reads land; nothing else of ``c`` runs meanwhile."""
        c.parked = wait
        if not self.parked and self._media_fd is not None:
            self.poller.register(self._media_fd, select.POLLIN)
        self.parked.append(c)

    def _unpark(self, c: Client) -> None:
        c.parked = None
        self.parked.remove(c)
        if not self.parked and self._media_fd is not None:
            self.poller.unregister(self._media_fd)

    def _unpark_landed(self) -> None:
        """Answer every parked wait whose media reads have landed (or failed)."""
        for c in list(self.parked):
            w = c.parked
            timeout = None if w.timeout_ns < 0 else float(w.timeout_ns)
            try:
                if self.ctl.wait_would_block(w.handle, w.start, timeout):
                    continue
                res, finish = 0, self.ctl.wait(w.handle, w.start, timeout)
                self._staged()
            except ChmError as exc:
                res, finish = self._failed(c, exc, w.start, w.timeout_ns)
            except Exception:  # a device bug must not take every client down
                res, finish = self._crashed(c, w.start)
            self._unpark(c)
            self._complete(c, w.user_data, w.start, res, finish)

    # ---- sleeping and the control path ----------------------------------------------
    def _sleep(self) -> None:
        node = self.owner.node
        lib.chm_srv_set_sleeping(node, 1)
        if self._order and lib.chm_srv_pending(self._qp_array, len(self._order), 0) >= 0:
            lib.chm_srv_set_sleeping(node, 0)
            return
        timeout_ms = self._idle_timeout_ms()
        t0 = time.monotonic_ns()
        events = self.poller.poll(timeout_ms)
        lib.chm_srv_set_sleeping(node, 0)
        if not self.pacing:
            self.floor += time.monotonic_ns() - t0  # idle wall time passes on the device too
        try:  # media errors never raise here (the controller logs and retries them)
            now = self._now()
            self.ctl.run_until(now)  # what fell due while we slept, each at its own virtual time
            self.ctl.tick(now)  # the rest of the housekeeping (staging reads that failed, once unpinned)
        except Exception:  # a device bug in the background flusher must not end serve
            self.log(f"internal error in the background flusher:\n{traceback.format_exc()}")
        self._control(events)
        if self.pending:
            self._drop_stalled_handshakes()

    def _control(self, events) -> None:
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
            self.pending[conn.fileno()] = (conn, b"", time.monotonic())
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
        now = time.monotonic()
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install_signal_handlers(server: DeviceServer) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, server.request_stop)
