"""Faults, each with real processes: ``chm serve`` devices, ``chm hymcache master|manager``, and a worker
(the real PagedEngine and KV connector on a tiny random-weight SmolLM2: real KV blocks of a few KiB,
no model download; its reference engine runs with the connector off).

* kill -9 of the Master mid-run: the worker recomputes within its timeouts, never hangs, never
  gives other tokens; the restarted Master (same state dir) answers for every block registered before.
* kill -9 of a device: its blocks become load errors and recomputation, never wrong tokens; a block
  whose bytes changed on the device fails its checksum after the load and is recomputed too.
* a worker killed mid-put: its put_starts are revoked at the Master's put timeout.
* a full write buffer: stores skipped (never retried, never waited on), counted, revoked so a later
  turn offers them again; the request takes the same steps as without the connector.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.emulator.serve.serving import ROOT, Server

from .procs import (Worker, free_port, kill9, manager_proc, master_proc, prompt_tokens, random_keys, run_bounded,
                    stop_proc, tiny_model)

CHUNK = 4
# a device whose write buffer (4 MiB) fills in a burst: one slow SSD, each flush takes seconds of modelled time
FULL_WRITE_BUFFER = ("--policy", "hymcache", "--set", "dram.size_bytes=16777216",
                     "--set", "policy.write_buffer_fraction=0.25", "--set", "policy.flush_batch_bytes=4194304",
                     "--set", "policy.prefetch_window_bytes=1048576", "--set", "policy.flush_max_delay_ns=1e15",
                     "--set", "ssd.write_latency_ns=1e9", "--set", "ssd.write_bandwidth_gbps=0.001",
                     "--set", "ssd.parallelism=1")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class Pieces:
    """Devices (chm serve), a Master and one node's Manager, each its own process."""

    def __init__(self, tmp_path, n_devices=1, device_args=(), master_args=()):
        self.tmp_path = tmp_path
        self.port = free_port()
        self.state = tmp_path / "state"
        self.master_args = list(master_args)
        self.devices = [Server(tmp_path / f"media{i}", None, *device_args) for i in range(n_devices)]
        self.master, self.minfo = master_proc(tmp_path, *self.master_args, port=self.port, state_dir=self.state)
        self.manager, self.ginfo = manager_proc(self.endpoint, 0, [d.node for d in self.devices])

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def restart_master(self):
        self.master, self.minfo = master_proc(self.tmp_path, *self.master_args, port=self.port, state_dir=self.state)

    def close(self):
        for proc in (self.manager, self.master):
            if proc.poll() is None:
                stop_proc(proc)
        for d in self.devices:
            d.__exit__(None, None, None)


@pytest.fixture
def pieces(tmp_path):
    made = []

    def make(**kw):
        p = Pieces(tmp_path, **kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


def same(req, ref_tokens, reference_req=None):
    assert req.output_token_ids == ref_tokens
    if reference_req is not None:
        assert torch.equal(req.first_token_logits, reference_req.first_token_logits)


def test_master_killed_mid_run_worker_recomputes_and_restarted_master_recovers(pieces, model):
    from host_runtime.hymcache.keys import block_keys
    from host_runtime.hymcache.master import MasterClient

    p = pieces()
    w = Worker(model, p.endpoint, rpc_timeout_s=1.0, lookup_timeout_ms=1500.0, blocking_timeout_secs=2.0)
    try:
        prompt = prompt_tokens(8 * CHUNK + 1, seed=1)
        req, ref = w.turn(prompt)                      # turn 1: computed and stored
        same(req, ref)
        assert req.reused_tokens == 0 and w.worker.counters["num_stored_tokens"] == 8 * CHUNK
        prompt2 = prompt + req.output_token_ids + prompt_tokens(2 * CHUNK, seed=2)
        req, ref = w.turn(prompt2)                     # turn 2: reuses turn 1's blocks
        same(req, ref)
        assert req.reused_tokens == 8 * CHUNK
        stored = block_keys(prompt2, CHUNK, w.scheduler.fingerprint)
        stored = stored[:len(prompt2) // CHUNK]

        # mid-run: the Master stops answering (SIGSTOP) so the next turn's lookup is in flight, then kill -9
        os.kill(p.master.pid, signal.SIGSTOP)
        errors_before = w.scheduler.counters["num_lookup_errors"]
        prompt3 = prompt2 + req.output_token_ids + prompt_tokens(CHUNK, seed=3)
        box = {}
        lookup = w.scheduler.lookup
        started, start = threading.Event(), lookup.start
        lookup.start = lambda *args: (start(*args), started.set())[0]  # a spy: the turn's lookup has begun
        turn = threading.Thread(target=lambda: box.update(result=w.turn(prompt3)), daemon=True)
        turn.start()
        assert started.wait(60), "the turn never looked its prefix up"
        assert lookup.stats()["in_flight"] == 1                    # the request waits on the Master ...
        kill9(p.master)                                            # ... which dies under it
        turn.join(120)
        assert not turn.is_alive(), "the worker hangs without its Master"
        req, ref = box["result"]
        same(req, ref)                                 # the same tokens: recomputed, not guessed
        assert req.reused_tokens == 0 and req.recomputed_tokens == len(prompt3)
        assert w.scheduler.counters["num_lookup_errors"] > errors_before or \
            any("lookup" in line for line in w.logs)
        assert w.worker.figures[f"req-{os.getpid()}-3"].stored_blocks == 0  # nothing stored without a Master

        p.restart_master()                             # same port, same state dir
        with MasterClient(p.endpoint, timeout_s=10) as mc:
            found = mc.lookup(stored)
            assert [loc.key for loc in found] == stored                     # every block registered before
            assert 0 in mc.nodes()                                            # and the node and its Manager
        prompt4 = prompt3 + req.output_token_ids + prompt_tokens(CHUNK, seed=4)
        req, ref = w.turn(prompt4)                     # the same worker: reuses again through the new Master
        same(req, ref)
        assert req.reused_tokens >= len(stored) * CHUNK
    finally:
        w.close()


def test_device_killed_blocks_become_load_errors_never_wrong_tokens(pieces, model):
    from host_runtime.hymcache.keys import block_keys
    from host_runtime.hymcache.master import MasterClient

    p = pieces(n_devices=2)
    w = Worker(model, p.endpoint, rpc_timeout_s=2.0, blocking_timeout_secs=2.0)
    try:
        prompt = prompt_tokens(8 * CHUNK + 1, seed=5)
        req, ref = w.turn(prompt)
        same(req, ref)
        keys = block_keys(prompt, CHUNK, w.scheduler.fingerprint)
        with MasterClient(p.endpoint, timeout_s=10) as mc:
            locs = mc.lookup(keys)
        assert len(locs) == 8 and len({loc.device for loc in locs}) == 1   # one request, one device
        victim = p.devices[locs[0].device]
        victim.kill()                                   # kill -9 of that chm serve

        prompt2 = prompt + req.output_token_ids + prompt_tokens(CHUNK, seed=6)
        errors = w.worker.counters["num_load_errors"]
        (req, ref_tokens), _ = run_bounded(lambda: w.turn(prompt2), 120)
        ref_req = w.reference.requests[req.request_id]
        same(req, ref_tokens, ref_req)                  # bit-identical logits: nothing wrong was loaded
        assert req.reused_tokens == 0                   # every block of the dead device recomputed
        assert w.worker.counters["num_load_errors"] == errors + 1   # the first block failed; the rest recomputed
        assert req.load_error_blocks >= 1
    finally:
        w.close()
        for path in (victim.path, victim.path.with_name(victim.path.name + ".sock")):
            path.unlink(missing_ok=True)


def test_block_changed_on_the_device_fails_its_checksum_and_is_recomputed(pieces, model):
    import libchm

    from host_runtime.hymcache.keys import block_keys
    from host_runtime.hymcache.master import MasterClient

    p = pieces()
    w = Worker(model, p.endpoint)
    try:
        prompt = prompt_tokens(6 * CHUNK + 1, seed=7)
        req, ref = w.turn(prompt)
        keys = block_keys(prompt, CHUNK, w.scheduler.fingerprint)
        with MasterClient(p.endpoint, timeout_s=10) as mc:
            locs = mc.lookup(keys)
        assert len(locs) == 6
        bad = locs[3]
        with libchm.Device(p.devices[0].node) as dev:   # another writer changes block 3's bytes in place
            data = bytearray(dev.read(bad.offset, bad.length))
            data[100] ^= 0x40
            dev.write(bad.offset, bytes(data))
            dev.flush()
        prompt2 = prompt + req.output_token_ids + prompt_tokens(CHUNK, seed=8)
        req, ref_tokens = w.turn(prompt2)
        same(req, ref_tokens, w.reference.requests[req.request_id])
        assert req.reused_tokens == 3 * CHUNK           # the blocks before the bad one are used
        assert w.worker.counters["num_load_errors"] == 1
        with MasterClient(p.endpoint, timeout_s=10) as mc:  # the bad block is dropped, then stored again
            assert [loc.key for loc in mc.lookup(keys)][:4] == keys[:4]
            assert mc.lookup(keys)[3].version > bad.version
    finally:
        w.close()


_PUTTER = r"""
import sys, time
from host_runtime.hymcache.master import MasterClient
keys = [bytes.fromhex(k) for k in sys.argv[2:]]
mc = MasterClient(sys.argv[1], timeout_s=10)
locs = mc.put_start("doomed-worker", keys, [65536] * len(keys))
print(sum(loc is not None for loc in locs), flush=True)
time.sleep(3600)   # the behaviour under test: killed here, mid-put (no put_end, no put_revoke)
"""


def test_worker_killed_mid_put_has_its_put_starts_revoked(pieces):
    from host_runtime.hymcache.master import MasterClient

    p = pieces(master_args=("--put-timeout", "2"))
    keys = random_keys(4)
    putter = subprocess.Popen([sys.executable, "-c", _PUTTER, p.endpoint, *(k.hex() for k in keys)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert putter.stdout.readline().strip() == "4"
    with MasterClient(p.endpoint, timeout_s=10) as mc:
        assert mc.put_start("another", keys, [65536] * 4) == [None] * 4   # in flight: nobody else writes them
        revoked0 = mc.stats()["revoked_blocks"]
        putter.kill()
        putter.wait()
        putter.stdout.close()
        time.sleep(2.0)  # the behaviour under test: the Master's put timeout (2 s of its wall clock) passing
        for _ in range(10_000):  # then its next tick revokes them: each look is a call answered
            if mc.stats()["revoked_blocks"] >= revoked0 + 4:
                break
        st = mc.stats()
        assert st["revoked_blocks"] == revoked0 + 4 and st["pending_blocks"] == 0
        assert mc.lookup(keys) == []                                      # never visible
        again = mc.put_start("retry", keys, [65536] * 4)                 # free to be stored again
        assert all(loc is not None for loc in again)
        assert mc.put_revoke(keys) == 4


def test_full_write_buffer_skips_stores_counts_them_and_does_not_delay(pieces):
    import libchm

    from host_runtime.hymcache.keys import block_keys
    from host_runtime.hymcache.master import MasterClient

    big = tiny_model(n_layers=2, dim=512, n_heads=4, n_kv_heads=4, seed=1)  # 2*2*16*4*128*4 = 128 KiB blocks
    p = pieces(device_args=FULL_WRITE_BUFFER)
    chunk = 16
    w = Worker(big, p.endpoint, chunk_size=chunk, num_blocks=256)
    try:
        with libchm.Device(p.devices[0].node) as dev:
            wb = dev.info()["write_buffer_bytes"]
            refused0 = dev.stats()["refused_writes"]
        block = w.worker.block_bytes or 2 * 2 * chunk * 4 * 128 * 4
        n_blocks = 4 * wb // block + 2                  # four times what the write buffer holds
        prompt = prompt_tokens(n_blocks * chunk + 1, seed=9)
        req, ref = w.turn(prompt, max_tokens=2)
        same(req, ref, w.reference.requests[req.request_id])
        fig = w.worker.figures[req.request_id]
        assert fig.write_attempts == n_blocks           # each block offered once: no retry, no wait
        assert 0 < fig.stored_blocks < n_blocks
        assert fig.skipped_stores == n_blocks - fig.stored_blocks
        assert w.worker.counters["num_skipped_stores"] == fig.skipped_stores
        assert req.steps == w.reference.requests[req.request_id].steps   # the request took no extra step
        with libchm.Device(p.devices[0].node) as dev:
            assert dev.stats()["refused_writes"] - refused0 == fig.skipped_stores
        keys = block_keys(prompt, chunk, w.scheduler.fingerprint)
        assert len(keys) == n_blocks
        with MasterClient(p.endpoint, timeout_s=10) as mc:
            # the skipped blocks were revoked, not left in flight: a later turn may offer exactly them again
            again = mc.put_start("later-turn", keys, [block] * len(keys))
            assert sum(loc is not None for loc in again) == fig.skipped_stores
            assert mc.put_revoke([loc.key for loc in again if loc is not None]) == fig.skipped_stores
    finally:
        w.close()
