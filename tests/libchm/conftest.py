"""Fixtures of the libchm tests: one `chm serve` per module, a handle per test."""

import pytest

from libchm import Device
from tests.emulator.serve.serving import Server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("media")) as srv:
        yield srv


@pytest.fixture
def dev(served):
    with Device(served.node) as d:
        yield d
