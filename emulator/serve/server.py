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

Where it lives: this module is the server itself (construction, lifecycle) and the facade every caller
imports from; the roles are mixins of DeviceServer in modules of their own: loop.py (the serve loop and
its sleep), fairness.py (turns and pieces), dispatch.py (commands), parking.py (parked waits),
connections.py (the listener, attaches and detaches), with clients.py (Client), node.py (NodeOwner),
rings.py (the native module) and clock.py (the injected wall clock).
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from emulator.config import Config
from emulator.controller import DRAIN_TIMEOUT_S, Controller
from emulator.errors import ChmError
from emulator.native import ffi as core_ffi

from .clients import Client
from .limits import DEFAULT_MAP_LEASE_MS, DEFAULT_MAP_MAX_EXPIRED, DEFAULT_MAX_BAD_ENTRIES, MAX_BAD_ENTRIES_LIMIT
from .clock import Clock, ManualClock, WallClock
from .connections import ATTACH_TIMEOUT_S, LOG_INTERVAL_S, MAX_PENDING_ATTACHES, PAGE, Connections
from .dispatch import Dispatch
from .fairness import CHUNK_BYTES, MAX_PIECE_ALONE, FairTurns, Job
from .mapping import Mapping
from .loop import CONTROL_POLL_NS, CONTROL_POLL_S, ServeLoop, idle_wall_wait_ns
from .node import NodeOwner
from .parking import PARKED_POLL_NS, STAGED_SPIN_NS, ParkedWait, Parking
from .rings import (ATTACH_REQ_SIZE, BULK_OPCODES, MAX_BATCH, OPCODE_NAMES, READ_HIT, SQE_FIELDS, STATS_FIELDS,
                    TAIL_FIELD, U64_MAX, ffi, lib)

__all__ = ["ATTACH_REQ_SIZE", "ATTACH_TIMEOUT_S", "BULK_OPCODES", "CHUNK_BYTES", "CONTROL_POLL_NS", "CONTROL_POLL_S",
           "Client", "Clock", "DeviceServer", "Job", "LOG_INTERVAL_S", "MAX_BATCH", "MAX_PENDING_ATTACHES",
           "MAX_PIECE_ALONE", "ManualClock", "NodeOwner", "OPCODE_NAMES", "PAGE", "PARKED_POLL_NS", "ParkedWait",
           "READ_HIT", "SQE_FIELDS", "STAGED_SPIN_NS", "STATS_FIELDS", "STOP_SIGNALS", "TAIL_FIELD", "U64_MAX",
           "WallClock", "ffi", "idle_wall_wait_ns", "install_signal_handlers", "lib"]


class DeviceServer(ServeLoop, FairTurns, Dispatch, Parking, Connections, Mapping):
    def __init__(self, cfg: Config, media_dir: str | os.PathLike | None, node: str = "chm0", pacing: bool = False,
                 spin_us: float = 50.0, log=None, format_media: bool = False,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, native_hits: bool = True,
                 max_bad_entries: int = DEFAULT_MAX_BAD_ENTRIES, clock: Clock | None = None,
                 map_lease_ms: float = DEFAULT_MAP_LEASE_MS, map_max_expired: int = DEFAULT_MAP_MAX_EXPIRED):
        """``native_hits=False`` serves every command in Python (tests compare the two paths).
        ``max_bad_entries``: a client that submits this many bad entries is detached (0: never).
        ``clock``: the wall clock it reads and sleeps on (default the ``time`` module's, as this module
        names it: a test that stands in for ``server.time`` still reaches the server).
        ``map_lease_ms``, ``map_max_expired``: chm_mmap's lease bound and cut-off (mapping.py)."""
        if (not isinstance(max_bad_entries, int) or isinstance(max_bad_entries, bool)
                or not 0 <= max_bad_entries <= MAX_BAD_ENTRIES_LIMIT):
            raise ChmError(errno.EINVAL, f"max_bad_entries {max_bad_entries!r} is outside [0, {MAX_BAD_ENTRIES_LIMIT}] "
                                         f"(0: never detach)")
        self.max_bad_entries = max_bad_entries
        self._map_init(map_lease_ms, map_max_expired)
        self.clock: Clock = WallClock(time) if clock is None else clock
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
        self._map_loop_setup(self.native_loop)
        self.wall0 = self.clock.monotonic_ns()
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
        self._loop.read_hit = self._loop.map_hit = ffi.NULL  # the controller goes
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install_signal_handlers(server: DeviceServer) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, server.request_stop)
