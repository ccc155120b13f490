"""The KV Connector on real parts: SmolLM2, `chm serve` devices, the Master and a KV Manager.

The acceptance test runs the Master and the node's KV Manager as processes of their own over
ZeroMQ (tcp://127.0.0.1) in front of two devices; the fault tests run them in process (same
classes) so they can reach inside. Every turn is checked against the reference engine (connector
off, full recomputation): greedy tokens identical, and the first token's logits bit for bit.
"""

import contextlib
import errno
import json
import queue
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import libchm
from driver.errors import ChmError
from host_runtime.hymcache.clock import WallClock
from host_runtime.hymcache.commands.chat import in_process_chat, next_turn_prompt
from host_runtime.hymcache.connector import HyMCacheConfig, HyMCacheConnector, KVConnectorRole, connector_pair
from host_runtime.hymcache.engine import PagedEngine
from host_runtime.hymcache.keys import block_keys
from host_runtime.hymcache.manager import KVManager, ManagerClient, serve_manager
from host_runtime.hymcache.master import Master, MasterClient
from tests.emulator.serve.serving import ROOT, Server

from .procs import run_bounded

BS = 16
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2: 30 layers x (k, v) x 16 tokens x 3 KV heads x 64 x float32
# A 1 MiB write buffer that the device flushes only when full (one batch is all of it; no age limit). A block
# fills less than it, so a store refused within a turn stays refused whatever the scheduler does, and the test
# drains the buffer between turns.
TINY_WRITE_BUFFER = ("--set", "policy.write_buffer_fraction=0.004", "--set", "policy.flush_batch_bytes=1048576",
                     "--set", "policy.flush_max_delay_ns=1e15")


class Proc:
    """A Python snippet in a process of its own; ``ready`` is the first JSON line it prints."""

    def __init__(self, code: str, timeout_s: float = 60.0):
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError(f"no ready line from: {code}") from None
            if line.startswith("{"):
                self.ready = json.loads(line)
                return

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        finally:
            self.proc.stderr.close()


def master_process() -> Proc:
    return Proc("import json; from host_runtime.hymcache.master import run_master; "
                "run_master('tcp://127.0.0.1:0', None, log=lambda m: None, "
                "ready=lambda ep: print(json.dumps({'endpoint': ep}), flush=True))")


def manager_process(master_endpoint: str, device_nodes: list[str]) -> Proc:
    return Proc("import json; from host_runtime.hymcache.manager import run_manager; "
                f"run_manager(0, {device_nodes!r}, {master_endpoint!r}, "
                "on_ready=lambda ep: print(json.dumps({'endpoint': ep}), flush=True))")


def test_multi_turn_reuse_over_zeromq_is_token_identical(smol, tmp_path):
    """Acceptance: 2 devices, Master and KV Manager as processes over tcp://127.0.0.1; turn n+1 loads its
    prefix from the devices, prefills the rest, and its greedy tokens equal a full recomputation."""
    model, tok = smol
    with Server(tmp_path / "m0") as d0, Server(tmp_path / "m1") as d1:
        master = master_process()
        manager = None
        try:
            manager = manager_process(master.ready["endpoint"], [d0.node, d1.node])
            rows = in_process_chat(master.ready["endpoint"], turns=3, conversations=2, model=model, tokenizer=tok,
                                   max_tokens=4)
            with MasterClient(master.ready["endpoint"]) as client:
                devices = client.stats()["devices"]
        finally:
            if manager is not None:
                assert manager.stop() == 0
            assert master.stop() == 0
    print("\nconv turn prefix reused recomputed loaded_bytes skipped device_ms ttft_ms")
    for r in rows:
        print(r["conversation"], r["turn"], r["prefix_tokens"], r["reused_tokens"], r["recomputed_tokens"],
              r["loaded_bytes"], r["skipped_stores"], f"{r['device_ms']:.3f}", f"{r['ttft_ms']:.0f}")
    assert len(rows) == 6 and all(r["identical"] for r in rows)
    for r in rows:
        assert r["reused_tokens"] + r["recomputed_tokens"] == r["prefix_tokens"]
        assert r["loaded_bytes"] == r["reused_tokens"] // BS * BLOCK_BYTES and r["skipped_stores"] == 0
        if r["turn"] > 1:  # everything but the previous prompt's partial block, answer and new message
            assert r["reused_tokens"] > 0 and r["reused_tokens"] >= rows[rows.index(r) - 1]["prefix_tokens"] // BS * BS
            assert r["recomputed_tokens"] < r["prefix_tokens"] // 2 and r["device_ms"] > 0
    # the system prompt's first block is shared: the second conversation's first turn reuses it
    assert rows[3]["turn"] == 1 and rows[3]["reused_tokens"] == BS
    assert all(d["used_bytes"] > 0 for d in devices) and len(devices) == 2  # requests spread over both devices


HANG_S = 120.0  # a turn still running after this hangs (far beyond a slow CI); bench_connector_faults times it


def _master_on(endpoint: str, state) -> Proc:
    return Proc("import json; from host_runtime.hymcache.master import run_master; "
                f"run_master({endpoint!r}, {str(state)!r}, log=lambda m: None, "
                "ready=lambda ep: print(json.dumps({'endpoint': ep}), flush=True))")


def master_killed_turns(model, tok, work) -> SimpleNamespace:
    """Turn 1 stored; kill -9 of the Master; turn 2 (``second_s``: its wall time); the Master restarted on its
    state dir; turn 3. A lookup gives up after lookup_timeout_ms, a put_start after rpc_timeout_s."""
    state = work / "state"
    with Server(work / "m0") as d0:
        master = _master_on("tcp://127.0.0.1:0", state)
        endpoint = master.ready["endpoint"]
        manager = manager_process(endpoint, [d0.node])
        engine = None
        try:
            pair = connector_pair({"master_endpoint": endpoint, "rpc_timeout_s": 1.0, "lookup_timeout_ms": 1000,
                                   "staging_buffer_size": 0.05})
            engine = PagedEngine(model, chunk_size=BS, num_blocks=64, connector=pair)
            reference = PagedEngine(model, chunk_size=BS, num_blocks=64)
            prompt = tok.encode(tok.chat_prompt("Suggest a name for a small grey cat that likes to sleep in the sun "
                                                "all afternoon by the window."))
            first = engine.generate("t1", prompt, 2, tok.eos_id)
            stored_before = pair[1].figures["t1"].stored_blocks
            master.proc.kill()  # kill -9
            master.proc.wait()
            second, second_s = run_bounded(lambda: engine.generate("t2", prompt, 2, tok.eos_id), HANG_S)
            ref = reference.generate("ref", prompt, 2, tok.eos_id)
            master = _master_on(endpoint, state)
            third = engine.generate("t3", prompt, 2, tok.eos_id)
            return SimpleNamespace(prompt=prompt, first=first, second=second, third=third, ref=ref,
                                   stored_before=stored_before, second_skipped=pair[1].figures["t2"].skipped_stores,
                                   second_s=second_s)
        finally:
            if engine is not None:
                engine.shutdown()
            manager.stop()
            master.stop()


def test_master_killed_mid_run_means_recomputation_and_a_restarted_master_serves_reuse_again(smol, tmp_path):
    """kill -9 of the Master: the next turn recomputes within the timeouts (never hangs, same tokens); the
    Master restarted on its state dir answers for the blocks stored before the kill."""
    model, tok = smol
    run = master_killed_turns(model, tok, tmp_path)
    prompt = run.prompt
    assert run.stored_before == len(prompt) // BS >= 3
    assert run.second.reused_tokens == 0 and run.second.output_token_ids == run.first.output_token_ids
    assert run.second_skipped == len(prompt) // BS  # put_start unanswered: not stored
    assert run.second.output_token_ids == run.ref.output_token_ids
    assert run.third.reused_tokens == (len(prompt) - 1) // BS * BS  # the blocks stored before the kill
    assert run.third.output_token_ids == run.first.output_token_ids


@contextlib.contextmanager
def in_process_pieces(work, *device_args):
    """A device (started with ``device_args``), a Master and a KV Manager in process: (master, manager, device)."""
    with Server(work / "m0", None, *device_args) as d0:
        clock = WallClock()
        master = Master(clock)
        try:
            manager = KVManager(0, [d0.node], master, clock)
            try:
                yield master, manager, d0
            finally:
                manager.close()
        finally:
            master.close()


@pytest.fixture
def in_process_set(tmp_path):
    """``in_process_set(*device_args)``: in_process_pieces in the test's directory, closed after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda *device_args: stack.enter_context(in_process_pieces(tmp_path, *device_args))


def run_turns(model, tok, master, manager, prompts_text, *, config=None, wrap_manager=None, turns=3,
              manager_for_node=None, between_turns=None):
    """Turns through the connector and on the reference; per turn (request, reference request, figures).
    ``between_turns()`` runs after each turn but the last."""
    sched, worker = connector_pair({"staging_buffer_size": 0.05, **(config or {})}, master=master,
                                   manager_for_node=manager_for_node or (lambda node: wrap_manager or manager))
    engine = PagedEngine(model, chunk_size=BS, num_blocks=64, connector=(sched, worker))
    reference = PagedEngine(model, chunk_size=BS, num_blocks=64)
    prompt = tok.encode(tok.chat_prompt(prompts_text))
    out = []
    for t in range(turns):
        got = engine.generate(f"t{t}", prompt, 3, tok.eos_id)
        ref = reference.generate(f"r{t}", prompt, 3, tok.eos_id)
        out.append((got, ref, worker.figures[f"t{t}"], list(prompt)))
        assert got.output_token_ids == ref.output_token_ids
        assert torch.equal(got.first_token_logits, ref.first_token_logits)
        # never delayed: each loaded block saves a step; a skipped store costs none; a failed load, the one step
        # whose chunk is computed again
        assert got.steps == ref.steps - got.reused_tokens // BS + (worker.figures[f"t{t}"].load_errors > 0)
        prompt = next_turn_prompt(prompt, got.output_token_ids, "Tell me more about it, please.", tok)
        if between_turns is not None and t + 1 < turns:
            between_turns()
    engine.shutdown()
    return out, sched, worker


def engines(model, master, manager):
    """The connector's two roles, an engine with it and the reference engine (connector off)."""
    sched, worker = connector_pair({"staging_buffer_size": 0.05}, master=master, manager_for_node=lambda n: manager)
    engine = PagedEngine(model, chunk_size=BS, num_blocks=64, connector=(sched, worker))
    return sched, worker, engine, PagedEngine(model, chunk_size=BS, num_blocks=64)


def test_full_write_buffer_skips_stores_without_delay_and_offers_them_again(smol, in_process_set):
    model, tok = smol
    master, manager, device = in_process_set(*TINY_WRITE_BUFFER)

    def drain():  # the write buffer empties between turns (here on demand, not by the device's timing)
        with libchm.Device(device.node) as dev:
            dev.flush()

    turns, sched, worker = run_turns(model, tok, master, manager, "Write a haiku about the sea and the moon, with "
                                     "the waves, the tide, the shore and the night sky in it.",
                                     turns=2, between_turns=drain)
    (first, _, fig1, prompt1), (second, _, fig2, _) = turns
    full = len(prompt1) // BS
    assert full >= 3
    # one block fits the 1 MiB write buffer; the rest are refused at once: skipped, counted, never retried
    assert fig1.stored_blocks == 1 and fig1.skipped_stores == full - 1 and fig1.write_attempts == full
    assert worker.stats()["num_skipped_stores"] >= full - 1
    # the next turn reuses the stored prefix and offers the skipped blocks again (the buffer drained meanwhile)
    assert second.reused_tokens == BS
    assert fig2.stored_blocks >= 1 and fig2.write_attempts >= full - 1
    stored = master.lookup(block_keys(prompt1, BS, sched.fingerprint))
    assert len(stored) >= 2  # block 1, skipped in turn 1, was stored by turn 2


def test_corrupted_block_is_a_load_error_recomputed_and_stored_again(smol, in_process_set):
    model, tok = smol
    master, manager, device = in_process_set()
    prompt = tok.encode(tok.chat_prompt("List the planets of the solar system in order from the sun, and give one "
                                        "short fact about each of them."))

    sched, worker, engine, reference = engines(model, master, manager)
    engine.generate("first", prompt, 2, tok.eos_id)
    keys = block_keys(prompt, BS, sched.fingerprint)
    assert len(keys) >= 3
    locs = master.lookup(keys)
    assert len(locs) == len(keys)
    with libchm.Device(device.node) as dev:  # garbage over block 1, through libchm
        dev.write(locs[1].offset, b"\x5a" * 4096)
        dev.flush()
    again = engine.generate("again", prompt, 2, tok.eos_id)
    ref = reference.generate("ref", prompt, 2, tok.eos_id)
    fig = worker.figures["again"]
    assert fig.load_errors == 1 and fig.loaded_blocks == 1 and again.reused_tokens == BS  # block 0 kept
    assert again.output_token_ids == ref.output_token_ids
    assert torch.equal(again.first_token_logits, ref.first_token_logits)
    assert worker.stats()["num_load_errors"] == 1 and worker.stats()["num_timeouts_recompute"] == 0
    assert fig.stored_blocks == 1  # the corrupt block was removed from the Master and stored again
    third = engine.generate("third", prompt, 2, tok.eos_id)
    assert worker.figures["third"].load_errors == 0 and third.reused_tokens == (len(prompt) - 1) // BS * BS
    engine.shutdown()


def test_a_block_read_layer_by_layer_is_identical_and_a_bad_last_layer_is_still_caught(smol, in_process_set,
                                                                                      monkeypatch):
    from host_runtime.hymcache import connector_worker

    monkeypatch.setattr(connector_worker, "READ_PIECE_BYTES", 1)  # one piece per layer: the most commands
    model, tok = smol
    master, manager, device = in_process_set()
    prompt = tok.encode(tok.chat_prompt("Name four rivers of Europe and the seas they flow into, with one sentence "
                                        "about the cities on the banks of each."))
    sched, worker, engine, reference = engines(model, master, manager)
    engine.generate("first", prompt, 2, tok.eos_id)
    assert len(worker._pieces) == len(worker.kv_caches) > 1
    again = engine.generate("again", prompt, 2, tok.eos_id)
    ref = reference.generate("ref", prompt, 2, tok.eos_id)
    assert again.reused_tokens == (len(prompt) - 1) // BS * BS and worker.figures["again"].load_errors == 0
    assert again.output_token_ids == ref.output_token_ids
    assert torch.equal(again.first_token_logits, ref.first_token_logits)
    locs = master.lookup(block_keys(prompt, BS, sched.fingerprint))
    with libchm.Device(device.node) as dev:  # garbage over the last layer of block 1
        dev.write(locs[1].offset + locs[1].length - 4096, b"\x5a" * 4096)
        dev.flush()
    third = engine.generate("third", prompt, 2, tok.eos_id)
    assert worker.figures["third"].load_errors == 1 and third.reused_tokens == BS
    assert third.output_token_ids == ref.output_token_ids
    assert torch.equal(third.first_token_logits, ref.first_token_logits)
    fourth = engine.generate("fourth", prompt, 2, tok.eos_id)  # the handle took every completion back
    assert worker.figures["fourth"].load_errors == 0 and fourth.reused_tokens == (len(prompt) - 1) // BS * BS
    engine.shutdown()


class _PiecesDevice:
    """A libchm handle whose second piece fails: the connector must take every completion back."""

    def __init__(self, buf: bytearray):
        self.buf, self.in_flight = buf, []

    def buffer(self):
        return memoryview(self.buf)

    def submit_read(self, addr, view, user_data):
        self.in_flight.append((user_data, -errno.EIO if user_data == 1 else len(view), 7))

    def reap(self, min_wait=1, max_completions=64):
        done, self.in_flight = self.in_flight[:max_completions], self.in_flight[max_completions:]
        return done


def test_a_piece_that_fails_ends_the_load_with_no_command_left_in_flight():
    from host_runtime.hymcache.connector import READ_PIECE_BYTES
    from host_runtime.hymcache.messages import ReadToken

    worker = HyMCacheConnector({"chunk_size": 4, "staging_buffer_size": 0.1}, KVConnectorRole.WORKER,
                               master=Master(WallClock()))
    layers = 4  # 1 MiB per layer and block: one layer per piece
    worker.register_kv_caches({f"l{i}": torch.zeros(2, 2, 4, 8, READ_PIECE_BYTES // (2 * 4 * 8 * 4)) for i in range(layers)})
    assert len(worker._pieces) == layers
    assert not hasattr(worker, "get_num_new_matched_tokens")  # the scheduler side's
    dev = _PiecesDevice(bytearray(worker.block_bytes))
    token = ReadToken("r", b"k" * 16, 0, 0, 0, worker.block_bytes, 0, 1)
    with pytest.raises(ChmError) as exc:
        worker._read_in_pieces(dev, token, 1, None)
    assert exc.value.errno == errno.EIO and "layers 1..1" in str(exc.value)
    assert dev.in_flight == []


def device_killed_turn(model, tok, master, manager, device) -> SimpleNamespace:
    """A turn stored, its device killed (-9), the same prompt again (``after_s``: its wall time) and on the
    reference engine. A load gives up after blocking_timeout_secs."""
    prompt = tok.encode(tok.chat_prompt("Give me three tips for learning to play the guitar as an adult beginner, "
                                        "with a sentence of advice for each of them."))
    sched, worker = connector_pair({"staging_buffer_size": 0.05, "blocking_timeout_secs": 2.0}, master=master,
                                   manager_for_node=lambda n: manager)
    engine = PagedEngine(model, chunk_size=BS, num_blocks=64, connector=(sched, worker))
    try:
        engine.generate("before", prompt, 2, tok.eos_id)
        stored_before = worker.figures["before"].stored_blocks
        device.kill()  # SIGKILL: the device vanishes with every block on it
        after, after_s = run_bounded(lambda: engine.generate("after", prompt, 2, tok.eos_id), HANG_S)
        ref = PagedEngine(model, chunk_size=BS, num_blocks=64).generate("ref", prompt, 2, tok.eos_id)
        return SimpleNamespace(prompt=prompt, stored_before=stored_before, after=after, ref=ref,
                               load_errors=worker.figures["after"].load_errors, after_s=after_s)
    finally:
        engine.shutdown()


def test_a_killed_device_means_load_errors_and_recomputation_never_wrong_tokens(smol, in_process_set):
    model, tok = smol
    run = device_killed_turn(model, tok, *in_process_set())
    assert run.stored_before == len(run.prompt) // BS >= 3
    assert run.after.output_token_ids == run.ref.output_token_ids and run.after.reused_tokens == 0
    assert run.load_errors == 1  # never hangs: run_bounded() returned


class SlowManager:
    """The real Manager, except that one block is never staged in time (acquire times out)."""

    def __init__(self, manager, slow_index):
        self.manager, self.slow_index, self.seen = manager, slow_index, {}

    def acquire(self, request_id, key, timeout_s):
        n = self.seen[request_id] = self.seen.get(request_id, -1) + 1
        if n == self.slow_index:
            raise ChmError(errno.ETIMEDOUT, f"block not staged within {timeout_s:g} s")
        return self.manager.acquire(request_id, key, timeout_s)

    def __getattr__(self, name):
        return getattr(self.manager, name)


def test_a_block_not_staged_in_time_falls_back_to_recomputation(smol, in_process_set):
    model, tok = smol
    master, manager, _ = in_process_set()
    slow = SlowManager(manager, slow_index=2)
    turns, _, worker = run_turns(model, tok, master, manager, "Explain photosynthesis to a child in two short "
                                 "sentences, using simple words about leaves, light and water.",
                                 wrap_manager=slow, config={"blocking_timeout_secs": 0.5}, turns=2)
    (_, _, _, prompt1), (second, _, fig2, _) = turns
    assert len(prompt1) // BS >= 3
    assert second.reused_tokens == 2 * BS and fig2.load_errors == 1  # the two blocks before it are kept
    assert worker.stats()["num_timeouts_recompute"] == 1


def test_a_worker_on_another_machine_reads_and_writes_through_the_manager(smol, in_process_set):
    """transfer="remote": blocks travel as ZeroMQ frames through the node's KV Manager; no libchm here."""
    model, tok = smol
    master, manager, _ = in_process_set()
    server = serve_manager(manager, "tcp://127.0.0.1:0")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        turns, _, worker = run_turns(model, tok, master, manager, "Describe a busy city street at dawn, with the "
                                     "people, the noise, the shops opening and the first buses of the day.",
                                     config={"transfer": "remote"}, turns=2,
                                     manager_for_node=lambda node: ManagerClient(server.endpoint))
        stats = manager.stats()
    finally:
        server.stop()
        thread.join(timeout=10)
    (_, _, fig1, prompt1), (second, _, fig2, _) = turns
    assert fig1.stored_blocks == len(prompt1) // BS >= 3 and stats["remote_writes"] >= fig1.stored_blocks
    assert second.reused_tokens == len(prompt1) // BS * BS
    assert fig2.loaded_bytes == second.reused_tokens // BS * BLOCK_BYTES
    assert stats["remote_reads"] == fig2.loaded_blocks and worker._devices == {}  # never opened a device itself


class FakeLookup:
    """A Lookup whose answer arrives after ``polls`` polls."""

    def __init__(self, answer, polls=1):
        self.answer, self.polls, self.started = answer, polls, []

    def start(self, request_id, keys):
        self.started.append((request_id, list(keys)))

    def poll(self, request_id):
        self.polls -= 1
        return None if self.polls >= 0 else self.answer

    def hinted_nodes(self, request_id):
        return []

    def forget(self, request_id):
        pass


class FakeMaster:
    def nodes(self):
        return {}


def test_matched_tokens_are_none_while_the_lookup_is_in_flight_and_zero_is_synchronous(smol):
    _, tok = smol
    from host_runtime.hymcache.engine import Request

    lookup = FakeLookup([], polls=2)
    conn = HyMCacheConnector({}, KVConnectorRole.SCHEDULER, master=FakeMaster(), lookup=lookup)
    req = Request("q", list(range(40)), 2)
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert lookup.started == [("q", lookup.started[0][1])] and len(lookup.started[0][1]) == 2  # never the last token
    assert conn.stats()["num_lookup_requests"] == 1 and conn.stats()["num_lookup_tokens"] == 32
    assert not hasattr(conn, "register_kv_caches")  # each role's methods exist only on its class
    with pytest.raises(ChmError, match=r"num_computed_tokens 41 is outside the allowed range \[0, 40\]"):
        conn.get_num_new_matched_tokens(req, 41)


@pytest.mark.parametrize("values, message", [
    ({"chunk_size": 0}, r"chunk_size 0 is outside the allowed range: an integer in \[1, 4096\]"),
    ({"lookup_batch": 33}, r"lookup_batch 33 is outside the allowed range: an integer in \[1, 32\]"),
    ({"blocking_timeout_secs": -1}, r"blocking_timeout_secs -1 is outside the allowed range"),
    ({"staging_buffer_size": float("nan")}, r"staging_buffer_size nan is outside the allowed range"),
    ({"kv_load_failure_policy": "fail"}, r"kv_load_failure_policy 'fail' is outside the allowed range: one of recompute"),
    ({"chunksize": 16}, r"unknown HyMCache setting 'chunksize'; the settings are: .*chunk_size"),
    ({"lookup_timeout_ms": True}, r"lookup_timeout_ms True is outside the allowed range: a number in \(0, 3600000\]"),
    ({"transfer": "rdma"}, r"transfer 'rdma' is outside the allowed range: one of local, remote"),
    ({"kv_dtype": "int8"}, r"kv_dtype 'int8' is outside the allowed range: one of bfloat16, float16, float32"),
    ({"verify_checksum": 1}, r"verify_checksum 1 is outside the allowed range: true or false"),
    ({"key_name": "a b"}, r"key_name 'a b' is outside the allowed range: a key name matching"),
    ({"key_dir": "/k", "curve_keys": "/c"}, r"key_dir '/k' is outside the allowed range: unset when curve_keys is set"),
])
def test_config_names_field_value_and_range(values, message):
    with pytest.raises(ChmError, match=message):
        HyMCacheConfig.from_dict(values)
    cfg = HyMCacheConfig()
    assert (cfg.chunk_size, cfg.blocking_timeout_secs, cfg.lookup_batch, cfg.staging_buffer_size,
            cfg.kv_load_failure_policy) == (16, 10.0, 32, 5.0, "recompute")
    assert cfg.staging_bytes == 1 << 30  # 5 GB of transfer space: at most 1 GiB staged per device handle
    assert HyMCacheConfig.from_dict({"lookup_timeout_ms": 1000}).lookup_timeout_ms == 1000.0  # an int is a number


def test_a_config_built_in_code_is_checked_as_from_dict_checks_it():
    with pytest.raises(ChmError, match=r"chunk_size 0 is outside the allowed range: an integer in \[1, 4096\]"):
        HyMCacheConfig(chunk_size=0)
    with pytest.raises(ChmError, match=r"transfer 'rdma' is outside the allowed range: one of local, remote"):
        HyMCacheConfig(transfer="rdma")
    assert HyMCacheConfig(chunk_size=128).chunk_size == 128
