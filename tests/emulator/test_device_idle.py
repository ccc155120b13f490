"""Device.idle validates the virtual time it is given: a NaN or an infinity would poison the clock."""

import math

import pytest

from emulator.device import Device
from emulator.errors import ChmError


@pytest.mark.parametrize("ns", [-1, math.nan, math.inf, True, "5"])
def test_idle_rejects_what_is_not_a_finite_time(ns, tmp_path):
    with Device.open("small", tmp_path) as dev:
        before = dev.clock_ns
        with pytest.raises(ChmError, match="idle time .* outside the allowed range"):
            dev.idle(ns)
        assert dev.clock_ns == before


def test_idle_moves_the_clock(tmp_path):
    with Device.open("small", tmp_path) as dev:
        before = dev.clock_ns
        dev.idle(1000)
        assert dev.clock_ns == before + 1000
