"""common.checks: one wording (field, value, allowed range) for scalar checks and for msgspec-declared input."""

from typing import Annotated, Literal

import msgspec
import numpy as np
import pytest
from msgspec import Meta

from common.checks import Checks, outside


class Dram(msgspec.Struct, forbid_unknown_fields=True):
    ways: Annotated[int, Meta(ge=1, le=8)] = 2
    latency_ns: Annotated[float, Meta(gt=0)] = 80.0
    kind: Literal["lru", "fifo"] = "lru"


class Profile(msgspec.Struct, forbid_unknown_fields=True):
    dram: Dram
    name: Annotated[str, Meta(min_length=1, max_length=16)]
    sizes: list[Annotated[int, Meta(ge=0)]] = []


class Refused(Exception):
    pass


check = Checks(Refused)


@pytest.mark.parametrize("data, message", [
    ({"dram": {"ways": 0}, "name": "x"}, "profile: dram.ways 0 is outside the allowed range: an integer in [1, 8]"),
    ({"dram": {"ways": "2"}, "name": "x"}, "profile: dram.ways '2' is outside the allowed range: an integer in [1, 8]"),
    ({"dram": {"latency_ns": -1}, "name": "x"}, "profile: dram.latency_ns -1 is outside the allowed range: a number > 0"),
    ({"dram": {"kind": "mru"}, "name": "x"}, "profile: dram.kind 'mru' is outside the allowed range: one of fifo, lru"),
    ({"dram": {"bogus": 1}, "name": "x"}, "profile: dram.bogus is not a known field; known: ways, latency_ns, kind"),
    ({"dram": {}}, "profile: name is missing (a string of 1 to 16 characters)"),
    ({"dram": {}, "name": "a", "sizes": [1, -2]}, "profile: sizes[1] -2 is outside the allowed range: an integer >= 0"),
])
def test_convert_names_field_value_and_range(data, message):
    with pytest.raises(Refused) as exc:
        check.convert(data, Profile, "profile: ")
    assert str(exc.value) == message


def test_convert_builds_the_declared_type():
    got = check.convert({"dram": {"ways": 4}, "name": "small", "sizes": [0, 3]}, Profile)
    assert got == Profile(Dram(ways=4), "small", [0, 3])


@pytest.mark.parametrize("value", [True, 5, -1, 2.0, "2", None])
def test_int_refuses(value):
    with pytest.raises(Refused, match=r"n .* is outside the allowed range: an integer in \[0, 3\]"):
        check.int("n", value, 0, 3)


def test_int_accepts_numpy_integers():
    assert check.int("n", np.int64(3), 0, 3) == 3 and type(check.int("n", np.int64(3), 0, 3)) is int


@pytest.mark.parametrize("value", [0, float("nan"), float("inf"), -1.0, True, "1"])
def test_number_refuses(value):
    with pytest.raises(Refused, match=r"is outside the allowed range: a number in \(0, 86400\]"):
        check.number("lease_s", value, 0, 86400.0, low_open=True)


def test_other_checks():
    assert check.one_of("placement", "load_aware", ("round_robin", "load_aware")) == "load_aware"
    with pytest.raises(Refused, match="placement 'x' is outside the allowed range: one of round_robin, load_aware"):
        check.one_of("placement", "x", ("round_robin", "load_aware"))
    assert check.blob("key", bytearray(4), 4) == bytes(4)
    with pytest.raises(Refused, match="key must be 4 bytes, got 3 bytes"):
        check.blob("key", b"abc", 4)
    with pytest.raises(Refused, match="keys must be a list of 1 to 2 items, got 3 items"):
        check.items("keys", [1, 2, 3], 1, 2)
    assert outside("x", "y" * 200, "z").count("y") < 80  # a long value is cut short


def test_common_imports_nothing_of_the_project():
    import ast
    from pathlib import Path

    ours = {"emulator", "driver", "libchm", "host_runtime", "rtl_model", "bench", "tests"}
    for path in Path("common").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not {n.split(".")[0] for n in names} & ours, f"{path} imports {names}"
