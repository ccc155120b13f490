"""The emulator's timing profiles take their controller cycles from the RTL:
the RTL's measurement must equal the checked-in table (rtl_model/cycles.json),
and every profile's [controller] fields must equal what the table implies."""

from __future__ import annotations

import pytest

from emulator.config import load_profile
from rtl_model.cycles import PROFILE_LINKS, PROFILES, profile_fields
from rtl_model.sim import BLOCKS, default_params, load_cycle_table, run_bench


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_matches_cycle_table(profile):
    table = load_cycle_table()
    controller = load_profile(profile).controller
    for field, value in profile_fields(table).items():
        assert getattr(controller, field) == value, \
            f"profile {profile!r} [controller] {field} = {getattr(controller, field)}, but the RTL table " \
            f"({PROFILE_LINKS[field][0]}.{PROFILE_LINKS[field][1]}) gives {value}; update the profile or the RTL"
    assert table["profile"] == {f: {**table["profile"][f], "value": v} for f, v in profile_fields(table).items()}


@pytest.mark.parametrize("block", list(BLOCKS))
def test_rtl_matches_cycle_table(block, tmp_path):
    result = run_bench(block, default_params(block), tmp_path / "sim", tests="test_cycles")
    assert result.passed and result.cycles is not None, result.failures
    recorded = load_cycle_table()["measured"][block]
    assert result.cycles["params"] == recorded["params"]
    assert result.cycles["cycles"] == recorded["cycles"], \
        f"{block}: the RTL now measures {result.cycles['cycles']}, the table says {recorded['cycles']}; " \
        f"run `python -m rtl_model.cycles --write` and update the profiles"
