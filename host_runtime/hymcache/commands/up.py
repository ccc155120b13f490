"""``chm hymcache up``: a whole set on this machine (Master, devices, Managers), each its own child process,
restarted when it dies and stopped in order."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from common.cli import UsageError
from driver.errors import ChmError

from .common import (DEFAULT_STOP_TIMEOUT_S, PORT_MAX, PR_SET_PDEATHSIG, READY_TIMEOUT_S, RESTART_WINDOW_S, STOP_SIGNALS,
                     _curve, _endpoint)


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when ``up`` dies (even by SIGKILL); stop signals unblocked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def read_lines(proc: subprocess.Popen, deadline: float, name: str):
    """The lines ``proc`` writes to its stdout pipe (binary, read unbuffered: a line select() no longer
    sees is never stuck in a buffer) until ``deadline``; ChmError if it exits first."""
    fd = proc.stdout.fileno()
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], min(0.5, max(0.0, deadline - time.monotonic())))
        chunk = os.read(fd, 65536) if ready else b""
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode(errors="replace") + "\n"
        if ready and not chunk:  # EOF: it exited (or closed its stdout)
            proc.wait()
            text = buf.decode(errors="replace").strip()
            raise ChmError(errno.EIO, f"{name} exited with status {proc.returncode} before it was ready"
                                      f"{': ' + text if text else ''} (its errors are above)")


def _drain(pipe, timeout_s: float = 2.0) -> str:
    """What is left in an exited child's stdout pipe (bounded: a leftover holder of the pipe never blocks us)."""
    fd, out = pipe.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    pipe.close()
    return out.decode(errors="replace")


@dataclass
class Child:
    """One process of the set, in a process group of its own (Ctrl-C reaches ``up`` alone, which stops
    the children in order)."""

    role: str            # "device", "master", "manager"
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    banner: str = ""
    restarts: list = field(default_factory=list)  # monotonic times it was started again

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL,
                                     process_group=0, preexec_fn=_die_with_parent)

    def wait_ready(self, deadline: float) -> None:
        """Until the child's ready line: a JSON line for master/manager, ``...; ready`` for chm serve."""
        for line in read_lines(self.proc, deadline, self.name):
            if self.role == "device":
                self.banner += line
                if line.rstrip().endswith("ready"):
                    return
            elif line.startswith("{"):
                self.info = json.loads(line)
                return
            else:
                self.banner += line
        raise ChmError(errno.ETIMEDOUT, f"{self.name} not ready within {READY_TIMEOUT_S:g} s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class HyMCacheSet:
    """A Master, NODES x DEVICES ``chm serve`` devices and one KV Manager per node, as processes.

    ``start()`` returns once every piece is ready (or stops what started and raises); ``stop()`` stops
    them in order: managers, master, devices; each group SIGTERM, then SIGKILL past ``stop_timeout_s``.
    Used by ``chm hymcache up`` and ``chat``, by the tests and by the bench.
    """

    def __init__(self, nodes: int = 1, devices_per_node: int = 2, *, profile: str = "small",
                 media_root: str | None = None, bind: str = "127.0.0.1", master_port: int = 0,
                 curve_keys: str | None = None, state_dir: str | None = None, metrics_port: int = 0,
                 put_timeout_s: float | None = None, device_overrides: list[str] = (),
                 stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S, tag: str | None = None,
                 label: str = "chm hymcache up", verbose: bool = True, insecure: bool = False):
        self.nodes, self.devices_per_node = nodes, devices_per_node
        self.insecure = insecure  # children may bind a non-loopback --bind without keys
        self.profile, self.media_root, self.bind = profile, media_root, bind
        self.master_port, self.curve_keys, self.state_dir = master_port, curve_keys, state_dir
        self.metrics_port, self.put_timeout_s = metrics_port, put_timeout_s
        self.device_overrides, self.stop_timeout_s = list(device_overrides), stop_timeout_s
        self.tag = tag or f"hymcache-{os.getpid()}"
        self.label, self.verbose = label, verbose  # verbose: a line per stopped child on stdout
        self.devices: list[Child] = []
        self.master: Child | None = None
        self.managers: list[Child] = []
        self.exit_codes: dict[str, int] = {}

    def device_node(self, node: int, device: int) -> str:
        return f"{self.tag}-n{node}d{device}"

    @property
    def children(self) -> list[Child]:
        return [*self.managers, *([self.master] if self.master else []), *self.devices]

    def start(self) -> "HyMCacheSet":
        py = sys.executable
        if self.curve_keys:  # each Manager calls the Master with its own node key
            from ..rpc import make_curve_keys

            make_curve_keys(self.curve_keys, self.nodes)
        try:
            for n in range(self.nodes):
                for d in range(self.devices_per_node):
                    node = self.device_node(n, d)
                    cmd = [py, "-m", "emulator.serve", "--node", node, "--profile", self.profile]
                    if self.media_root:
                        cmd += ["--media", os.path.join(self.media_root, f"node{n}-dev{d}")]
                    for o in self.device_overrides:
                        cmd += ["--set", o]
                    self.devices.append(Child("device", f"device {node}", cmd))
            for c in self.devices:
                c.start()
            cmd = [py, "-m", "host_runtime.hymcache.cli", "master", "--bind", self.bind,
                   "--port", str(self.master_port)]
            if self.state_dir:
                cmd += ["--state-dir", self.state_dir]
            if self.curve_keys:
                cmd += ["--curve-keys", self.curve_keys]
            if self.insecure:
                cmd += ["--insecure"]
            if self.metrics_port:
                cmd += ["--metrics-port", str(self.metrics_port)]
            if self.put_timeout_s is not None:
                cmd += ["--put-timeout", repr(self.put_timeout_s)]
            self.master = Child("master", "master", cmd)
            self.master.start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            for c in (self.master, *self.devices):
                c.wait_ready(deadline)
            for n in range(self.nodes):
                cmd = [py, "-m", "host_runtime.hymcache.cli", "manager", "--master", self.master_endpoint,
                       "--node", str(n), "--bind", self.bind]
                for d in range(self.devices_per_node):
                    cmd += ["--device", self.device_node(n, d)]
                if self.curve_keys:
                    cmd += ["--curve-keys", self.curve_keys, "--key", f"node-{n}"]
                if self.insecure:
                    cmd += ["--insecure"]
                if self.metrics_port:
                    cmd += ["--metrics-port", str(self.metrics_port + 1 + n)]
                self.managers.append(Child("manager", f"manager {n}", cmd))
            for c in self.managers:
                c.start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            for c in self.managers:
                c.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def master_endpoint(self) -> str:
        return self.master.info["endpoint"]

    def describe(self) -> dict:
        return {
            "master": self.master_endpoint,
            "master_pid": self.master.proc.pid,
            "master_metrics_port": self.master.info.get("metrics_port", 0),
            "state_dir": self.state_dir,
            "curve_keys": self.curve_keys,
            "managers": [{"node": n, "endpoint": c.info["endpoint"], "pid": c.proc.pid,
                          "metrics_port": c.info.get("metrics_port", 0), "devices": c.info.get("devices", [])}
                         for n, c in enumerate(self.managers)],
            "devices": [{"node": i // self.devices_per_node, "device": i % self.devices_per_node,
                         "path": f"/dev/shm/{self.device_node(i // self.devices_per_node, i % self.devices_per_node)}",
                         "pid": c.proc.pid} for i, c in enumerate(self.devices)],
        }

    def restart(self, c: Child) -> None:
        """Start an exited child again with its command, until it is ready (else ChmError). The Master gets
        the port it had, so the Managers and workers that know its address find it again; a Manager or a
        device comes back as at the start (a device on the same media; the Manager reopens it)."""
        if c.proc is not None and c.proc.stdout is not None:
            for line in _drain(c.proc.stdout).splitlines():
                if line.strip():
                    print(f"  [{c.name}] {line}", file=sys.stdout if self.verbose else sys.stderr, flush=True)
        if c is self.master and "endpoint" in c.info:
            at = c.cmd.index("--port") + 1
            c.cmd[at] = c.info["endpoint"].rsplit(":", 1)[1]
        c.restarts.append(time.monotonic())
        c.info, c.banner = {}, ""
        c.start()
        c.wait_ready(time.monotonic() + READY_TIMEOUT_S)

    def dead(self) -> list[Child]:
        """Children that exited on their own."""
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None
                and c.name not in self.exit_codes]

    def stop(self) -> dict[str, int]:
        """Stop every child, in order; {name: exit status} (negative: killed by that signal)."""
        for group in (self.managers, [self.master] if self.master else [], self.devices):
            started = [c for c in group if c.proc is not None]
            for c in started:
                if c.proc.poll() is None:
                    try:
                        os.kill(c.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + self.stop_timeout_s
            for c in started:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"{self.label}: {c.name} (pid {c.proc.pid}) did not stop within "
                          f"{self.stop_timeout_s:g} s of SIGTERM: SIGKILL", file=sys.stderr, flush=True)
                    c.proc.kill()
                    c.proc.wait()
                self.exit_codes.setdefault(c.name, c.proc.returncode)
                if c.proc.stdout is not None:
                    rest = _drain(c.proc.stdout)
                    for line in rest.splitlines():
                        if line.strip():
                            print(f"  [{c.name}] {line}", file=sys.stdout if self.verbose else sys.stderr, flush=True)
                if self.verbose:
                    print(f"{self.label}: stopped {c.name} (exit status {c.proc.returncode})", flush=True)
        return dict(self.exit_codes)

    def __enter__(self) -> "HyMCacheSet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _up(args) -> int:
    if args.no_keys and args.curve_keys:
        raise UsageError("--no-keys and --curve-keys: give one or the other")
    temp_keys = None
    if not args.no_keys and not args.curve_keys:  # secure by default: keys and roles for its own processes
        args.curve_keys = temp_keys = tempfile.mkdtemp(prefix="chm-hymcache-keys-", dir="/var/tmp")
    try:
        return _up_with(args, _curve(args, args.nodes))
    finally:
        if temp_keys:
            import shutil

            shutil.rmtree(temp_keys, ignore_errors=True)


def _up_with(args, keys: str | None) -> int:
    _endpoint(args)  # validates --bind
    if args.metrics_port and args.metrics_port + args.nodes > PORT_MAX:
        raise UsageError(f"--metrics-port {args.metrics_port}: the Managers' ports would pass {PORT_MAX}")
    # Stop signals wait until every child is started, so a Ctrl-C during startup still stops them in order.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    hset = HyMCacheSet(args.nodes, args.devices_per_node, profile=args.profile, media_root=args.media_root,
                       bind=args.bind, master_port=args.port, curve_keys=keys, state_dir=args.state_dir,
                       metrics_port=args.metrics_port, put_timeout_s=args.put_timeout,
                       device_overrides=args.device_overrides, stop_timeout_s=args.stop_timeout,
                       insecure=args.insecure)
    try:
        hset.start()
        desc = hset.describe()
        print(f"chm hymcache up: master {desc['master']} (pid {desc['master_pid']})"
              f"{', CurveZMQ keys ' + keys if keys else ''}", flush=True)
        for m in desc["managers"]:
            print(f"  node {m['node']}: manager {m['endpoint']} (pid {m['pid']}), devices "
                  f"{', '.join('/dev/shm/' + d for d in m['devices'])}", flush=True)
        print(f"  chm hymcache stats --master {desc['master']}{' --curve-keys ' + keys if keys else ''}; "
              f"Ctrl-C stops all", flush=True)
        print(json.dumps(desc), flush=True)
        while True:
            got = signal.sigtimedwait(STOP_SIGNALS, 0.5)
            if got is not None:
                print(f"chm hymcache up: {signal.Signals(got.si_signo).name}: stopping managers, master, devices",
                      flush=True)
                break
            for c in hset.dead():  # restarted, the rest serving on, unless it keeps exiting
                now = time.monotonic()
                recent = [t for t in c.restarts if now - t < RESTART_WINDOW_S]
                why = f"{c.name} (pid {c.proc.pid}) exited with status {c.proc.returncode}"
                if len(recent) >= args.max_restarts:
                    raise ChmError(errno.EIO, f"{why}, restarted {len(recent)} times in the last "
                                              f"{RESTART_WINDOW_S:g} s (--max-restarts {args.max_restarts}); "
                                              f"stopped the rest")
                print(f"chm hymcache up: {why}: restarting it", flush=True)
                hset.restart(c)
                print(f"chm hymcache up: {c.name} restarted (pid {c.proc.pid}"
                      f"{', ' + c.info['endpoint'] if c.info.get('endpoint') else ''})", flush=True)
    finally:
        codes = hset.stop()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    bad = {name: code for name, code in codes.items() if code != 0}
    if bad:
        raise ChmError(errno.EIO, "not every piece stopped cleanly: "
                                  + ", ".join(f"{n} exit status {c}" for n, c in bad.items()))
    print("chm hymcache up: all stopped", flush=True)
    return 0
