"""What the KV Manager's tests share (test_manager.py: in process; test_manager_served.py: over ZeroMQ): small
blocks, two devices, a spying Master, blocks stored through the Master, and the waits the tests synchronize on."""

from __future__ import annotations

import os
import threading

import xxhash

import libchm
from host_runtime.hymcache.master import Master
from host_runtime.hymcache.messages import KEY_BYTES

PAGE = 64 << 10
BLOCK = 2 * PAGE  # small blocks: many of them in the small profile's 64 MiB prefetch window


class RecordingMaster:
    """The real Master, with each lookup's batch recorded (a spy: every call goes to the Master)."""

    def __init__(self, master: Master):
        self.master, self.batches = master, []

    def lookup(self, keys):
        self.batches.append(list(keys))
        return self.master.lookup(keys)

    def __getattr__(self, name):
        return getattr(self.master, name)


def store(master, paths: dict[int, str], nblocks: int, size: int = BLOCK, tag: str = "r"):
    """Put ``nblocks`` blocks through the Master (put_start -> libchm writes -> put_end); keys and bytes."""
    keys = [os.urandom(KEY_BYTES) for _ in range(nblocks)]
    data = [os.urandom(size) for _ in range(nblocks)]
    locs = master.put_start(f"put-{tag}-{keys[0].hex()}", keys, [size] * nblocks)
    devs = {}
    for loc, block in zip(locs, data):
        if loc.device not in devs:
            devs[loc.device] = libchm.Device(paths[loc.device])
        devs[loc.device].write(loc.offset, block)
    for d in devs.values():
        d.flush()  # on the media: the hint really stages from flash
        d.close()
    assert master.put_end(keys, [xxhash.xxh3_64_intdigest(b) for b in data]) == nblocks
    return keys, data, {loc.device for loc in locs}


def pages_held(path: str) -> int:
    with libchm.Device(path) as d:
        return d.stats()["prefetch_pages_held"]


class LogWatch:
    """A Manager's ``log``: its lines, and a wait for one that says something (what the test synchronizes on)."""

    def __init__(self):
        self.lines, self._cond = [], threading.Condition()

    def __call__(self, line: str) -> None:
        with self._cond:
            self.lines.append(line)
            self._cond.notify_all()

    def wait_for(self, words: str, timeout_s: float = 30.0) -> str:
        with self._cond:
            assert self._cond.wait_for(lambda: any(words in line for line in self.lines), timeout_s), \
                f"no log line with {words!r}: {self.lines}"
            return next(line for line in self.lines if words in line)


def when_held(server) -> threading.Event:
    """Set once ``server`` (a ManagerServer) holds a call: a spy on its answering (the serving thread's)."""
    held = threading.Event()
    answer = server._answer

    def spy(frames):
        answer(frames)
        if server.held:
            held.set()
    server._answer = spy
    return held
