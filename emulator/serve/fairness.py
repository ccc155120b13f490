"""Fairness: each pass of the serve loop gives every client one turn.

A turn is one CHUNK_BYTES piece of the client's large read (or large write where no write buffer can
refuse it), or its fetched commands until they have moved about that many bytes. Every piece is charged
from its command's own start time, so the modelled time is that of one call. Methods of DeviceServer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.errors import ChmError

from .rings import BULK_OPCODES, MAX_BATCH, lib

if TYPE_CHECKING:
    from .clients import Client

# A read (or a write no write buffer can refuse) longer than this is served one piece per turn,
# round-robin with the other clients, so a small command never waits behind a whole large one.
CHUNK_BYTES = 1 << 20
# While no other client has work, a large command goes in pieces of this (a Python call per piece
# costs ~5 us); a client arriving then waits for at most one such piece.
MAX_PIECE_ALONE = 8 << 20


class Job:
    """A large read or write in progress: served one CHUNK_BYTES-aligned piece per turn, every piece
    charged from the command's own start time, so the modelled pipes serialize as for one call."""

    __slots__ = ("opcode", "user_data", "addr", "end", "next", "piece", "buf", "start", "finish")

    def __init__(self, e, buf: memoryview, start: float, piece: int):
        self.opcode, self.user_data, self.addr, self.end = e.opcode, e.user_data, e.addr, e.addr + e.len
        self.next, self.piece, self.buf, self.start, self.finish = e.addr, piece, buf, start, start


class FairTurns:
    """The turns of the Python serve loop and the pieces of large commands (a DeviceServer mixin)."""

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
