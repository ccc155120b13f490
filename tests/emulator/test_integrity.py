"""Data integrity: random operations against a plain bytearray reference."""

import errno
import os
import shutil
import tempfile

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from emulator import ChmError, Device, WriteBufferFull

from .conftest import TINY

CAPACITY = 2 * TINY["ssd.capacity_bytes"]
PAGE = TINY["device.page_size_bytes"]
STRIPE = TINY["ssd.stripe_bytes"]
WINDOW_PAGES = TINY["policy.prefetch_window_bytes"] // PAGE
MAX_HANDLES = TINY["policy.prefetch_max_handles"]

# Addresses cluster around page and stripe boundaries, where bugs live.
boundary = st.builds(lambda k, unit, d: max(0, min(CAPACITY - 1, k * unit + d)),
                     st.integers(0, CAPACITY // PAGE), st.sampled_from([PAGE, STRIPE]), st.integers(-3, 3))
address = st.one_of(boundary, st.integers(0, CAPACITY - 1))
length = st.one_of(st.integers(1, 16), st.integers(1, 3 * PAGE), st.sampled_from([PAGE, 2 * PAGE, STRIPE]))


def pages_of(addr, size):
    return (addr + size - 1) // PAGE - addr // PAGE + 1


class DeviceMachine(RuleBasedStateMachine):
    policy = "hymcache"
    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="chm-hyp-", dir=os.environ.get("CHM_TEST_DIR"))
        self.ref = bytearray(CAPACITY)
        self.held = {}  # live handle -> pages
        self.released = set()
        self.generation = 0  # handles of a closed device are stale; numbers restart on reopen
        self.dev = self._open()

    def _open(self):
        return Device.open("small", self.dir, policy=self.policy, overrides=TINY)

    @rule(addr=address, size=length, seed=st.integers(0, 255))
    def write(self, addr, size, seed):
        size = min(size, CAPACITY - addr)
        data = bytes((seed + i * 7) & 0xFF for i in range(size))
        try:
            assert self.dev.write(addr, data) == size
        except WriteBufferFull:
            assert self.policy == "hymcache"
            event("write refused")
            return  # refused: nothing may have changed, which later reads check
        self.ref[addr:addr + size] = data

    @rule(addr=address, size=length)
    def read(self, addr, size):
        size = min(size, CAPACITY - addr)
        assert self.dev.read(addr, size) == bytes(self.ref[addr:addr + size])

    @rule(target=handles, addr=address, size=length)
    def prefetch(self, addr, size):
        size = min(size, CAPACITY - addr)
        pages = pages_of(addr, size)
        try:
            handle = self.dev.prefetch(addr, size)
        except ChmError as exc:
            if pages > WINDOW_PAGES:
                assert exc.errno == errno.EINVAL
            else:
                assert exc.errno == errno.EBUSY
                assert len(self.held) == MAX_HANDLES or sum(self.held.values()) + pages > WINDOW_PAGES
            return self.generation, -1
        assert pages <= WINDOW_PAGES and len(self.held) < MAX_HANDLES
        assert sum(self.held.values()) + pages <= WINDOW_PAGES
        self.held[handle] = pages
        return self.generation, handle

    def _live(self, ref):
        generation, handle = ref
        return handle if generation == self.generation else -2

    @rule(ref=handles)
    def wait(self, ref):
        handle = self._live(ref)
        if handle in self.held:
            self.dev.wait(handle)
        else:
            with pytest.raises(ChmError) as exc:
                self.dev.wait(handle)
            assert exc.value.errno == errno.EINVAL

    @rule(ref=consumes(handles))
    def release(self, ref):
        handle = self._live(ref)
        if handle in self.held:
            self.dev.release(handle)
            del self.held[handle]
            self.released.add(handle)
        else:
            with pytest.raises(ChmError) as exc:
                self.dev.release(handle)
            assert exc.value.errno == errno.EINVAL

    @precondition(lambda self: self.released)
    @rule()
    def release_again(self):
        with pytest.raises(ChmError) as exc:
            self.dev.release(next(iter(self.released)))
        assert exc.value.errno == errno.EINVAL

    @rule()
    def flush(self):
        self.dev.flush()
        assert self.dev.stats()["dirty_pages"] == 0

    @rule(ns=st.sampled_from([1e3, 1e5, 2e6]))
    def idle(self, ns):
        self.dev.idle(ns)

    @rule()
    def reopen(self):
        self.dev.close()
        self.held.clear()
        self.released.clear()
        self.generation += 1
        self.dev = self._open()

    def teardown(self):
        stats = self.dev.stats()
        for key in ("evictions", "dirty_evictions", "merged_misses", "rmw_reads", "flush_batches"):
            if stats[key]:
                event(key)  # shows with --hypothesis-show-statistics: which paths the runs reached
        self.dev.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @invariant()
    def window_accounting(self):
        assert self.dev.stats()["prefetch_pages_held"] == sum(self.held.values())


class LruMachine(DeviceMachine):
    policy = "lru"


SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestHymcacheIntegrity = DeviceMachine.TestCase
TestHymcacheIntegrity.settings = SETTINGS
TestLruIntegrity = LruMachine.TestCase
TestLruIntegrity.settings = SETTINGS
