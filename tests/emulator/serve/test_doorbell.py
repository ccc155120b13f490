"""Each client has its own doorbell (issue #21): a client that drains its eventfd as fast as it can
swallows only its own wake-ups. With one eventfd shared by every client, such a client ate its
neighbours' doorbells and, with --spin-us 0 (the device sleeps as soon as its rings are empty), a
libchm client beside it hung on its first call."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from tests.driver.rawclient import RawClient
from tests.emulator.serve.serving import ROOT, Server

CALLS = 100
DEADLINE_S = 30.0  # for all CALLS: far beyond a slow CI (they take milliseconds), short of a hang

# The well-behaved client: a libchm process that writes once, then reads back, one line per answered call.
GOOD_CLIENT = """
import sys, libchm
dev = libchm.Device(sys.argv[1], staging_bytes=1 << 20)
data = bytes(range(256)) * 16
dev.write(0, data)
for i in range(int(sys.argv[2])):
    assert dev.read(0, len(data)) == data
    print(i, flush=True)
"""


def drain_forever(evfd: int) -> None:
    """The hostile client: take every doorbell as soon as it rings (forked child; never returns)."""
    poller = select.poll()
    poller.register(evfd, select.POLLIN)
    while True:
        poller.poll()
        try:
            os.eventfd_read(evfd)
        except BlockingIOError:
            pass


def test_a_client_draining_its_doorbell_starves_nobody(tmp_path):
    with Server(tmp_path, None, "--spin-us", "0") as srv:
        hostile = RawClient(srv.node)
        assert hostile.status == 0
        drainer = os.fork()
        if drainer == 0:  # pragma: no cover - the child
            try:
                drain_forever(hostile.evfd)
            finally:
                os._exit(0)
        good = subprocess.Popen([sys.executable, "-c", GOOD_CLIENT, str(srv.path), str(CALLS)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        answered = 0
        try:
            deadline = time.monotonic() + DEADLINE_S
            while answered < CALLS and time.monotonic() < deadline:
                ready, _, _ = select.select([good.stdout], [], [], max(0.0, deadline - time.monotonic()))
                if not ready or not good.stdout.readline():
                    break
                answered += 1
        finally:
            good.kill()
            _, err = good.communicate()
            os.kill(drainer, signal.SIGKILL)
            os.waitpid(drainer, 0)
            hostile.close()
        assert answered == CALLS, f"{answered} of {CALLS} calls answered beside a client draining its doorbell: {err}"
        assert srv.proc.poll() is None
