"""The KV Manager: construction, registration with the Master, its devices going away and coming back, figures
and close. See manager.py for the whole; hints and blocks are mixins (manager_hints.py, manager_blocks.py)."""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from typing import Callable

import libchm
from driver.errors import ChmError
from host_runtime.hymcache.clock import Clock
from host_runtime.hymcache.confirmer import _Confirmer
from host_runtime.hymcache.manager_blocks import BlockPath
from host_runtime.hymcache.manager_hints import HintPath
from host_runtime.hymcache.manager_state import (FAILED, ISSUED, LOOKUP_BATCH, MAX_NODE, MAX_WINDOW_BYTES,
                                                 REOPEN_INTERVAL_S, REQUEST_TIMEOUT_S, STAGED, check,
                                                 _check_seconds, _node_id, _Request, node_path)
from host_runtime.hymcache.messages import DeviceInfo
from host_runtime.hymcache.window import WINDOW_BYTES


class KVManager(HintPath, BlockPath):
    """The KV Manager of storage node ``node``: its devices are the ``chm serve`` nodes ``device_nodes``.

    ``master`` is a Master (in process) or a MasterClient; ``clock`` times request timeouts and
    acquire deadlines. ``window_bytes`` bounds each request's staged blocks (min 2 blocks). Its hints are
    manager_hints.py's, its blocks manager_blocks.py's; the state they share is set up here.
    """

    def __init__(self, node: int, device_nodes: list[str], master, clock: Clock, *, window_bytes: int = WINDOW_BYTES,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, endpoint: str = "", batch: int = LOOKUP_BATCH,
                 log: Callable[[str], None] | None = None, open_device: Callable[[str], libchm.Device] = libchm.Device):
        self.node = check.int("node", node, 0, MAX_NODE)
        if (not isinstance(device_nodes, (list, tuple)) or not device_nodes
                or not all(isinstance(d, str) and d for d in device_nodes)):
            raise ChmError(errno.EINVAL, f"device_nodes {device_nodes!r} must be a non-empty list of chm serve "
                                         "node names or paths")
        self.window_bytes = check.int("window_bytes", window_bytes, 1, MAX_WINDOW_BYTES)
        self.request_timeout_s = _check_seconds("request_timeout_s", request_timeout_s, allow_zero=False)
        self.batch = check.int("batch", batch, 1, LOOKUP_BATCH)
        if not isinstance(endpoint, str):
            raise ChmError(errno.EINVAL, f"endpoint {endpoint!r} must be a str (a ZeroMQ address, or '' in process)")
        for method in ("lookup", "register_node"):
            if not callable(getattr(master, method, None)):
                raise ChmError(errno.EINVAL, f"master {master!r} has no {method}(): pass a Master or a MasterClient")
        self.master, self.clock, self.endpoint = master, clock, endpoint
        self.log = log or (lambda msg: None)
        self._open_device = open_device  # libchm.Device; the serving simulation passes its emulated devices
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.lease_secret: bytes | None = None  # the node's, from register_node: the served read checks leases
        self._confirmer: _Confirmer | None = None  # confirm_in_background
        self.held_calls = 0    # set by the served Manager: acquires/reads it holds until their block is staged
        # One libchm handle per device, in device order; None while the device is gone (see _gone/_reopen).
        self.handles: list[libchm.Device | None] = []
        self.requests: OrderedDict[str, _Request] = OrderedDict()   # oldest first: issued first
        try:
            for name in device_nodes:
                self.handles.append(open_device(node_path(name)))
        except ChmError:
            self.close()
            raise
        self.infos = [DeviceInfo(device=i, node_path=node_path(name), capacity_bytes=dev.info()["capacity_bytes"],
                                 epoch=dev.info()["device_epoch"])
                      for i, (name, dev) in enumerate(zip(device_nodes, self.handles))]
        # Who served each device when it was opened: another pid or node file means it was restarted.
        self._served_by = [(dev.info()["server_pid"], _node_id(dev.node)) for dev in self.handles]
        self._check_at = [0.0] * len(self.handles)  # clock time of each device's next reopen / restart check
        self._gone_why = [""] * len(self.handles)   # why a gone device is not back (its ENODEV says it)
        self.counters = dict.fromkeys((
            "hints", "hinted_keys", "hint_hits", "hint_other_node", "hint_locs_used", "hint_locs_unconfirmed",
            "confirm_errors", "num_retrieve_requests", "num_hit_tokens",
            "prefetches", "ebusy", "unfit", "releases", "num_load_errors", "finished", "num_timeouts_recompute",
            "cancelled_disconnect", "remote_reads", "remote_read_bytes", "remote_writes", "remote_write_bytes",
            "write_refused", "devices_gone", "devices_reopened", "devices_new_epoch", "leases_refused",
            "reads_refused"), 0)
        self.device_counters = [dict.fromkeys(("prefetches", "prefetch_bytes", "ebusy", "read_bytes",
                                               "written_bytes", "write_refused", "gone", "reopened"), 0)
                                for _ in self.handles]
        self.held_bytes = [0] * len(self.handles)
        self.window_bytes_max = 0
        self.handles_max = 0
        try:
            self.register(endpoint)
        except BaseException:  # the Master unreachable or refusing: detach from the devices again
            self.close()
            raise

    # ---- registration --------------------------------------------------------------
    def register(self, endpoint: str | None = None) -> None:
        """Announce this node and its devices to the Master (again, e.g. once the server knows its port)."""
        with self._lock:
            if endpoint is not None:
                self.endpoint = endpoint
            self._took_secret(self.master.register_node(self.node, self.endpoint, list(self.infos)))

    def _took_secret(self, answer) -> None:
        """The node's lease secret: register_node's answer over ZeroMQ, or an in-process Master's."""
        if isinstance(answer, (bytes, bytearray)) and answer:
            self.lease_secret = bytes(answer)
        elif callable(getattr(self.master, "node_secret", None)):
            self.lease_secret = self.master.node_secret(self.node)

    # ---- devices that go away and come back ----------------------------------------
    def _handle(self, i: int) -> libchm.Device:
        """Device ``i``'s handle, reopened first if it went away; ENODEV while it stays gone."""
        dev = self.handles[i] or self._reopen(i)
        if dev is None:
            raise ChmError(errno.ENODEV, f"device {i} ({self.infos[i].node_path}) is gone ({self._gone_why[i]}); "
                                         f"reopened at most every {REOPEN_INTERVAL_S:g} s")
        return dev

    def _gone(self, i: int, exc: ChmError) -> None:
        """Device ``i`` answered ENODEV: drop its handle; the blocks staged through it go with it (failed)."""
        dev = self.handles[i]
        if dev is None:
            return
        self.handles[i] = None
        self._gone_why[i] = exc.message
        self._check_at[i] = self.clock.now()  # the next use tries at once: it may be back already
        self.counters["devices_gone"] += 1
        self.device_counters[i]["gone"] += 1
        self.log(f"device {i} ({self.infos[i].node_path}) went away ({exc.message}); its staged blocks failed")
        try:
            dev.close()
        except ChmError:
            pass
        lost = ChmError(errno.ENODEV, f"device {i} ({self.infos[i].node_path}) went away while the block was "
                                      f"staged on it ({exc.message})")
        for req in self.requests.values():
            for block in req.blocks[:req.next_issue]:
                if block.loc.device == i and block.state in (ISSUED, STAGED):
                    if block.handle:  # held (an unfit block, handle 0, never was)
                        req.held -= 1
                        self.held_bytes[i] -= block.loc.length
                    block.state, block.handle, block.error = FAILED, 0, lost
                    self.counters["num_load_errors"] += 1
        self._changed.notify_all()

    def _reopen(self, i: int) -> libchm.Device | None:
        """Try to reopen gone device ``i`` (at most every REOPEN_INTERVAL_S); its handle, or None.

        Back with another epoch or capacity, its blocks are stale: the node is registered again (the Master
        drops them). If the Master cannot be told, the device stays gone: serving it would serve stale blocks."""
        now = self.clock.now()
        if now < self._check_at[i]:
            return None
        self._check_at[i] = now + REOPEN_INTERVAL_S
        path = self.infos[i].node_path
        try:
            dev = self._open_device(path)
        except ChmError as exc:
            self._gone_why[i] = exc.message
            return None
        try:
            info = dev.info()
            old = self.infos[i]
            new = DeviceInfo(device=i, node_path=path, capacity_bytes=info["capacity_bytes"],
                             epoch=info["device_epoch"])
            if (new.epoch, new.capacity_bytes) != (old.epoch, old.capacity_bytes):
                infos = list(self.infos)
                infos[i] = new
                self.master.register_node(self.node, self.endpoint, infos)
                self.counters["devices_new_epoch"] += 1
                self.log(f"device {i} ({path}) is back with epoch {new.epoch} (was {old.epoch}): node "
                         f"{self.node} registered again, its old blocks are stale")
            self.infos[i] = new
        except Exception as exc:  # the Master unreachable or refusing: try it all again later
            dev.close()
            self._gone_why[i] = f"back, but registering its new epoch failed: {exc}"
            self.log(f"device {i} ({path}): {self._gone_why[i]}")
            return None
        self.handles[i] = dev
        self._served_by[i] = (info["server_pid"], _node_id(path))
        self._gone_why[i] = ""
        self.counters["devices_reopened"] += 1
        self.device_counters[i]["reopened"] += 1
        self.log(f"device {i} ({path}) reopened")
        return dev

    def _check_devices(self) -> None:
        """The tick's look at each device (at most every REOPEN_INTERVAL_S): reopen a gone one; drop a live
        one whose node shows another server (restarted while nothing here used it), then reopen it."""
        now = self.clock.now()
        for i, dev in enumerate(self.handles):
            if now < self._check_at[i]:
                continue
            if dev is not None:
                self._check_at[i] = now + REOPEN_INTERVAL_S
                try:  # the node's shared page and a stat: no round trip to the device
                    now_by = (dev.info()["server_pid"], _node_id(self.infos[i].node_path))
                except ChmError as exc:
                    self._gone(i, exc)
                else:
                    if now_by == self._served_by[i]:
                        continue
                    self._gone(i, ChmError(errno.ENODEV, f"restarted: served by (pid, node file) {now_by}, "
                                                         f"was {self._served_by[i]}"))
            self._reopen(i)

    def _attached(self, i: int) -> bool:
        return i < len(self.handles) and self.handles[i] is not None  # none at all once closed

    def _device_error(self, i: int, exc: ChmError) -> None:
        """After a failed call on device ``i``: ENODEV means it went away."""
        if exc.errno == errno.ENODEV:
            self._gone(i, exc)


    # ---- figures -------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        """This node's devices, as registered with the Master."""
        return list(self.infos)

    def stats(self) -> dict:
        with self._lock:
            per_device = []
            for info, counters, held in zip(self.infos, self.device_counters, self.held_bytes):
                per_device.append({"node": self.node, "device": info.device, "node_path": info.node_path,
                                   "capacity_bytes": info.capacity_bytes, "staged_bytes": held,
                                   "attached": int(self._attached(info.device)), **counters})
            return {**self.counters, "node": self.node, "requests": len(self.requests),
                    "prefetch_window_bytes": sum(self.held_bytes), "prefetch_window_bytes_max": self.window_bytes_max,
                    "handles_held": sum(r.held for r in self.requests.values()), "handles_held_max": self.handles_max,
                    "queued_blocks": sum(len(r.blocks) - r.next_issue for r in self.requests.values()),
                    "window_bytes": self.window_bytes, "held_calls": self.held_calls, "devices": per_device}

    def close(self) -> None:
        confirmer, self._confirmer = self._confirmer, None
        if confirmer is not None:
            confirmer.close()  # outside the lock: its thread takes it
        with self._lock:
            for req in list(self.requests.values()):
                self._cancel(req)
            for dev in self.handles:
                if dev is not None:
                    dev.close()
            self.handles = []

    def __enter__(self) -> "KVManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

