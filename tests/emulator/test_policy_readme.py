"""docs/policies.md's "Write your own policy" example, exactly as printed: registered through the registry's
API and through a ``chm.policies`` entry point, it runs the device and hits where LRU misses."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import types
from pathlib import Path

import pytest

from emulator import ConfigError, Device
from emulator.policies import ENTRY_POINT_GROUP, available, policy_class, register, unregister

from .conftest import KiB, TINY

PAGE = Path(__file__).resolve().parents[2] / "docs" / "policies.md"
SECTION = "## Write your own policy"
MODULE = "my_policies"  # the package the page's entry point names
LOOP_PAGES = 20  # one more loop than the 16 frames of TINY hold


def readme_example() -> types.ModuleType:
    """The first python block of the page's section, run as the module ``my_policies``."""
    section = PAGE.read_text(encoding="utf-8").split(SECTION, 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType(MODULE)
    exec(compile(code, f"{PAGE}:{SECTION}", "exec"), module.__dict__)
    return module


def readme_entry_point() -> importlib.metadata.EntryPoint:
    """The entry point of the page's toml block."""
    section = PAGE.read_text(encoding="utf-8").split(SECTION, 1)[1]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    assert f'[project.entry-points."{ENTRY_POINT_GROUP}"]' in toml
    name, value = re.search(r'^(\w+) = "([^"]+)"$', toml, re.M).groups()
    return importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def loop_twice(media_dir, policy: str) -> dict:
    """Read LOOP_PAGES pages (never written: zeros) in order, twice, one page per read; the device's stats."""
    with Device.open("small", media_dir, policy=policy, overrides=TINY, format_media=True) as dev:
        for _ in range(2):
            for page in range(LOOP_PAGES):
                assert dev.read(page * 4 * KiB, 4 * KiB) == bytes(4 * KiB)
        return dev.stats()


@pytest.fixture
def clean_registry():
    yield
    unregister("mru")


def test_the_example_registered_by_api_hits_where_lru_misses(media_dir, clean_registry):
    register("mru", readme_example().Mru)
    lru, mru = loop_twice(media_dir, "lru"), loop_twice(media_dir, "mru")
    assert lru["page_hits"] == 0  # a loop larger than DRAM: LRU evicts each page before it comes round
    # MRU keeps the first 15 pages and the last one (each new page replaces the newest), so the second
    # loop hits those 16, each of its 4 misses replacing the page read just before it
    assert (mru["page_hits"], mru["page_misses"]) == (16, 2 * LOOP_PAGES - 16)


def test_the_example_found_through_its_entry_point(media_dir, monkeypatch, clean_registry):
    monkeypatch.setitem(sys.modules, MODULE, readme_example())
    entry_point = readme_entry_point()
    real = importlib.metadata.entry_points

    def entry_points(**selection):
        if selection.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints([entry_point])
        return real(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert entry_point.name == "mru" and "mru" in available()
    assert policy_class("mru").eviction is sys.modules[MODULE].Mru
    assert loop_twice(media_dir, "mru")["page_hits"] == 16


def test_a_broken_entry_point_is_named_in_the_error(monkeypatch, clean_registry):
    broken = importlib.metadata.EntryPoint(name="mru", value="no_such_module_here:Mru", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **selection: importlib.metadata.EntryPoints([broken]))
    with pytest.raises(ConfigError, match=r"policy.name = 'mru' is the chm.policies entry point "
                                          r"'no_such_module_here:Mru', which does not load: ModuleNotFoundError"):
        policy_class("mru")
