"""The in-process device API (the contract ``libchm.Device`` mirrors).

One caller, one virtual clock: each call starts when the previous one
finished (or was acknowledged, for ``prefetch``), so ``stats()`` and each
call's ``last_latency_ns`` tell how long the modelled hardware would take.
"""

from __future__ import annotations

import errno
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from .config import Config, load_profile
from .controller import DRAIN_TIMEOUT_S, Controller
from .errors import ChmError


class Device:
    def __init__(self, controller: Controller, owned_dir: str | None = None, pacing: bool = False, clock=time):
        self._ctl: Controller | None = controller
        self._owned_dir = owned_dir
        self.clock_ns = 0.0  # this caller's virtual time
        self.last_latency_ns = 0.0
        self.pacing = pacing
        self.clock = clock  # pacing's wall clock: monotonic() and sleep(seconds) (the time module; tests inject one)
        self._wall_start = clock.monotonic()

    @classmethod
    def open(cls, profile: str | Path = "small", media_dir: str | Path | None = None, policy: str | None = None,
             config: Config | None = None, overrides: Mapping[str, Any] | None = None,
             pacing: bool = False, format_media: bool = False, log=None, clock=time) -> "Device":
        """Open a device from a shipped profile (or ``config``) on a media directory.

        ``policy`` overrides the profile's ``policy.name``; ``overrides`` maps
        dotted field names (``"dram.size_bytes"``) to values. Without a media
        directory the device lives in a temporary one, removed on close.
        With ``pacing`` each call returns no earlier (in wall time since open)
        than its modelled finish, so the caller feels the device's latency.
        ``format_media`` erases the media directory first (foreign, missing or
        truncated media are refused without it); ``log`` receives the
        controller's log lines (media errors, unclean shutdown; default stderr).
        """
        cfg = config if config is not None else load_profile(profile)
        changes = dict(overrides or {})
        if policy is not None:
            changes["policy.name"] = policy
        if changes:
            cfg = cfg.with_overrides(changes)
        owned = None
        if media_dir is None and cfg.emulation.data:
            owned = media_dir = tempfile.mkdtemp(prefix="chm-media-")
        try:
            return cls(Controller(cfg, media_dir, log=log, format_media=format_media), owned, pacing, clock)
        except BaseException:
            if owned:
                shutil.rmtree(owned, ignore_errors=True)
            raise

    # ---- plumbing --------------------------------------------------------------
    @property
    def controller(self) -> Controller:
        if self._ctl is None:
            raise ChmError(errno.ENODEV, "device is closed")
        return self._ctl

    @property
    def config(self) -> Config:
        return self.controller.cfg

    def _advance(self, finish: float) -> None:
        self.last_latency_ns = finish - self.clock_ns
        self.clock_ns = finish
        if self.pacing:
            ahead = self._wall_start + finish / 1e9 - self.clock.monotonic()
            if ahead > 0:
                self.clock.sleep(ahead)

    # ---- the API ---------------------------------------------------------------
    def write(self, addr: int, data) -> int:
        """Write bytes-like ``data`` at ``addr``; returns the byte count.

        Raises WriteBufferFull (EAGAIN) with nothing written when refused."""
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise ChmError(errno.EINVAL, f"data must be bytes-like, not {type(data).__name__}") from None
        ctl = self.controller
        try:
            self._advance(ctl.write(addr, view if ctl.data else None, view.nbytes, self.clock_ns).finish)
        finally:
            view.release()
        return len(data) if isinstance(data, (bytes, bytearray)) else view.nbytes

    def read(self, addr: int, length: int) -> bytes:
        ctl = self.controller
        ctl.check_range(addr, length)
        out = bytearray(length) if ctl.data else None
        self._advance(ctl.read(addr, length, self.clock_ns, memoryview(out) if out is not None else None).finish)
        return bytes(out) if out is not None else b""

    def prefetch(self, addr: int, size: int) -> int:
        issued = self.controller.prefetch(addr, size, self.clock_ns)
        self._advance(issued.ack)
        return issued.handle

    def wait(self, req: int, timeout_ms: float | None = None) -> None:
        if timeout_ms is not None and (not isinstance(timeout_ms, (int, float)) or timeout_ms < 0):
            raise ChmError(errno.EINVAL, f"timeout_ms {timeout_ms!r} must be None or a number >= 0")
        try:
            self._advance(self.controller.wait(req, self.clock_ns, None if timeout_ms is None else timeout_ms * 1e6))
        except ChmError as exc:
            if exc.errno == errno.ETIMEDOUT:
                self._advance(self.clock_ns + timeout_ms * 1e6)
            raise

    def release(self, req: int) -> None:
        self._advance(self.controller.release(req, self.clock_ns))

    def flush(self) -> None:
        self._advance(self.controller.flush(self.clock_ns))

    def idle(self, ns: float) -> None:
        """Let ``ns`` of virtual time pass with no command (background flushing runs)."""
        if isinstance(ns, bool) or not isinstance(ns, (int, float)) or not 0 <= ns < math.inf:  # NaN fails too
            raise ChmError(errno.EINVAL, f"idle time {ns!r} is outside the allowed range: a finite number of ns >= 0")
        self.clock_ns += ns
        self.controller.tick(self.clock_ns)

    def stats(self) -> dict:
        s = self.controller.snapshot()
        s["clock_ns"] = self.clock_ns
        return s

    def info(self) -> dict:
        cfg = self.config
        return {
            "capacity_bytes": cfg.capacity_bytes,
            "dram_bytes": cfg.dram.size_bytes,
            "page_size": cfg.device.page_size_bytes,
            "ssd_count": cfg.ssd.count,
            "policy": cfg.policy.name,
            "write_buffer_bytes": cfg.write_buffer_frames * cfg.device.page_size_bytes,
            "prefetch_window_bytes": cfg.policy.prefetch_window_bytes,
            "profile": cfg.source,
            "device_epoch": self.controller.device_epoch,
        }

    def close(self, drain_timeout_s: float | None = DRAIN_TIMEOUT_S) -> None:
        """Drain and close; while the media fail, retry for at most ``drain_timeout_s`` seconds, then raise
        UnflushedData (what was left unflushed) -- the device is closed either way."""
        if self._ctl is None:
            return
        try:
            self._advance(self._ctl.close(self.clock_ns, drain_timeout_s))
        finally:
            self._ctl = None
            if self._owned_dir:
                shutil.rmtree(self._owned_dir, ignore_errors=True)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_ctl", None) is not None:
            try:
                self.close(drain_timeout_s=0)
            except Exception:
                pass
