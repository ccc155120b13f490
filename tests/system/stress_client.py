"""The Python twin of stress_client.c (through libchm.Device); same arguments, same output."""

import os
import random
import sys
import time

from libchm import Device, WriteBufferFull


def shared_bytes(offset: int, length: int) -> bytes:
    return bytes(((i * 2654435761) >> 13) & 0xFF for i in range(offset, offset + length))


def main(node, seed, own, own_size, shared, shared_size, seconds, hold_prefetch="0"):
    rng = random.Random(int(seed))
    own, own_size, shared, shared_size = int(own, 0), int(own_size, 0), int(shared, 0), int(shared_size, 0)
    ops = mismatches = refused = 0
    pattern = shared_bytes(0, shared_size)
    with Device(node) as dev:
        if hold_prefetch == "1":  # the victim of the SIGKILL test holds a handle when it dies
            dev.wait(dev.prefetch(shared, 1 << 20))
            print("holding", flush=True)
        ref = bytearray(dev.read(own, own_size))
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            kind = rng.randrange(3)
            n = rng.randrange(1, own_size // 4)
            off = rng.randrange(own_size - n + 1)
            if kind == 0:
                data = rng.randbytes(n)
                try:
                    dev.write(own + off, data)
                    ref[off: off + n] = data
                except WriteBufferFull:
                    refused += 1
                    os.sched_yield()  # let the device drain it; no timing: a refused write is retried later
            elif kind == 1:
                mismatches += dev.read(own + off, n) != ref[off: off + n]
            else:
                n = rng.randrange(1, shared_size // 2)
                off = rng.randrange(shared_size - n + 1)
                mismatches += dev.read(shared + off, n) != pattern[off: off + n]
            ops += 1
        mismatches += dev.read(own, own_size) != ref
    print(f"ops={ops} mismatches={mismatches} refused={refused}", flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
