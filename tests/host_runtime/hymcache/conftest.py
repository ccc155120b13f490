"""Fixtures shared by the HyMCache tests: the real model, and two devices."""

import pytest
import torch

from host_runtime.hybridgen.model import SmolLM2
from host_runtime.hybridgen.tokenizer import Tokenizer
from tests.emulator.serve.serving import Server


@pytest.fixture(scope="module")
def smol():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: one thread avoids contention on a small shared box
    model = SmolLM2.load()
    yield model, Tokenizer.from_gguf(model.tokenizer_reader)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    """Two `chm serve` devices for a module's tests (the KV Manager's)."""
    with Server(tmp_path_factory.mktemp("m0")) as a, Server(tmp_path_factory.mktemp("m1")) as b:
        yield [a, b]
