"""An attached client: its queue pair, staging buffer, prefetch handles and the counts the device keeps."""

from __future__ import annotations

import errno
import mmap
import os
import socket

from emulator.errors import ChmError

from .fairness import Job
from .parking import ParkedWait
from .rings import ffi


def _in_srv(name: str) -> property:
    """A client's field kept in its ``struct chm_srv_qp`` (``self.srv``), where the C loop reads and updates it."""
    return property(lambda self: getattr(self.srv, name), lambda self, value: setattr(self.srv, name, value))


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
        self.mapping = None  # its chm_mmap mapping (mapping.MapState), after a map request

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
