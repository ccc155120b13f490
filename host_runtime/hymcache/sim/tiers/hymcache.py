"""``hymcache``, ``hymcache-noprefetch`` and ``cmm-h``: the runtime's Master and KV Manager in process over the
emulator's Controller, in virtual time."""

from __future__ import annotations

import errno
import struct

from driver.errors import ChmError, WriteBufferFull

from ..events import Env
from .base import NS, RemoteTier
from .host import Host, rdma


class ControllerDevice:
    """What the KV Manager calls on a libchm device handle, served by the emulator's ``Controller`` in
    virtual time (data off). Every call happens at the simulation's now (``clock``), after the device's
    background work due by then (``run_until``, as the replayer does). ``wait`` records when the host
    learns the block is staged (``ready_ns``): the Manager only needs it to be staged, the simulation
    needs the time."""

    def __init__(self, ctl, env: Env):
        self.ctl, self.env = ctl, env
        self.ready_ns: dict[int, float] = {}
        self.node = ""

    def _now(self) -> float:
        self.ctl.run_until(self.env.now)
        return self.env.now

    def info(self) -> dict:
        return {"capacity_bytes": self.ctl.capacity, "device_epoch": self.ctl.device_epoch, "server_pid": 0,
                "page_size": self.ctl.page, "prefetch_limit_pages": self.ctl.prefetch_window_pages}

    def prefetch(self, offset: int, length: int) -> int:
        return self.ctl.prefetch(offset, length, self._now()).handle

    def wait(self, handle: int) -> None:
        self.ready_ns[handle] = self.ctl.wait(handle, self._now())

    def release(self, handle: int) -> None:
        self.ready_ns.pop(handle, None)
        self.ctl.release(handle, self._now())

    def close(self) -> None:
        pass


def sim_manager(node: int, devices: list[ControllerDevice], master, clock, **kwargs):
    """The runtime's ``KVManager`` (its window, EBUSY queueing and release logic unchanged) over
    ``ControllerDevice`` handles, which it opens in device order in place of libchm devices."""
    from host_runtime.hymcache.manager import KVManager

    unopened = list(devices)

    def open_device(path: str) -> ControllerDevice:
        dev = unopened.pop(0)
        dev.node = path
        return dev

    return KVManager(node, [f"sim-node{node}-dev{i}" for i in range(len(devices))], master, clock,
                     open_device=open_device, **kwargs)


class HyMCacheTier(RemoteTier):
    """The runtime's Master and KV Manager in process, over one emulated device (``Controller``, data off),
    all on the simulation's clock.

    * lookup: the Manager's ``hint`` (it resolves the keys beyond the GPU hit against the Master in
      batches of 32, in order, and starts staging them, a window per request);
    * load: per block, in order (the connector's ``_load``): a staging-buffer slot, the Manager's
      ``acquire`` (not staged yet and queued behind a window: ask again after a pause, as the
      ManagerClient polls), the device read over its host link (the Controller's RDMA pipe), the
      Manager's ``release`` (the window moves on), the copy to the GPU over PCIe; a block not staged
      by ``timeout`` after the load began is a load error: it and the rest are recomputed;
    * store: ``put_start`` for the full prompt blocks (the Master answers None for those stored), the
      staging room now (what does not fit is skipped), the copies during the forward, then one
      device write per block, in order; a write the device refuses (write buffer full) is skipped,
      counted and revoked, so the next turn offers it again; one ``put_end``.

    ``prefetch=False`` (the ``hymcache-noprefetch`` tier, policy ``hymcache``; the ``cmm-h`` tier, policy
    ``lru``): no Manager window; demand reads in order, each block looked up in the Master at the load.
    """

    name = "hymcache"

    def __init__(self, env: Env, host: Host, block_bytes: int, cfg, *, window_bytes: int, timeout_s: float,
                 prefetch: bool = True, name: str | None = None, peer: "HyMCacheTier | None" = None):
        from emulator.controller import Controller
        from host_runtime.hymcache.clock import ManualClock
        from host_runtime.hymcache.manager import FIRST_POLL_S
        from host_runtime.hymcache.master import Master

        super().__init__(env, host, block_bytes)
        if name:
            self.name = name
        self.timeout_ns = timeout_s * NS
        if peer is not None:  # another prefill node of the same deployment: one Master, Manager and device
            for a in self._SHARED:
                setattr(self, a, getattr(peer, a))
            return
        self.cfg, self.prefetch = cfg, prefetch
        self.ctl = Controller(cfg, None)
        self.dev = ControllerDevice(self.ctl, env)
        self.clock = ManualClock()
        self.master = Master(self.clock)
        self.manager = sim_manager(0, [self.dev], self.master, self.clock, window_bytes=window_bytes)
        self.poll_ns = FIRST_POLL_S * NS
        self.poll_max_ns = 1e-3 * NS  # ManagerClient's default poll_s
        self.refusal_ns = 2 * cfg.host_link.latency_ns  # a refused write costs one round trip
        self._keys: dict[int, list[bytes]] = {}
        self._hinted: set[str] = set()  # requests the Manager has a hint of
        self._stores: dict[str, tuple[list, list[float]]] = {}
        self.counters = dict.fromkeys(("hinted_blocks", "loaded_blocks", "timeouts", "load_errors", "put_blocks",
                                       "written_blocks", "refused_writes", "staging_skips", "put_no_space"), 0)

    _SHARED = ("cfg", "prefetch", "ctl", "dev", "clock", "master", "manager", "poll_ns", "poll_max_ns", "refusal_ns",
               "_keys", "_hinted", "_stores", "counters", "name")

    def _sync(self) -> float:
        self.clock.t = self.env.now / NS  # the simulation owns this clock
        return self.env.now

    def keys(self, conv: int, n: int) -> list[bytes]:
        """The Master's 16-byte keys of a conversation's first ``n`` blocks (a block's key names its whole
        prefix: the conversation and its position)."""
        ks = self._keys.setdefault(conv, [])
        while len(ks) < n:
            ks.append(struct.pack("<QQ", conv + 1, len(ks)))
        return ks[:n]

    def req_keys(self, req, n: int) -> list[bytes]:
        """A request's first ``n`` block keys: the shared prefix's (owner -1) then its conversation's; a trace's
        request: its own keys (first word all ones: no conversation's)."""
        if req.keys:
            return [struct.pack("<QQ", (1 << 64) - 1, k) for k in req.keys[:n]]
        shared = min(n, req.shared_blocks)
        if not shared:
            return self.keys(req.conv, n)
        return self.keys(-1, shared) + self.keys(req.conv, n)[shared:]

    def lookup(self, req) -> int:
        first, last = req.gpu_hit, req.lookup_blocks
        if last <= first:
            return 0
        keys = self.req_keys(req, last)[first:]
        self._sync()
        if self.prefetch:
            n = self.manager.hint(req.rid, keys)
            self._hinted.add(req.rid)
        else:
            n = len(self.master.lookup(keys))
        self.counters["hinted_blocks"] += n
        return n

    def load(self, req, n: int):
        if n <= 0:
            return 0
        env, staging, B = self.env, self.host.staging, self.block_bytes
        start = env.now
        deadline = start + self.timeout_ns
        keys = self.req_keys(req, req.gpu_hit + n)[req.gpu_hit:]
        locs = None if self.prefetch else self.master.lookup(keys)  # demand reads: where each block is
        done, last = 0, start
        for i, key in enumerate(keys):
            yield from staging.take(B)
            ok = yield from (self._acquire(req, key, keys[i:], deadline) if self.prefetch else self._demand(req, locs, i))
            if not ok:
                staging.give(B)
                break
            arrive = self.host.h2d.transfer(env.now, B)
            env.call_at(arrive, lambda: staging.give(B))
            last = max(last, arrive)
            done += 1
            req.read_bytes += B
        self.finish(req)  # the Manager cancels what it still stages for the request
        self.counters["loaded_blocks"] += done
        if last > env.now:
            yield last
        return done

    def _acquire(self, req, key: bytes, rest: list[bytes], deadline: float):
        """Process: one block through the Manager; True once read into the staging buffer."""
        env, manager = self.env, self.manager
        pause, rehinted = self.poll_ns, False
        while True:
            self._sync()
            try:
                token = manager.acquire(req.rid, key, 0.0)
                break
            except ChmError as exc:
                if exc.errno == errno.ETIMEDOUT and env.now < deadline:  # queued behind a window or EBUSY
                    yield min(env.now + pause, deadline)
                    pause = min(2 * pause, self.poll_max_ns)
                    continue
                if exc.errno == errno.ENOENT and not rehinted:  # the hint was cancelled: hint the rest again
                    rehinted = True
                    manager.hint(req.rid, rest)
                    continue
                self._fail(req, exc.errno == errno.ETIMEDOUT)
                return False
        ready = self.dev.ready_ns.get(token.handle, env.now)
        if ready > deadline:  # not staged within the timeout: the worker waited for it, then recomputes
            yield max(deadline, env.now)
            self._sync()
            manager.release(req.rid, key)
            self._fail(req, True)
            return False
        if ready > env.now:
            yield ready
        finish = self.ctl.read(token.offset, token.length, self.dev._now()).finish
        finish = max(finish, rdma(None, self.host.kv_nic, env.now, token.length))  # this node's port
        yield finish
        self._sync()
        manager.release(req.rid, key)
        return True

    def _demand(self, req, locs, i: int):
        if i >= len(locs):  # evicted from the Master since the lookup
            self._fail(req, False)
            return False
        loc = locs[i]
        finish = self.ctl.read(loc.offset, loc.length, self.dev._now()).finish
        finish = max(finish, rdma(None, self.host.kv_nic, self.env.now, loc.length))
        if finish > self.env.now + self.timeout_ns:
            yield self.env.now + self.timeout_ns
            self._fail(req, True)
            return False
        yield finish
        return True

    def _fail(self, req, timeout: bool) -> None:
        self.counters["timeouts" if timeout else "load_errors"] += 1
        req.timeouts += timeout

    def finish(self, req) -> None:
        """The connector's ``_finish_on``: after the load, or at once when nothing is loaded (a hint with no
        hits, or a request the GPU prefix cache served) -- the Manager forgets the request."""
        if req.rid in self._hinted:
            self._hinted.discard(req.rid)
            self._sync()
            self.manager.finish(req.rid)

    def reserve_store(self, req) -> None:
        keys = self.req_keys(req, req.full_blocks)
        if not keys:
            return
        self._sync()
        try:
            locs = self.master.put_start(req.rid, keys, [self.block_bytes] * len(keys))
        except ChmError as exc:  # ENOSPC: nothing evictable (all leased); offered again next turn
            if exc.errno != errno.ENOSPC:
                raise
            self.counters["put_no_space"] += 1
            return
        todo = [loc for loc in locs if loc is not None]
        if not todo:
            return
        self.counters["put_blocks"] += len(todo)
        room = max(0, self.host.staging.free() // self.block_bytes)
        if room < len(todo):
            skipped = todo[room:]
            todo = todo[:room]
            self.master.put_revoke([loc.key for loc in skipped])
            self.counters["staging_skips"] += len(skipped)
            req.skipped_inserts += len(skipped)
        if not todo:
            return
        self.host.staging.hold(len(todo) * self.block_bytes)
        arrivals = self.host.d2h.stream([self.env.now] * len(todo), [self.block_bytes] * len(todo))
        self._stores[req.rid] = (todo, arrivals)

    def store(self, req):
        pending = self._stores.pop(req.rid, None)
        if pending is None:
            return
        todo, arrivals = pending
        env, B = self.env, self.block_bytes
        written, refused = [], []
        for loc, arrived in zip(todo, arrivals):
            if arrived > env.now:
                yield arrived
            try:
                finish = self.ctl.write(loc.offset, None, loc.length, self.dev._now()).finish
            except WriteBufferFull:
                refused.append(loc.key)
                finish = env.now + self.refusal_ns
            else:
                written.append(loc.key)
                req.write_bytes += loc.length
                finish = max(finish, rdma(self.host.kv_nic, None, env.now, loc.length))  # this node's port
            yield finish
            self.host.staging.give(B)
        self._sync()
        if refused:
            self.master.put_revoke(refused)
            self.counters["refused_writes"] += len(refused)
            req.skipped_inserts += len(refused)
        if written:
            self.master.put_end(written, [0] * len(written))
            self.counters["written_blocks"] += len(written)

    def describe(self) -> dict:
        snap = self.ctl.snapshot()
        m = self.master.stats()
        return {"tier": self.name, "device_policy": self.cfg.policy.name, "dram_bytes": self.cfg.dram.size_bytes,
                "write_buffer_bytes": self.cfg.write_buffer_frames * self.cfg.device.page_size_bytes,
                **self.counters,
                "device": {k: snap[k] for k in ("page_hits", "page_misses", "prefetch_staged_pages",
                                                "prefetch_resident_pages", "refused_writes", "flushed_pages",
                                                "slowed_reads", "ssd_read_bytes", "ssd_write_bytes")},
                "master": {k: m[k] for k in ("blocks", "evictions", "revoked_blocks", "registered_blocks",
                                             "lookup_hits", "put_no_space")},
                "manager": {k: self.manager.counters[k] for k in ("hints", "hint_hits", "prefetches", "ebusy",
                                                                  "releases", "finished",
                                                                  "num_timeouts_recompute")}}
