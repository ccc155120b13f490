"""``chm hymcache simulate`` on bad input (issue #21): a Mooncake trace's far timestamps and bad lines, and
flags out of range. Empty windows of arrivals cost nothing (no row, as in ``chm replay``); what cannot be
simulated is an error naming the field (or line), the value and the range, never a traceback or a hang."""

from __future__ import annotations

import json

import pytest

from emulator.cli import main as chm_main
from host_runtime.hymcache.sim.config import load_settings, preset_path
from host_runtime.hymcache.sim.events import Env
from host_runtime.hymcache.sim.run import simulate_tier
from host_runtime.hymcache.sim.worker import open_client
from host_runtime.hymcache.sim.workload import mooncake_requests

B_TOKENS = 128
BLOCK = 16 << 20
OK = {"timestamp": 0, "input_length": 900, "output_length": 5, "hash_ids": [0, 1]}


def _trace(tmp_path, *records) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_windows_without_arrivals_have_no_rows(tmp_path):
    """1e12 ms after the first request (31 years, 1.7 M windows of 600 s): two windows, two rows."""
    path = _trace(tmp_path, OK, dict(OK, timestamp=1e12, hash_ids=[0, 2]), dict(OK, timestamp=1e12 + 1, input_length=300, hash_ids=[3]))
    windows = mooncake_requests(path, tokens_per_block=B_TOKENS, block_bytes=BLOCK)
    assert [[t.turn for t in w] for w in windows] == [[1], [1666667, 1666667]]
    env, starts = Env(), []

    class Instant:
        def submit(self, req):
            env.call_at(env.now + 1, lambda: req.done.succeed(req))

    env.process(open_client(env, windows, [Instant()], tokens_per_block=B_TOKENS, max_tokens=1, window_ns=600e9,
                            on_turn_start=lambda w, now: starts.append((w, now)), on_done=lambda r: None))
    env.run()
    assert starts == [(1, 0.0), (1666667, 1666666 * 600e9)]
    s = load_settings(preset_path(13))
    s.update({"workload.kind": "mooncake", "workload.trace": path})
    rows = simulate_tier("recompute", s)["rows"]
    assert [(r["turn"], r["requests"]) for r in rows] == [(1, 1), (1666667, 2)]


@pytest.mark.parametrize("timestamp, scale", [(1e300, "1"), (1e13, "1"), (1e12, "1e9")])
def test_a_trace_beyond_int64_nanoseconds_is_an_error_naming_its_lines(tmp_path, capsys, timestamp, scale):
    path = _trace(tmp_path, OK, "", dict(OK, timestamp=timestamp))
    assert chm_main(["hymcache", "simulate", "--workload", "mooncake", "--trace", path, "--tiers", "recompute",
                     "--time-scale", scale, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"chm hymcache simulate: error: {path}: line 3 (timestamp {timestamp:g}) comes " in err
    assert "after line 1 (timestamp 0)" in err and "a trace may span at most 9.223e+09 s (2^63 ns" in err


@pytest.mark.parametrize("line, problem", [
    ("[0, 1]", "the line is a JSON list, not an object"),
    ('{"timestamp": 1' + "0" * 400 + ', "hash_ids": [1]}', "timestamp = 1000"),
    ('{"timestamp": 1, "hash_ids": [0, 1' + "0" * 40 + ']}', "element 1 is 1000"),
    ('{"timestamp": 1, "hash_ids": []}', "hash_ids = [] must be a non-empty list"),
])
def test_a_bad_trace_line_is_an_error_naming_it(tmp_path, capsys, line, problem):
    path = _trace(tmp_path, OK, line)
    assert chm_main(["hymcache", "simulate", "--workload", "mooncake", "--trace", path, "--tiers", "recompute",
                     "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: not a Mooncake record" in err and problem in err and len(err) < 1000


@pytest.mark.parametrize("argv, message", [
    (["--dram", "1e400"], "--dram '1e400' is outside the allowed range: a byte count in [1MiB, 64TiB]"),
    (["--staging", "1e400GiB"], "--staging '1e400GiB' is outside the allowed range: a byte count in [1MiB, 64TiB]"),
    (["--staging-sweep", "1GiB,1e400"], "--staging-sweep '1GiB,1e400' is outside the allowed range"),
    (["--time-scale", "1e308"], "--time-scale 1e+308 is outside the allowed range: a number in [1e-09, 1e+09]"),
    (["--window-s", "nan"], "--window-s nan is outside the allowed range: a number in [1e-06, 1e+09]"),
])
def test_flags_out_of_range_are_usage_errors(capsys, argv, message):
    assert chm_main(["hymcache", "simulate", "--tiers", "recompute", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_preset_that_is_not_text_is_an_error_naming_it(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_bytes(b"[tiers]\nrun = '\xff'\n")
    assert chm_main(["hymcache", "simulate", "--preset", str(path), "--no-progress"]) == 1
    assert f"{path}: not TOML: byte 15 is not UTF-8" in capsys.readouterr().err


def test_hash_ids_are_bounded_so_every_block_key_fits_64_bits(tmp_path, capsys):
    """With 4 KV blocks per hash id the ids are in [0, 2^62): the largest one is simulated on the tiers that key
    blocks by it (it used to stop the hymcache tier with a struct.error), the next one is an error."""
    top = (1 << 62) - 1
    path = _trace(tmp_path, dict(OK, hash_ids=[top, 5]), dict(OK, timestamp=1, hash_ids=[top, 6]))
    s = load_settings(preset_path(13))
    s.update({"workload.kind": "mooncake", "workload.trace": path})
    assert sum(r["requests"] for r in simulate_tier("hymcache", s)["rows"]) == 2
    path = _trace(tmp_path, dict(OK, hash_ids=[top + 1, 5]))
    assert chm_main(["hymcache", "simulate", "--workload", "mooncake", "--trace", path, "--tiers", "hymcache",
                     "--no-progress"]) == 1
    assert "must be a list of integers in [0, 2^62): element 0 is 4611686018427387904" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (("[model]", "[model]\nsize = 3"), "p.toml: model.size is not a known field; known: name, tokens_per_block"),
    (("turns = 10", ""), "p.toml: workload.turns is missing (an integer in [1, 1000])"),
    (("[report]", "[extra]\nx = 1\n[report]"), "p.toml: extra is not a known field; known: figure, topology,"),
    (('dram = "64GiB"', "dram = 5"), "p.toml: tiers.dram 5 is outside the allowed range: a byte count in [1MiB, 64TiB]"),
    (('run = ["recompute"', 'run = ["recompute", "recompute"'),
     "p.toml: tiers.run ['recompute', 'recompute', 'gpu-prefix', 'lmcache-local', 'hymcache'] is outside the allowed "
     "range: a non-empty list of distinct tiers"),
    (("number = 13", 'number = "13"'), "p.toml: figure.number '13' is outside the allowed range: an integer or none"),
])
def test_a_preset_is_checked_against_the_declared_settings(tmp_path, edit, message):
    """A preset converts into the typed settings (config.preset_type): unknown and missing names, and values out of
    range, are errors naming the setting, the value and the range."""
    path = tmp_path / "p.toml"
    path.write_text(preset_path(13).read_text().replace(*edit, 1))
    with pytest.raises(ValueError) as exc:
        load_settings(path)
    assert str(exc.value).startswith(message)


def test_a_gpu_file_is_checked_against_its_declared_fields(tmp_path, monkeypatch):
    from host_runtime.hymcache.sim import gpu

    real = (gpu.GPU_DIR / "a100-80gb.toml").read_text()
    monkeypatch.setattr(gpu, "GPU_DIR", tmp_path)
    (tmp_path / "a100-80gb.toml").write_text(real.replace("mbu = 0.6", "mbu = 1.5"))
    with pytest.raises(ValueError, match=r"a100-80gb.toml: mbu 1.5 is outside the allowed range: a number in \(0, 1\]"):
        gpu.load_serving_gpu("a100-80gb")
    with pytest.raises(ValueError, match=r"gpu.profile 'h100' is outside the allowed range: one of a100-80gb"):
        gpu.load_serving_gpu("h100")
