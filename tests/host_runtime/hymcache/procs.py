"""Helpers of the HyMCache process tests (CLI, faults, metrics): start a Master or Manager as its own
process (``python -m host_runtime.hymcache.cli ...``, what ``chm hymcache`` runs), stop or kill it,
and store raw blocks (no model) through the Master and libchm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import xxhash

from host_runtime.hymcache.vllm_serve import free_port  # noqa: F401  (the tests' free port)
from tests.emulator.serve.serving import ROOT

CHM = os.path.join(os.path.dirname(sys.executable), "chm")


def start_piece(role: str, *args: str, timeout: float = 60.0) -> tuple[subprocess.Popen, dict]:
    """``chm hymcache ROLE ARGS`` as a process; returns it and its ready JSON line."""
    from host_runtime.hymcache.cli import read_lines

    proc = subprocess.Popen([sys.executable, "-m", "host_runtime.hymcache.cli", role, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in read_lines(proc, time.monotonic() + timeout, role):
            if line.startswith("{"):
                return proc, json.loads(line)
    except Exception:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"{role} did not start: {err.decode(errors='replace')}")
    proc.kill()
    proc.communicate()
    raise TimeoutError(f"{role} not ready within {timeout} s")


def master_proc(tmp_path, *args: str, port: int = 0, state_dir=None):
    state = str(state_dir if state_dir is not None else tmp_path / "state")
    return start_piece("master", "--port", str(port), "--state-dir", state, *args)


def manager_proc(master: str, node: int, device_nodes: list[str], *args: str):
    dev_args = [a for d in device_nodes for a in ("--device", d)]
    return start_piece("manager", "--master", master, "--node", str(node), *dev_args, *args)


def stop_proc(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str, str]:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"pid {proc.pid} did not stop within {timeout} s of signal {sig}: {err!r}")
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def random_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def block_bytes(key: bytes, size: int) -> bytes:
    """Deterministic, key-dependent content (a wrong block never matches a right one)."""
    seed = key * (64 // len(key))
    reps = -(-size // len(seed))
    return (seed * reps)[:size]


def store_raw(master_endpoint: str, keys_or_count, block_size: int, *, request_id: str = "store",
              timeout_s: float = 10.0):
    """Store raw blocks the way a worker on the Manager's machine does: put_start at the Master, libchm
    writes to the chosen device, put_end with xxh3 checksums. Returns [(WriteLoc, bytes)]."""
    from libchm import Device

    from host_runtime.hymcache.master import MasterClient

    keys = random_keys(keys_or_count) if isinstance(keys_or_count, int) else list(keys_or_count)
    mc = MasterClient(master_endpoint, timeout_s=timeout_s)
    try:
        nodes = mc.nodes()
        locs = mc.put_start(request_id, keys, [block_size] * len(keys))
        written = []
        devices = {}
        for loc in locs:
            assert loc is not None
            path = _device_path(nodes, loc.node, loc.device)
            dev = devices.get(path) or devices.setdefault(path, Device(path))
            data = block_bytes(loc.key, loc.length)
            dev.write(loc.offset, data)
            written.append((loc, data))
        for dev in devices.values():
            dev.flush()
            dev.close()
        assert mc.put_end([loc.key for loc, _ in written],
                          [xxhash.xxh3_64_intdigest(d) for _, d in written]) == len(written)
        return written
    finally:
        mc.close()


def _device_path(nodes, node: int, device: int) -> str:
    desc = nodes[node] if node in nodes else nodes[str(node)]
    devs = desc["devices"] if isinstance(desc, dict) else desc.devices
    for d in devs:
        if d.device == device:
            return d.node_path
    raise KeyError(f"node {node} has no device {device}: {devs}")


# ---- a tiny SmolLM2 with random weights: the real engine and connector, blocks of raw bytes, in ms ----
def tiny_model(n_layers: int = 2, dim: int = 64, n_heads: int = 4, n_kv_heads: int = 2, vocab: int = 97,
               seed: int = 0):
    """SmolLM2's code with a small random-weight config: a wrong KV block changes its greedy tokens."""
    import torch

    from host_runtime.hybridgen.model import ModelConfig, SmolLM2

    cfg = ModelConfig(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=2 * dim,
                      vocab_size=vocab, rope_base=10000.0, norm_eps=1e-5)
    g = torch.Generator().manual_seed(seed)
    hd = dim // n_heads

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    t = {"token_embd.weight": torch.randn(vocab, dim, generator=g), "output_norm.weight": torch.ones(dim)}
    for i in range(n_layers):
        t |= {f"blk.{i}.attn_norm.weight": torch.ones(dim), f"blk.{i}.ffn_norm.weight": torch.ones(dim),
              f"blk.{i}.attn_q.weight": w(n_heads * hd, dim), f"blk.{i}.attn_k.weight": w(n_kv_heads * hd, dim),
              f"blk.{i}.attn_v.weight": w(n_kv_heads * hd, dim), f"blk.{i}.attn_output.weight": w(dim, dim),
              f"blk.{i}.ffn_gate.weight": w(2 * dim, dim), f"blk.{i}.ffn_up.weight": w(2 * dim, dim),
              f"blk.{i}.ffn_down.weight": w(dim, 2 * dim)}
    return SmolLM2(cfg, t)


def prompt_tokens(n: int, seed: int, vocab: int = 97) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


class Worker:
    """A serving engine with the HyMCache connector (``connector_pair``) and its reference (no connector):
    ``turn(prompt)`` runs both and returns (request with the connector, reference tokens)."""

    def __init__(self, model, master_endpoint: str, *, chunk_size: int = 4, num_blocks: int = 512, **config):
        from host_runtime.hymcache.connector import connector_pair
        from host_runtime.hymcache.engine import PagedEngine

        self.logs: list[str] = []
        cfg = {"chunk_size": chunk_size, "master_endpoint": master_endpoint, "staging_buffer_size": 0.064,
               "rpc_timeout_s": 2.0, "lookup_timeout_ms": 3000.0, "blocking_timeout_secs": 3.0, **config}
        self.pair = connector_pair(cfg, log=self.logs.append)
        self.engine = PagedEngine(model, chunk_size=chunk_size, num_blocks=num_blocks, connector=self.pair)
        self.reference = PagedEngine(model, chunk_size=chunk_size, num_blocks=num_blocks)
        self.n = 0

    @property
    def scheduler(self):
        return self.pair[0]

    @property
    def worker(self):
        return self.pair[1]

    def turn(self, prompt: list[int], max_tokens: int = 3):
        self.n += 1
        rid = f"req-{os.getpid()}-{self.n}"
        ref = self.reference.generate(rid, prompt, max_tokens)
        # vLLM's engine-core loop: step until the request finishes, however many steps a lookup in flight
        # takes (PagedEngine.generate bounds the steps, and a step waiting on a lookup is quick)
        req = self.engine.add_request(rid, prompt, max_tokens)
        while req.status != "finished":
            self.engine.step()
        return req, list(ref.output_token_ids)

    def close(self):
        self.engine.shutdown()


def run_bounded(fn, limit_s: float):
    """``fn()`` in a thread: (its result, its wall seconds: bench_connector_faults reads them), or a failure if it
    is still running after ``limit_s`` (a hang). The bound stops a hang; it is not a timing assertion."""
    box = {}

    def body():
        start = time.monotonic()
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        box["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still running after {limit_s} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box["result"], box["seconds"]
