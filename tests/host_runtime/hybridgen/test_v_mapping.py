"""HybridGen with its CXL-resident V rows as a tensor over a mapping of a real `chm serve` (``v_tier="mapped"``)
decodes SmolLM2-135M exactly as the explicit-read baseline does: same tokens, same logits bit for bit. The
rows really live on the device (a ``chm_read`` of their addresses returns them), they got there by stores
(the device counts the mapping's write faults), layer i+1's rows were prefetched by pointer, and the
device's DRAM (16 frames) is smaller than the rows, so pages leave it and loads fault them back in."""

from __future__ import annotations

import errno

import numpy as np
import pytest
import torch

import libchm
from host_runtime.hybridgen import cli
from host_runtime.hybridgen.engine import Engine, EngineOptions
from host_runtime.hybridgen.evaluate import long_english_text
from host_runtime.hybridgen.mapped_tier import MappedHostKV
from tests.emulator.serve.serving import Server
from tests.host_runtime.test_hybridgen_model import ROW_BYTES_ALL_LAYERS, load_smol, smol  # noqa: F401 -- fixture

PROMPT_TOKENS = 72
STEPS = 4
# K pinned (the scheduler would follow this machine's clock); 8 resident tokens; host DRAM for 60 tokens'
# K: every V row and, after the prompt, a few K rows go to the CXL tier (V mapped, K by explicit reads)
OPTIONS = dict(method="hybridgen", strategy="post", k_min=16, k_max=16, resident_budget=8,
               capacity=PROMPT_TOKENS + STEPS + 8, host_dram_bytes=60 * ROW_BYTES_ALL_LAYERS)


def _unsupported():
    why = libchm.lib.chm_mmap_unsupported()
    return None if why == libchm.ffi.NULL else libchm.ffi.string(why).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """1 MiB of device DRAM (16 pages) under ~3 MiB of K and V rows: evictions, read faults, punches."""
    with Server(tmp_path_factory.mktemp("media"), None, "--policy", "lru", "--format", "--set",
                f"dram.size_bytes={1 << 20}", "--set", f"policy.prefetch_window_bytes={256 << 10}") as srv:
        yield srv


def greedy(eng: Engine, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Prefill, then STEPS greedy steps: (tokens, logits [STEPS + 1, vocab])."""
    logits = [eng.prefill(torch.tensor(ids))]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(eng.step(tokens[-1]))
    return tokens, torch.stack(logits)


@pytest.mark.skipif(_unsupported() is not None, reason=f"chm_mmap unsupported here: {_unsupported()}")
def test_mapped_v_rows_decode_as_explicit_reads(smol, served):  # noqa: F811
    model, tok = smol
    ids = tok.encode(long_english_text())[:PROMPT_TOKENS]
    with Engine(model, EngineOptions(**OPTIONS)) as eng:  # today's default: explicit reads, in-process tier
        want_tokens, want_logits = greedy(eng, ids)
    with libchm.Device(served.node) as dev:
        before = dev.stats()
        with Engine(model, EngineOptions(**OPTIONS, v_tier="mapped"), cxl=dev) as eng:
            got_tokens, got_logits = greedy(eng, ids)
            host = eng.host
            assert isinstance(host, MappedHostKV)
            step = eng.steps[-1]
            assert step.v_in_cxl == host.n_layers * host.count[0, 0] and step.k_in_cxl > 0  # both tiers used
            assert host.counters.prefetches == host.n_layers  # by pointer, one per layer and step
            # the rows are the device's: a chm_read of a layer's V region returns what the stores put there
            n, layer = int(host.cxl_watermark["v"][0]), 7
            raw = dev.read(host._addr("v", layer, 0, 0), n * host.row_bytes)
            assert np.array_equal(np.frombuffer(raw, np.float32).reshape(n, -1), host.v_dram[layer, 0, :n].numpy())
            assert torch.equal(host.v_cxl[layer, 0, :n], host.v_dram[layer, 0, :n])
        after = dev.stats()
        faults = {k: after[k] - before[k] for k in ("map_faults", "map_write_faults", "map_punches")}
        assert faults["map_write_faults"] > 0  # spilled by stores, a fault per page
        assert faults["map_faults"] > faults["map_write_faults"] and faults["map_punches"] > 0  # evicted, re-read
        assert after["prefetches"] > before["prefetches"]
    assert got_tokens == want_tokens, f"mapped V decoded {got_tokens}, explicit reads {want_tokens}"
    assert torch.equal(got_logits, want_logits)


@pytest.mark.skipif(_unsupported() is not None, reason=f"chm_mmap unsupported here: {_unsupported()}")
def test_a_batch_of_two_decodes_as_explicit_reads(smol, served):  # noqa: F811
    """Two sequences of different lengths: each one's V rows at its own place in the mapping."""
    model, tok = smol
    text = tok.encode(long_english_text())
    prompts = [text[:PROMPT_TOKENS], text[PROMPT_TOKENS:PROMPT_TOKENS + PROMPT_TOKENS // 2]]
    options = dict(OPTIONS, batch=2)
    with Engine(model, EngineOptions(**options)) as eng:
        want = eng.generate_batch(prompts, STEPS)
    with libchm.Device(served.node) as dev, \
            Engine(model, EngineOptions(**options, v_tier="mapped"), cxl=dev) as eng:
        got = eng.generate_batch(prompts, STEPS)
        host, layer = eng.host, 3
        for seq in range(2):
            n = int(host.cxl_watermark["v"][seq])
            assert n > 0  # both sequences' rows went to the device
            raw = dev.read(host._addr("v", layer, seq, 0), n * host.row_bytes)
            assert np.array_equal(np.frombuffer(raw, np.float32).reshape(n, -1), host.v_dram[layer, seq, :n].numpy())
    assert got == want, f"mapped V decoded {got}, explicit reads {want}"


def test_a_mapped_tier_needs_a_served_device(media_dir):
    from emulator import Device

    with pytest.raises(ValueError, match="v_tier='paged'"):
        EngineOptions(v_tier="paged").validate()
    with pytest.raises(ValueError, match="cxl_node=''"):
        EngineOptions(cxl_node="").validate()
    with Device.open(profile="small", media_dir=media_dir, policy="lru") as dev, \
            pytest.raises(ValueError, match="invalid for mapped V rows"):
        MappedHostKV(2, 3, 8, 16, dev, dram_bytes=0)
    args = cli.build_parser_for_tests().parse_args(["generate", "--prompt", "x", "--v-tier", "mapped"])
    with pytest.raises(cli.UsageError, match="--cxl-node"):
        cli._options(args, "hybridgen")


@pytest.mark.skipif(_unsupported() is not None, reason=f"chm_mmap unsupported here: {_unsupported()}")
def test_a_device_that_cannot_be_mapped_is_refused_by_name(tmp_path):
    with Server(tmp_path, None, "--policy", "lru", "--format", "--set", "emulation.data=false") as srv, \
            libchm.Device(srv.node) as dev, pytest.raises(libchm.ChmError, match="mmap of .*no bytes") as refused:
        MappedHostKV(2, 3, 8, 16, dev, dram_bytes=0)
    assert refused.value.errno == errno.EOPNOTSUPP
