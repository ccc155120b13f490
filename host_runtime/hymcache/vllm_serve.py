"""``vllm serve`` as a process, and a multi-turn chat over its OpenAI-compatible HTTP API.

``VllmServer`` starts ``vllm serve`` through ``vllm_launcher`` on a free port of 127.0.0.1, waits for its
``/health``, sends greedy completions of token-id prompts (``/v1/completions`` with ``return_token_ids``,
streamed, so the time to the first token is measured as a client sees it) and reads vLLM's own token
counters from ``/metrics``: ``vllm:prompt_tokens``, ``vllm:prefix_cache_hits`` (vLLM's prefix cache) and
``vllm:external_prefix_cache_hits`` (tokens a KV connector loaded). ``connector_config`` is the
``--kv-transfer-config`` that puts HyMCache under it.

``chat`` is what ``chm hymcache chat`` prints: SmolLM2 conversations, each turn sent to the server with
HyMCache and to a reference server without a connector; a row per turn says how many prompt tokens came
from the devices and whether the greedy tokens are the reference's. Used by ``chm hymcache chat`` and
``bench/bench_vllm.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from driver.errors import ChmError

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
NULL_KV_BLOCKS = 1  # vLLM's block pool keeps one block out of use (v1/core/block_pool.py, its null block)
MAX_MODEL_LEN = 4096     # tokens; vLLM refuses to start with fewer KV blocks than one sequence this long needs
COUNTERS = {"prompt": "vllm:prompt_tokens_total", "local": "vllm:prefix_cache_hits_total",
            "external": "vllm:external_prefix_cache_hits_total"}
# HyMCache's own counters in the same /metrics (vllm_connector.PROM_COUNTERS; prometheus-client adds _total)
LOAD_COUNTERS = {"load_s": "hymcache:load_time_seconds_total", "loaded_bytes": "hymcache:loaded_bytes_total",
                 "stored_tokens": "hymcache:num_stored_tokens_total"}


def _why(log: str) -> str:
    """What of a failed server's log says why: its first exceptions (the root cause comes before the traceback
    of the process that noticed it), then its end."""
    errors = [line for line in log.splitlines() if re.search(r"\w(Error|Exception): ", line)][:4]
    return "\n".join([*errors, "...", log[-1500:]]) if errors else log[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    return urllib.request.urlopen(req, timeout=timeout)


def connector_config(master_endpoint: str, key_dir: str | None = None, key_name: str = "worker", **extra) -> dict:
    """The ``--kv-transfer-config`` of HyMCache's connector against the Master at ``master_endpoint`` (``extra``:
    more of its ``kv_connector_extra_config``)."""
    cfg = {"master_endpoint": master_endpoint, **extra}
    if key_dir:
        cfg.update(key_dir=key_dir, key_name=key_name)
    return {"kv_connector": "HyMCacheConnector", "kv_connector_module_path": "host_runtime.hymcache.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}


class VllmServer:
    """``vllm serve MODEL`` on a free port of 127.0.0.1 (its output in ``log``); ``url`` for one already running."""

    def __init__(self, model: Path | str | None = None, *, url: str | None = None, prefix_caching: bool = True,
                 kv_transfer: dict | None = None, dtype: str = "float32", blocks: int | None = None,
                 max_model_len: int = MAX_MODEL_LEN, log: Path | None = None, extra_args: tuple = (), env: dict | None = None):
        self.proc = None
        self._log_file = None
        if url is not None:
            self.base = url.rstrip("/")
            return
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "host_runtime.hymcache.vllm_launcher", "serve", str(model),
               "--served-model-name", MODEL_NAME, "--dtype", dtype, "--enforce-eager",
               "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0",
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *extra_args]
        if blocks:
            cmd += ["--num-gpu-blocks-override", str(blocks)]
        if kv_transfer:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.log = Path(log) if log else None
        self._log_file = open(self.log, "wb") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, process_group=0, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "VllmServer":
        """Until ``/health`` answers (ChmError if the server exits first or takes longer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                tail = _why(self.log.read_text(errors="replace")) if self.log else ""
                raise ChmError(errno.EIO, f"vllm serve exited with status {self.proc.returncode} before it was "
                                          f"ready{f' (its log: {self.log})' if self.log else ''}\n{tail}")
            try:
                with _http(f"{self.base}/health", timeout=5):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise ChmError(errno.ETIMEDOUT, f"vllm serve at {self.base} not healthy within {timeout_s:g} s")
            time.sleep(0.5)  # another process's HTTP port: polling its /health is the only readiness signal

    def complete(self, prompt: list[int], max_tokens: int = 1,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[list[int], float]:
        """Greedy ``max_tokens`` after ``prompt``: (the token ids, seconds from send to the first token)."""
        t0 = time.perf_counter()
        ttft, ids = None, []
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, "stream": True}
        with _http(f"{self.base}/v1/completions", body, timeout_s) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                got = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += got
        return ids, (time.perf_counter() - t0 if ttft is None else ttft)

    def metrics_text(self) -> str:
        """``/metrics``, as Prometheus text."""
        with _http(f"{self.base}/metrics", timeout=30) as r:
            return r.read().decode()

    def counters(self, metrics: dict[str, str] = COUNTERS) -> dict[str, float]:
        """Counters of ``/metrics`` summed over their labels, by the names of ``metrics`` (name -> metric; 0 for one
        not there). Default: vLLM's prompt-token counters (prompt, local = prefix-cache hits, external = a
        connector's)."""
        text = self.metrics_text()
        return {name: sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(metric)}(?:{{[^}}]*}})? (\S+)$",
                                                                 text, re.M))
                for name, metric in metrics.items()}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log_file not in (None, subprocess.DEVNULL):
            self._log_file.close()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    """K and V of one token over every layer, from the model folder's config.json."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


TOPICS = ("a lighthouse keeper on a rocky northern island", "a baker who opens her shop before dawn",
          "a train that crosses a desert at night", "a garden that grows only blue flowers")


def user_message(conversation: int, turn: int) -> str:
    """A user turn of about 300 tokens (more than two of vLLM's 128-token blocks), different every turn."""
    topic = TOPICS[(conversation + turn) % len(TOPICS)]
    notes = [f"Note {i}: on day {i + 3 * turn} of the story, {topic} meets visitor number {i * 7 + turn + conversation}"
             f" and they talk for {i + 2} minutes." for i in range(1, 8)]
    return " ".join([f"Here are some notes about {topic}.", *notes, "In one short sentence, what is the story about?"])


def chat(server: VllmServer, reference: VllmServer | None, turns: int, conversations: int, *, max_tokens: int = 8,
         bytes_per_token: int = 0) -> list[dict]:
    """Multi-turn SmolLM2 conversations, each turn on ``server`` (HyMCache) and ``reference`` (no connector);
    a row per turn (the keys ``chm hymcache chat`` prints; ``identical`` is None without a reference)."""
    from host_runtime.hybridgen.model import SmolLM2
    from host_runtime.hybridgen.tokenizer import Tokenizer

    from .prompts import next_turn_prompt

    tok = Tokenizer.from_gguf(SmolLM2.load().tokenizer_reader)
    rows = []
    for c in range(conversations):
        prompt = tok.encode(tok.chat_prompt(user_message(c, 0)))
        for t in range(1, turns + 1):
            before = server.counters()
            got, ttft = server.complete(prompt, max_tokens)
            after = server.counters()
            want = reference.complete(prompt, max_tokens)[0] if reference is not None else None
            d = {k: after[k] - before[k] for k in COUNTERS}
            rows.append({"conversation": c + 1, "turn": t, "prefix_tokens": len(prompt),
                         "reused_tokens": int(d["external"]), "vllm_cached_tokens": int(d["local"]),
                         "recomputed_tokens": int(d["prompt"] - d["local"] - d["external"]),
                         "loaded_bytes": int(d["external"]) * bytes_per_token, "ttft_ms": ttft * 1e3,
                         "identical": None if want is None else got == want})
            prompt = next_turn_prompt(prompt, got, user_message(c, t), tok)
    return rows
