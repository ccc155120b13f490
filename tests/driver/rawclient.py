"""A client that speaks the wire directly (no libchm): it can write anything
into its submission ring, which is what the validation tests need."""

from __future__ import annotations

import errno
import json
import mmap
import os
import select
import socket
import time
from pathlib import Path

from driver.wire import ffi, lib, node_path, socket_path


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
                time.sleep(0.0005)
        return out

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
