"""Dispatch: one command of a client's ring checked, run on the controller and completed, and what a bad
entry costs its client. Methods of DeviceServer.
"""

from __future__ import annotations

import errno
import heapq
import json
import os
import traceback
from typing import TYPE_CHECKING

from emulator.errors import ChmError

from .mapping import MapFieldError
from .parking import ParkedWait, _Park
from .rings import OPCODE_NAMES, SQE_FIELDS, STATS_FIELDS, TAIL_FIELD, _u64, ffi, lib

MAP_FAULT, MAP_ACK = lib.CHM_OP_MAP_FAULT, lib.CHM_OP_MAP_ACK

if TYPE_CHECKING:
    from .clients import Client


class Dispatch:
    """A command from check to completion (a DeviceServer mixin)."""

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
        except MapFieldError as exc:  # a field only the device's state can judge: a bad entry all the same
            self._bad_entry(c, e, exc.errno, exc.field, start, exc.message)
            return
        except ChmError as exc:
            res, finish = self._failed(c, exc, start, e.timeout_ns if e.opcode == lib.CHM_OP_WAIT else -1)
        except Exception:  # a device bug must not take every client down
            res, finish = self._crashed(c, start)
        self._complete(c, e.user_data, start, res, finish)

    def _bad_entry(self, c: Client, e, err: int, field: str, start: float, why: str | None = None) -> None:
        """Answer an entry chm_srv_check refused, log and count it; detach the client at max_bad_entries."""
        why = why or self._bad_why(c, e, err, field)
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
                       else f"MAP_FAULT allows 0 or CHM_FAULT_WRITE ({lib.CHM_FAULT_WRITE})" if op == MAP_FAULT
                       else f"MAP_ACK allows 0 or CHM_ACK_FAILED ({lib.CHM_ACK_FAILED})" if op == MAP_ACK
                       else f"{name} allows only 0")
        elif field.startswith("rsvd"):
            allowed = "reserved: must be 0"
        elif op in (MAP_FAULT, MAP_ACK) and field != "addr":
            allowed = {"len": "MAP_FAULT: at least 1 (exactly page_size); MAP_ACK: 0",
                       "handle": "MAP_FAULT: 0; MAP_ACK: a lease, >= 1",
                       }.get(field, f"{name} requires 0")
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
        if op == MAP_FAULT:
            return self._map_fault(c, e, start)
        if op == MAP_ACK:
            return self._map_ack(c, e, start)
        if op == lib.CHM_OP_NOP:
            return 0, start
        if op == lib.CHM_OP_STATS:
            snap = ctl.snapshot()
            slot = c.stats_slot
            snap.update(self.map_stats())
            for name in STATS_FIELDS:
                setattr(slot, name, int(snap.get(name, 0)))
            slot.clients = len(self.clients)
            slot.clock_ns = int(start)
            return 0, start
        if op == lib.CHM_OP_STATS_JSON:
            snap = ctl.snapshot()
            snap.update(self.map_stats())
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
