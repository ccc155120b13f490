"""Fixtures shared by the HyMCache tests that run the real model."""

import pytest
import torch

from host_runtime.hybridgen.model import SmolLM2
from host_runtime.hybridgen.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: one thread avoids contention on a small shared box
    model = SmolLM2.load()
    yield model, Tokenizer.from_gguf(model.tokenizer_reader)
    torch.set_num_threads(threads)
