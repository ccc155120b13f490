"""One registry of DRAM policies: names, their config sections, capabilities, describe(), and every
built-in policy running the device with real bytes."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_oracle

from emulator import ConfigError, Device, load_profile, native_build
from emulator.config import FIELDS_BY_KEY
from emulator.policies import (CachePolicy, EvictionPolicy, Policy, available, make_policy, name_problem, param,
                               policy_class, register, unregister)
from emulator.policies.fifo import FifoOrder

from .conftest import KiB, TINY

CHM = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "chm"
BUILT_IN = ("clock", "fifo", "hymcache", "lru", "s3fifo", "sieve")
CACHES = ("lru", "fifo", "clock", "sieve", "s3fifo")  # transparent caches differing in what they evict
ROOMY = {**TINY, "dram.size_bytes": 32 * 4 * KiB}  # 32 frames: s3fifo's small queue needs 10% >= 2 frames


def test_available_lists_the_built_ins_and_the_libcachesim_family():
    names = available()
    assert set(BUILT_IN) <= set(names)
    require_oracle("libcachesim")
    assert {"libcachesim:ARC", "libcachesim:WTinyLFU", "libcachesim:LRU"} <= set(names)
    assert "libcachesim:Belady" not in names  # an offline optimum: not offered


@pytest.mark.parametrize("name,words", [
    ("nonesuch", ["policy.name", "'nonesuch'", "clock, fifo, hymcache, lru, s3fifo, sieve", "chm.policies"]),
    ("libcachesim:Nope", ["'libcachesim:Nope'", "has no 'Nope'", "ARC", "WTinyLFU"]),
    ("libcachesim:Belady", ["not offered", "next access time"]),
])
def test_unknown_names_say_what_is_available(name, words):
    if name.startswith("libcachesim"):
        require_oracle("libcachesim")
    with pytest.raises(ConfigError) as exc:
        load_profile("small").with_overrides({"policy.name": name})
    assert exc.value.errno == errno.EINVAL
    for word in words:
        assert word in str(exc.value)
    with pytest.raises(ConfigError, match="policy.name"):
        policy_class(name)


def test_the_policy_name_field_is_checked_by_the_registry():
    """What chm serve --policy and chm replay --device-policy use to check a name before anything runs."""
    field = FIELDS_BY_KEY["policy.name"]
    assert field.check("sieve", "here") == "sieve"
    with pytest.raises(ConfigError, match=r"^\[EINVAL\] here: policy.name = 'siev' is not one of"):
        field.check("siev", "here")
    assert name_problem("s3fifo") is None and "is not one of" in name_problem("s4fifo")


def test_chm_serve_refuses_an_unknown_policy_as_a_usage_error():
    result = subprocess.run([str(CHM), "serve", "--policy", "siev"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--policy: policy.name = 'siev' is not one of" in result.stderr.splitlines()[-1]


# ---- a policy's own config section ------------------------------------------------------------------

def test_s3fifo_section_defaults_and_overrides():
    cfg = load_profile("small").with_overrides({"policy.name": "s3fifo"})
    assert vars(cfg.policy.s3fifo) == {"small_size_ratio": 0.1, "ghost_size_ratio": 0.9, "move_to_main_threshold": 2}
    cfg = cfg.with_overrides({"policy.s3fifo.small_size_ratio": 0.25, "policy.s3fifo.move_to_main_threshold": 1})
    assert (cfg.policy.s3fifo.small_size_ratio, cfg.policy.s3fifo.move_to_main_threshold) == (0.25, 1)
    assert cfg.as_dict()["policy"]["s3fifo"]["small_size_ratio"] == 0.25  # round trip through as_dict
    order = make_policy(cfg).read_area.table.orders[0]
    assert order.small_capacity == int(cfg.read_staging_frames * 0.25) and order.threshold == 1


def test_policy_section_in_a_profile_file(tmp_path):
    text = (Path(__file__).resolve().parents[2] / "emulator" / "profiles" / "small.toml").read_text()
    text = text.replace('name = "hymcache"', 'name = "clock"') + "\n[policy.clock]\nn_bit_counter = 2\n"
    path = tmp_path / "clock.toml"
    path.write_text(text)
    cfg = load_profile(path)
    assert cfg.policy.name == "clock" and cfg.policy.clock.n_bit_counter == 2
    assert make_policy(cfg).read_area.table.orders[0].max_freq == 3
    path.write_text(text.replace("n_bit_counter = 2", "n_bit_counter = 9"))
    with pytest.raises(ConfigError, match=r"policy.clock.n_bit_counter = 9 is out of range \[1, 8\]"):
        load_profile(path)


@pytest.mark.parametrize("overrides,words", [
    ({"policy.s3fifo.small_size_ratio": 0.95}, ["policy.s3fifo.small_size_ratio = 0.95", "out of range [0.001, 0.9]"]),
    ({"policy.s3fifo.move_to_main_threshold": 0}, ["policy.s3fifo.move_to_main_threshold = 0", "[1, 64]"]),
    ({"policy.s3fifo.small_size_ratio": "a tenth"}, ["policy.s3fifo.small_size_ratio = 'a tenth'", "float"]),
    ({"policy.s3fifo.smallsize": 0.2}, ["unknown field 'policy.s3fifo.smallsize'", "policy.s3fifo.small_size_ratio"]),
    ({"policy.nope.x": 1}, ["unknown section [policy.nope]", "is not one of"]),
    ({"policy.lru.x": 1}, ["unknown field 'policy.lru.x'", "no fields of its own"]),
    # 16 frames: 10% is 1 frame, and libCacheSim's S3-FIFO admits nothing into a 1-page small queue
    ({"dram.size_bytes": 64 * KiB}, ["policy.s3fifo.small_size_ratio = 0.1", "small queue of 1 of the 16 frames"]),
])
def test_policy_section_errors_name_field_value_and_range(overrides, words):
    with pytest.raises(ConfigError) as exc:
        load_profile("small").with_overrides({**TINY, "dram.size_bytes": 32 * 4 * KiB, "policy.name": "s3fifo",
                                              **overrides})
    for word in words:
        assert word in str(exc.value)


# ---- capabilities instead of names ------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILT_IN)
def test_capabilities(name):
    cls = policy_class(name)
    cfg = load_profile("small").with_overrides({**ROOMY, "policy.name": name})
    split = name == "hymcache"
    assert (cls.splits_dram, cls.drops_staged_on_release, cls.refuses_writes) == (split, split, split)
    assert (cfg.write_buffer_frames > 0) == split
    assert cfg.read_staging_frames + cfg.write_buffer_frames == cfg.dram_frames
    assert issubclass(cls, Policy) and cls.name == name


def test_describe_is_the_info_line():
    assert policy_class("lru").describe(load_profile("cmmh")) == "lru"
    assert policy_class("hymcache").describe(load_profile("small")) == \
        "hymcache (write buffer 64.0 MiB, read staging 192.0 MiB)"
    cfg = load_profile("small").with_overrides({"policy.name": "s3fifo"})
    assert policy_class("s3fifo").describe(cfg) == \
        "s3fifo (small_size_ratio 0.1, ghost_size_ratio 0.9, move_to_main_threshold 2)"
    result = subprocess.run([str(CHM), "info", "--profile", "small"], capture_output=True, text=True, timeout=60)
    assert "policy           hymcache (write buffer 64.0 MiB, read staging 192.0 MiB)" in result.stdout


# ---- register() --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,cls,error", [
    ("Big", FifoOrder, "must match"),
    ("libcachesim:X", FifoOrder, "must match"),
    ("name", FifoOrder, "a field of [policy]"),
    ("fifo2", dict, "neither a Policy nor an EvictionPolicy"),
    ("lru", FifoOrder, "already registered"),
])
def test_register_refuses(name, cls, error):
    with pytest.raises((ValueError, TypeError), match=error.replace("[", r"\[").replace("]", r"\]")):
        register(name, cls)


def test_register_an_eviction_policy_with_a_field():
    class Lifo(FifoOrder):
        config_fields = (param("depth", int, 1, 10, default=3),)

    try:
        cls = register("lifo-test", Lifo)
        assert register("lifo-test", Lifo) is cls  # registering it again is harmless
        assert issubclass(cls, CachePolicy) and cls.eviction is Lifo and "lifo-test" in available()
        cfg = load_profile("small").with_overrides({**ROOMY, "policy.name": "lifo-test"})
        assert cfg.policy.__dict__["lifo-test"].depth == 3
        with pytest.raises(ConfigError, match=r"policy.lifo-test.depth = 11 is out of range \[1, 10\]"):
            cfg.with_overrides({"policy.lifo-test.depth": 11})
    finally:
        unregister("lifo-test")
    assert "lifo-test" not in available()


def test_register_refuses_a_field_without_default():
    from emulator.config import Field

    class Needy(FifoOrder):
        config_fields = (Field("policy", "k", int, 1, 2),)

    with pytest.raises(ValueError, match="needs a default"):
        register("needy", Needy)


# ---- every built-in cache runs the device with real bytes -------------------------------------------

@pytest.mark.parametrize("name", CACHES)
def test_each_cache_keeps_the_bytes(media_dir, name):
    data = os.urandom(160 * KiB)  # 40 pages through 32 frames: evictions, dirty write-backs
    with Device.open("small", media_dir, policy=name, overrides=ROOMY) as dev:
        dev.write(0, data)
        for _ in range(2):
            for off in range(0, len(data), 16 * KiB):
                assert dev.read(off, 16 * KiB) == data[off:off + 16 * KiB]
        handle = dev.prefetch(4 * KiB, 8 * KiB)  # pins two frames through the reads below
        dev.wait(handle, timeout_ms=10)
        assert dev.read(100 * KiB, 60 * KiB) == data[100 * KiB:]
        assert dev.read(4 * KiB, 8 * KiB) == data[4 * KiB:12 * KiB]
        dev.release(handle)
        stats = dev.stats()
        assert stats["evictions"] > 0 and stats["dirty_evictions"] + stats["flushed_pages"] > 0
        assert stats["policy_counters"] == {}
        assert dev.info()["policy"] == name


def test_a_cache_policy_subclass_keeps_its_overrides():
    """The fast paths CachePolicy binds to its frame table leave a subclass's own methods alone."""
    touched = []

    class Counting(CachePolicy):
        def touch(self, frame):
            touched.append(frame)
            super().touch(frame)

    try:
        register("counting", Counting)
        cfg = load_profile("small").with_overrides({**ROOMY, "policy.name": "counting", "emulation.data": False})
        from emulator.controller import Controller

        ctl = Controller(cfg)
        now = ctl.read(0, 4 * KiB, 0.0).finish
        ctl.read(0, 4 * KiB, now + 1e6)  # a hit, once the page has landed
        assert touched == [ctl.policy.lookup(0)]
    finally:
        unregister("counting")


def test_a_policy_class_that_is_not_a_cache_runs_as_given():
    class Fussy(Policy):
        def flush_grant(self, dirty, now, reads_in_flight, force):
            return len(dirty)

    try:
        register("fussy", Fussy)
        cfg = load_profile("small").with_overrides({**ROOMY, "policy.name": "fussy", "emulation.data": False})
        policy = make_policy(cfg)
        assert type(policy).name == "fussy" and isinstance(policy, Fussy)
    finally:
        unregister("fussy")


def test_eviction_policy_is_the_frame_tables_op_table():
    assert issubclass(policy_class("lru").eviction, EvictionPolicy)


@pytest.mark.parametrize("name", CACHES)
def test_each_native_cache_policy_is_its_c_file_behind_the_cores_policy_table(name):
    order = policy_class(name).eviction
    assert order.runs_natively() and (native_build.NATIVE / f"policy_{name}.c").is_file()
    assert order(32).info() is not None  # chm_policy_info finds its kind in the core's registry
