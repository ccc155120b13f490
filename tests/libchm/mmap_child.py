"""A client process for tests/libchm/test_mmap*.py: it maps a device and follows commands, one per line on
stdin, answering one line on stdout each (so the test synchronizes on its answers, never on time).

    python -m tests.libchm.mmap_child NODE LENGTH
    $CHM_TEST_MAP_INLINE=1: the mapping is CHM_MAP_INLINE; $CHM_TEST_FAULTHANDLER=1: Python's faulthandler is
    enabled before it (the SIGBUS handler libchm chains to)
    commands: write OFFSET HEX | read OFFSET N | flush | error OFFSET | syscall-read OFFSET | syscall-write OFFSET
              | touch OFFSET | populate OFFSET
              | wait-device-death | quit
"""

from __future__ import annotations

import os
import select
import sys
import time

import libchm


def through_a_pipe(use) -> str:
    """``use(r, w)`` on a fresh pipe (a pipe copies its bytes; /dev/null would not even read them), or the
    errno it failed with."""
    r, w = os.pipe()
    try:
        return use(r, w)
    except OSError as exc:
        return f"errno {exc.errno}"
    finally:
        os.close(r)
        os.close(w)


def main() -> int:
    node, length = sys.argv[1], int(sys.argv[2])
    if os.environ.get("CHM_TEST_FAULTHANDLER") == "1":
        import faulthandler
        faulthandler.enable()
    dev = libchm.Device(node)
    view = dev.mmap(0, length, inline=os.environ.get("CHM_TEST_MAP_INLINE") == "1")
    base = int(libchm.ffi.cast("uintptr_t", libchm.ffi.from_buffer(view)))
    server_pid = dev.info()["server_pid"]
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "write":
            off, data = int(args[0]), bytes.fromhex(args[1])
            view[off: off + len(data)] = data
            answer = "ok"
        elif cmd == "read":
            off, n = int(args[0]), int(args[1])
            answer = bytes(view[off: off + n]).hex()
        elif cmd == "touch":  # a load; SIGBUS ends the process here if the page cannot be served
            answer = str(view[int(args[0])])
        elif cmd == "flush":
            dev.flush()
            answer = "ok"
        elif cmd == "error":
            answer = str(dev.map_error(base + int(args[0])))
        elif cmd == "populate":  # chm_map_populate of one byte: 0 or its -errno, never SIGBUS
            try:
                dev.map_populate(base + int(args[0]), 1)
                answer = "0"
            except libchm.ChmError as exc:
                answer = str(-exc.errno)
        elif cmd == "syscall-read":  # the kernel reads the mapping: EFAULT instead of SIGBUS
            answer = through_a_pipe(lambda r, w: f"wrote {os.write(w, view[int(args[0]): int(args[0]) + 1])}")
        elif cmd == "syscall-write":  # the kernel writes into the mapping (a store fault in kernel mode)
            answer = through_a_pipe(lambda r, w: os.write(w, b"\x5a") and
                                    f"read {os.readv(r, [view[int(args[0]): int(args[0]) + 1]])}")
        elif cmd == "wait-device-death":  # the device's pidfd, then how long until the mapping was withdrawn
            pidfd = os.pidfd_open(server_pid)
            select.select([pidfd], [], [])
            died = time.monotonic()
            deadline = died + 10.0
            while dev.map_error(base) == 0 and time.monotonic() < deadline:
                time.sleep(0.0005)
            answer = f"{dev.map_error(base)} {(time.monotonic() - died) * 1e3:.3f}"
        elif cmd == "quit":
            break
        else:
            answer = f"unknown command {cmd!r}"
        out.write(answer + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
