"""Full media, two ways: the backend's fault hook (any user), and a real small
tmpfs filled by a filler file (root only: mount; skipped cleanly otherwise).

Both give the device the same trouble: media writes complete with ENOSPC until
``free_space()``."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

MiB = 1 << 20
TMPFS_BYTES = 64 * MiB
FILLER_BYTES = 40 * MiB
DEVICE_WRITE_BYTES = 48 * MiB  # more than the 24 MiB the filler leaves free
# The small profile, tuned so everything written waits in the write buffer until an explicit flush.
HOLD_WRITES = {"policy.flush_batch_bytes": 64 * MiB, "policy.flush_max_delay_ns": 1e15}
# Fault mode: the first flush's media writes (48 one-stripe runs) all fail, retries succeed.
FAULT_OVERRIDES = {"faults.errno": "ENOSPC", "faults.ops": "write", "faults.first_failing_op": 1,
                   "faults.failing_ops": DEVICE_WRITE_BYTES // MiB}
MODES = ["faults", "tmpfs"]


def can_mount() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def small_tmpfs(where: Path, size_bytes: int = TMPFS_BYTES):
    """A real tmpfs of ``size_bytes`` (64 MiB) at ``where`` (root only), always unmounted."""
    if not can_mount():
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024}k", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


class MediaTrouble:
    """Where the media live and how they run out of space, for one mode."""

    def __init__(self, mode: str, base: Path, stack: contextlib.ExitStack):
        self.mode = mode
        if mode == "tmpfs":
            root = stack.enter_context(small_tmpfs(base / "tmpfs"))
            self.media = root / "media"
            self.filler = root / "filler"
            self.overrides = dict(HOLD_WRITES)
        else:
            self.media = base / "media"
            self.filler = None
            self.overrides = {**HOLD_WRITES, **FAULT_OVERRIDES}

    def fill(self) -> None:
        """Take the space (tmpfs: a filler file; faults: the hook is armed from the start)."""
        if self.filler is not None:
            with open(self.filler, "wb") as f:
                for _ in range(FILLER_BYTES // MiB):
                    f.write(os.urandom(MiB))

    def free_space(self) -> None:
        if self.filler is not None:
            self.filler.unlink()
        # faults: the hook fails only the first flush's writes; the next ones find "space"


@contextlib.contextmanager
def read_only_dir(where: Path):
    """``where`` (an existing empty directory) made read-only for the with-block."""
    with contextlib.ExitStack() as stack:
        if can_mount():  # root ignores permission bits: a read-only mount is what really refuses
            if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)]).returncode:
                pytest.skip("cannot mount a read-only tmpfs")
            stack.callback(subprocess.run, ["umount", "-l", str(where)], check=True)
        else:
            where.chmod(0o555)
            stack.callback(where.chmod, 0o755)
        yield where


def read_media(cfg, media: Path, addr: int, length: int) -> bytes:
    """The bytes at device address ``addr`` as they lie in the media files (the documented layout)."""
    from emulator.ssd import locate, media_file

    got = bytearray()
    while len(got) < length:
        ssd, offset = locate(cfg, addr + len(got))
        n = min(cfg.ssd.stripe_bytes - (addr + len(got)) % cfg.ssd.stripe_bytes, length - len(got))
        with open(media_file(media, ssd), "rb") as f:
            f.seek(offset)
            chunk = f.read(n)
        got += chunk + bytes(n - len(chunk))
    return bytes(got)
