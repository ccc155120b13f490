"""The serve loop: turns while any client has work (in C where it can, see server.py's "Native hit path"),
the idle sleep in ``poll()`` until a client, the control socket or the next background event wakes the
device, and the device's virtual time. Methods of DeviceServer.
"""

from __future__ import annotations

import traceback

from .connections import ATTACH_TIMEOUT_S
from .parking import PARKED_POLL_NS
from .rings import BULK_OPCODES, lib

CONTROL_POLL_S = 0.002  # look at the control socket at least this often while busy
CONTROL_POLL_NS = int(CONTROL_POLL_S * 1e9)


def idle_wall_wait_ns(event_ns: float, floor_ns: float, wall_virtual_ns: float, pacing: bool) -> float:
    """Wall nanoseconds an idle device waits until its virtual time reaches ``event_ns``. Without pacing,
    virtual time (``floor_ns``) advances by the idle wall time; with pacing it is ``max(floor, wall)``,
    which stands still until the wall clock (``wall_virtual_ns``, on the same origin) passes the floor."""
    if pacing:
        return 0.0 if event_ns <= floor_ns else max(0.0, event_ns - wall_virtual_ns)
    return max(0.0, event_ns - floor_ns)


class ServeLoop:
    """The serve loop, its sleep and the device clock (a DeviceServer mixin)."""

    def serve_forever(self) -> float:
        """Serve until ``request_stop`` (SIGTERM/SIGINT); then drain and remove the node. Returns the drain time."""
        last_control = self.clock.monotonic()
        try:
            while not self.stop_requested:
                if self.parked:
                    self._unpark_landed()
                if self.native_loop:
                    if self._serve_native() == lib.CHM_SRV_IDLE:
                        self._sleep()
                        last_control = self.clock.monotonic()
                        continue
                    now = self.clock.monotonic()
                    if now - last_control > CONTROL_POLL_S:
                        self._control(self.poller.poll(0))
                        last_control = now
                    continue
                if self._run_ready():
                    now = self.clock.monotonic()
                    if now - last_control > CONTROL_POLL_S:
                        self._control(self.poller.poll(0))
                        last_control = now
                    continue
                if self.held:
                    self._post_due()
                if self._order and lib.chm_srv_pending(self._qp_array, len(self._order), self._spin_ns()) >= 0:
                    continue
                self._sleep()
                last_control = self.clock.monotonic()
        finally:
            done = self.shutdown()
        return done

    def _wall_virtual(self) -> float:
        return float(self.clock.monotonic_ns() - self.wall0)

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
        lease_deadline = self._map_next_deadline()
        if lease_deadline is not None:
            waits_ns.append((lease_deadline - self.clock.monotonic()) * 1e9)
        return max(0.0, min(waits_ns) / 1e6) if waits_ns else None

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

    def _sleep(self) -> None:
        node = self.owner.node
        lib.chm_srv_set_sleeping(node, 1)
        if self._order and lib.chm_srv_pending(self._qp_array, len(self._order), 0) >= 0:
            lib.chm_srv_set_sleeping(node, 0)
            return
        timeout_ms = self._idle_timeout_ms()
        t0 = self.clock.monotonic_ns()
        events = self.clock.poll(self.poller, timeout_ms)
        lib.chm_srv_set_sleeping(node, 0)
        if not self.pacing:
            self.floor += self.clock.monotonic_ns() - t0  # idle wall time passes on the device too
        try:  # media errors never raise here (the controller logs and retries them)
            now = self._now()
            self.ctl.run_until(now)  # what fell due while we slept, each at its own virtual time
            self.ctl.tick(now)  # the rest of the housekeeping (staging reads that failed, once unpinned)
        except Exception:  # a device bug in the background flusher must not end serve
            self.log(f"internal error in the background flusher:\n{traceback.format_exc()}")
        self._control(events)
        if self.pending:
            self._drop_stalled_handshakes()
