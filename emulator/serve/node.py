"""The device node file (``/dev/shm/<node>``): what a client reads before it attaches."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

from emulator.config import Config
from emulator.errors import ChmError

from driver.wire import node_path, socket_path

from .rings import ffi, lib


class NodeOwner:
    """The device node file: exclusive while this server lives (flock), 0600."""

    def __init__(self, node: str, log):
        self.path = node_path(node)
        self.sock_path = socket_path(self.path)
        size = ffi.sizeof("struct chm_node")
        old_umask = os.umask(0o077)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ChmError(exc.errno or errno.EIO, f"cannot create device node {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old_umask)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = self._old_pid(size)
            os.close(self.fd)
            raise ChmError(errno.EBUSY, f"device node {self.path} is already served by pid {pid}; "
                                        f"stop that server or choose another --node") from None
        old = self._old_pid(size)
        if old is not None:
            log(f"replacing stale device node {self.path} left by pid {old}")
        try:
            os.ftruncate(self.fd, 0)
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)  # backed now: a full /dev/shm is ENOSPC here, not SIGBUS later
            os.fchmod(self.fd, 0o600)
            self.map = mmap.mmap(self.fd, size)
        except OSError as exc:
            os.unlink(self.path)  # ours: we hold its lock
            os.close(self.fd)
            raise ChmError(exc.errno or errno.EIO, f"cannot set up device node {self.path}: {exc.strerror}") from None
        self._cdata = ffi.from_buffer(self.map)
        self.node = ffi.cast("struct chm_node *", self._cdata)

    def _old_pid(self, size: int) -> int | None:
        try:
            raw = os.pread(self.fd, size, 0)
        except OSError:
            return None
        if len(raw) < size:
            return None
        n = ffi.cast("struct chm_node *", ffi.from_buffer(raw))
        return n.server_pid if n.magic == lib.CHM_WIRE_MAGIC else None

    def publish(self, cfg: Config, pacing: bool, device_epoch: int = 0) -> None:
        n = self.node
        n.device_epoch = device_epoch
        n.version = lib.CHM_WIRE_VERSION
        n.server_pid = os.getpid()
        n.capacity_bytes = cfg.capacity_bytes
        n.dram_bytes = cfg.dram.size_bytes
        n.page_size = cfg.device.page_size_bytes
        n.write_buffer_bytes = cfg.write_buffer_frames * cfg.device.page_size_bytes
        n.prefetch_window_bytes = cfg.policy.prefetch_window_bytes
        n.ssd_count = cfg.ssd.count
        n.prefetch_max_handles = cfg.policy.prefetch_max_handles
        n.data = int(cfg.emulation.data)
        n.pacing = int(pacing)
        n.policy = cfg.policy.name.encode()[: lib.CHM_NAME_MAX - 1]
        n.profile = cfg.source.encode()[: lib.CHM_PROFILE_MAX - 1]
        n.magic = lib.CHM_WIRE_MAGIC  # last: a reader that sees it sees the rest (x86 keeps store order)

    def withdraw(self) -> None:
        """Stop new clients: clear the magic and remove the names (the lock goes last, in close)."""
        self.node.magic = 0
        for p in (self.sock_path, self.path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.node = None
        del self._cdata
        self.map.close()
        os.close(self.fd)
