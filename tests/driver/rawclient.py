"""A client that speaks the wire directly (no libchm): it can write anything
into its submission ring, which is what the validation tests need."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import platform
import select
import socket
import time
from pathlib import Path

from driver.wire import ffi, lib, node_path, socket_path

_libc = ctypes.CDLL(None, use_errno=True)
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}[platform.machine()]
FUTEX_WAIT = 0  # not _PRIVATE: the word is in memory shared with the device (chm_sync.h waits the same way)
LIVENESS_SLICE_S = 0.02  # a futex wait ends this often to look whether the device closed the connection


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(word, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 ``word`` (a cffi pointer into shared memory) holds ``expected``, at most ``timeout_s``."""
    ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
    _libc.syscall(SYS_FUTEX, ctypes.c_void_p(int(ffi.cast("uintptr_t", word))), FUTEX_WAIT,
                  ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


class RawClient:
    def __init__(self, node: str, entries: int = 16, staging: int = 1 << 20, **attach_fields):
        """``attach_fields``: more fields of struct chm_attach_req (prefetch_share_ppm, rsvd0)."""
        path = node_path(node)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(socket_path(Path(path))))
        req = ffi.new("struct chm_attach_req *", {"magic": lib.CHM_WIRE_MAGIC, "version": lib.CHM_WIRE_VERSION,
                                                  "sq_entries": entries, "cq_entries": entries,
                                                  "staging_bytes": staging, **attach_fields})
        self.sock.sendall(bytes(ffi.buffer(req)))
        msg, fds, _, _ = socket.recv_fds(self.sock, ffi.sizeof("struct chm_attach_resp"), 2)
        resp = ffi.cast("struct chm_attach_resp *", ffi.from_buffer(msg))
        self.status = resp.status
        if resp.status < 0:
            return
        qp_fd, self.evfd = fds
        self.map = mmap.mmap(qp_fd, resp.qp_bytes)
        os.close(qp_fd)
        self._base = ffi.from_buffer(self.map)
        self.hdr = ffi.cast("struct chm_qp_hdr *", self._base)
        self.sq = ffi.cast("struct chm_sqe *", self._base + self.hdr.sq_offset)
        self.cq = ffi.cast("struct chm_cqe *", self._base + self.hdr.cq_offset)
        self.entries = self.hdr.sq_entries
        self.cq_entries = self.hdr.cq_entries  # kept: the header is the client's to scribble on (fuzz tests do)
        self.staging = memoryview(self.map)[self.hdr.staging_offset: self.hdr.staging_offset + self.hdr.staging_bytes]
        self.tail = 0
        self.head = 0

    def raw_slot(self, i: int) -> memoryview:
        """The bytes of submission slot i (to fill with garbage)."""
        size = ffi.sizeof("struct chm_sqe")
        off = self.hdr.sq_offset + (i % self.entries) * size
        return memoryview(self.map)[off: off + size]

    def push(self, **fields) -> None:
        e = self.sq[self.tail % self.entries]
        ffi.memmove(ffi.addressof(e), bytes(ffi.sizeof("struct chm_sqe")), ffi.sizeof("struct chm_sqe"))
        for k, v in fields.items():
            setattr(e, k, v)
        self.publish(self.tail + 1)

    def publish(self, tail: int) -> None:
        self.tail = tail
        self.hdr.sq.tail = tail & 0xFFFFFFFF
        os.eventfd_write(self.evfd, 1)  # always ring: this client does not look at the sleep flag

    def reap(self, n: int = 1, timeout: float = 10.0) -> list[tuple[int, int]]:
        """n completions as (user_data, res). OSError ENODEV once the device has closed this client's
        connection (detached it, or died) with none left, as libchm reports it."""
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            if self.hdr.cq.tail != (self.head & 0xFFFFFFFF):
                c = self.cq[self.head % self.cq_entries]
                out.append((c.user_data, c.res))
                self.head += 1
                self.hdr.cq.head = self.head & 0xFFFFFFFF
            elif self.detached():
                raise OSError(errno.ENODEV, f"the device closed this client's connection ({len(out)} of {n} "
                                            f"completions came)")
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{len(out)} of {n} completions")
            else:
                self.wait_completion(min(LIVENESS_SLICE_S, max(0.0, deadline - time.monotonic())))
        return out

    def wait_completion(self, timeout_s: float) -> None:
        """Sleep until the device posts a completion past this client's head, at most ``timeout_s``: as libchm
        does, announce the sleep (cq.waiting, which makes the device futex-wake cq.tail) and wait on cq.tail."""
        head = self.head & 0xFFFFFFFF
        self.hdr.cq.waiting = 1
        if self.hdr.cq.tail == head:  # looked at again once the device can see the flag
            futex_wait(ffi.addressof(self.hdr.cq, "tail"), head, timeout_s)
        self.hdr.cq.waiting = 0

    def detached(self) -> bool:
        """Has the device closed this client's connection (its detach, as libchm's server_gone sees it)?"""
        if not select.select([self.sock], [], [], 0)[0]:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def stats_json(self, user_data: int = 0) -> dict:
        """The device's CHM_OP_STATS_JSON for this client (it overwrites the staging buffer from offset 0)."""
        n = min(len(self.staging), 1 << 20)
        self.push(user_data=user_data, opcode=lib.CHM_OP_STATS_JSON, len=n, buf_offset=0)
        (_, res), = self.reap(1)
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        return json.loads(bytes(self.staging[:res]))

    def close(self) -> None:
        self.staging.release()
        del self._base
        self.sock.close()
        os.close(self.evfd)


def device_barrier(node: str, timeout: float = 30.0) -> None:
    """One round trip through the device's control path: an attach it refuses (bad magic), answered and closed.

    Whatever was ready on the device's sockets before it (connections closed, requests sent) has been handled
    when it returns: poll() hands the device every ready descriptor at once, and it reads this connection's
    request a poll after the one that accepted it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(socket_path(Path(node_path(node)))))
        s.sendall(bytes(ffi.sizeof("struct chm_attach_req")))  # magic 0: refused (EPROTO) once it is read
        while s.recv(4096):  # the answer, then the device's close
            pass
    except ConnectionResetError:  # closed with the answer unread: handled all the same
        pass
    finally:
        s.close()


def wait_for(cond, what: str, node: str, timeout: float = 30.0, extra=None) -> None:
    """Until ``cond()``, which the device makes true: looked at again after each device_barrier."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what + (f": {extra()}" if extra else "")
        device_barrier(node)


def device_asleep(node: str) -> bool:
    """Is the device asleep in poll(): its server_sleeping flag up and its serving thread blocked?"""
    size = ffi.sizeof("struct chm_node")
    fd = os.open(node_path(node), os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            n = ffi.cast("struct chm_node *", ffi.from_buffer(bytes(m)))
            sleeping, pid = n.server_sleeping, n.server_pid
    finally:
        os.close(fd)
    if not sleeping:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def wait_device_asleep(node: str, timeout: float = 30.0) -> None:
    """Until the device has gone to sleep in poll() (nothing signals that: the flag is looked at again, the CPU
    yielded in between for the device to get there)."""
    deadline = time.monotonic() + timeout
    while not device_asleep(node):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the device on {node} did not go to sleep in {timeout} s")
        os.sched_yield()
