"""Helpers shared by the driver, libchm and system tests: a real `chm serve`
process on a node name of its own, and C programs built against libchm."""

from __future__ import annotations

import itertools
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHM = Path(sys.executable).parent / "chm"
LIBCHM = ROOT / "libchm"
_counter = itertools.count()


def unique_node(tag: str = "t") -> str:
    """A device node name no parallel test run uses (pid + counter)."""
    return f"chmtest-{tag}-{os.getpid()}-{next(_counter)}"


def build_libchm() -> None:
    subprocess.run(["make", "-s", "-C", str(LIBCHM)], check=True)


def compile_c(source: Path, out: Path, *extra: str) -> Path:
    """Compile a C program against the in-tree libchm (header, .so, rpath)."""
    build_libchm()
    cmd = ["cc", "-O2", "-Wall", "-Werror", str(source), "-o", str(out), f"-I{LIBCHM / 'include'}",
           f"-L{LIBCHM / 'build'}", f"-Wl,-rpath,{LIBCHM / 'build'}", "-lchm", *extra]
    subprocess.run(cmd, check=True)
    return out


class Server:
    """`chm serve` in a subprocess; stopped (SIGTERM) on exit of the with-block."""

    def __init__(self, media: Path, node: str | None = None, *args: str, wait: bool = True, preexec_fn=None):
        """``preexec_fn``: run in the child before it starts (resource limits: prlimit's job)."""
        self.node = node or unique_node()
        self.media = media
        self.args = args
        # `python -m emulator.serve` is `chm serve` without loading every other subcommand (faster start);
        # tests/emulator/serve/test_cli.py runs the `chm` command itself.
        self.cmd = [sys.executable, "-m", "emulator.serve", "--node", self.node, "--media", str(media), *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     preexec_fn=preexec_fn)
        self.banner = ""
        if wait:
            self.wait_ready()

    @property
    def path(self) -> Path:
        return Path("/dev/shm") / self.node

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                self.banner += line
                if "ready" in line:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"chm serve exited {self.proc.returncode}: {self.proc.stderr.read()}")
        raise TimeoutError(f"chm serve did not get ready: {self.banner}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, self.banner + out, err

    def kill(self) -> None:
        """SIGKILL: the node and socket stay behind, stale."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()
        for p in (self.path, Path(f"{self.path}.sock")):
            if p.exists() and self.proc.returncode not in (0, None):
                p.unlink()  # a killed server's leftovers
