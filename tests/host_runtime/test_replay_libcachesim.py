"""Traces in libCacheSim's formats, read through its own reader (the libcachesim binding): small traces
written here (oracleGeneral, csv, txt), replayed sequentially, their misses equal libCacheSim's on the
same file; bad files and bad parameters are errors naming the file or the parameter."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from emulator.cli import main as chm_main
from emulator.config import load_profile
from host_runtime.replay import LibCacheSimTrace, Replay, parse_trace_params, replay_config
from host_runtime.replay.lcs_trace import TRACE_FORMATS, write_oracle_general

from .test_replay_oracle import libcachesim_misses
from tests.conftest import require_oracle

lcs = require_oracle("libcachesim")  # the oracle: missing, these tests fail with the install hint

PROFILE = "small"
PAGE = load_profile(PROFILE).device.page_size_bytes  # 64 KiB
DRAM_PAGES = 64
# a device of DRAM_PAGES pages, all cache (lru), and the smallest prefetch window
DRAM_OVERRIDES = {"dram.size_bytes": DRAM_PAGES * PAGE, "policy.prefetch_window_bytes": PAGE}
CHM = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "chm"


def skewed_requests(n: int, objects: int, max_size: int, seed: int = 1) -> list[tuple[int, int, int]]:
    """(time s, obj_id, obj_size): a few hot objects and a long tail, so an LRU of DRAM_PAGES both hits and misses."""
    rng = random.Random(seed)
    sizes = {o: rng.randint(1, max_size) for o in range(objects)}
    out = []
    for i in range(n):
        obj = int(objects * rng.random() ** 3)
        out.append((i // 10, 1000 + obj, sizes[obj]))
    return out


def libcachesim_file_misses(path: Path, fmt: str, params: dict, pages: int) -> tuple[int, int]:
    """(requests, misses) of libCacheSim's LRU of ``pages`` objects, reading the file itself, sizes ignored."""
    init = lcs.ReaderInitParam(ignore_obj_size=True)
    for attr, value in params.items():
        setattr(init, attr, value)
    reader = lcs.TraceReader(str(path), getattr(lcs.TraceType, TRACE_FORMATS[fmt]), init)
    cache, n, misses = lcs.LRU(pages), 0, 0
    for req in reader:
        n += 1
        misses += not cache.get(req)
    return n, misses


def sequential_lru(trace) -> dict:
    return Replay(replay_config(PROFILE, "lru", DRAM_OVERRIDES), "lru", trace, progress=False, sequential=True).run()


def test_every_libcachesim_trace_type_has_a_format_name():
    assert set(TRACE_FORMATS.values()) == set(lcs.TraceType.__members__) - {"UNKNOWN_TRACE"}


# ---- formats, each against libCacheSim on the same file -------------------------------------------
def test_oracle_general_objects_within_a_page_miss_as_in_libcachesim(tmp_path):
    requests = skewed_requests(4000, 400, PAGE)
    path = write_oracle_general(tmp_path / "t.oracleGeneral", requests)
    trace = LibCacheSimTrace(path, "oracleGeneral", PAGE)
    assert list(trace.times) == [t for t, _, _ in requests] and list(trace.obj_ids) == [o for _, o, _ in requests]
    (phase,) = trace.phases()
    assert phase.streams[25].start_ns == requests[25][0] * 1e9  # clock_time is in seconds
    n, expected = libcachesim_file_misses(path, "oracleGeneral", {}, DRAM_PAGES)
    cache = sequential_lru(trace)["cache"]
    assert (cache["accesses"], cache["misses"]) == (n, expected) == (4000, expected)
    assert 400 < expected < 3600  # hits and misses both


def test_objects_of_several_pages_are_read_page_by_page(tmp_path):
    """An object of obj_size bytes is ceil(obj_size / page) pages, each a page of the LRU."""
    requests = skewed_requests(3000, 200, 3 * PAGE, seed=2)
    trace = LibCacheSimTrace(write_oracle_general(tmp_path / "t.oracleGeneral", requests), "oracleGeneral", PAGE)
    page_ids = [(obj, j) for _, obj, size in requests for j in range(-(-size // PAGE))]
    expected = libcachesim_misses(lcs.LRU(DRAM_PAGES), [obj * 4 + j for obj, j in page_ids])
    cache = sequential_lru(trace)["cache"]
    assert (cache["accesses"], cache["misses"]) == (len(page_ids), expected)
    assert len(page_ids) > 1.5 * len(requests)
    ignored = sequential_lru(LibCacheSimTrace(trace.path, "oracleGeneral", PAGE, ignore_obj_size=True))["cache"]
    assert ignored["accesses"] == len(requests)


def test_csv_with_named_columns_a_header_and_string_ids(tmp_path):
    requests = skewed_requests(3000, 300, PAGE, seed=3)
    path = tmp_path / "t.csv"
    path.write_text("size;key;ts\n" + "".join(f"{size};k{obj};{t}\n" for t, obj, size in requests))
    params = parse_trace_params("time-col=3, obj-id-col=2, obj-size-col=1, delimiter=;, has-header=true, "
                                "obj-id-is-num=false")
    trace = LibCacheSimTrace(path, "csv", PAGE, params)
    assert list(trace.times) == [t for t, _, _ in requests] and list(trace.sizes) == [s for _, _, s in requests]
    assert len(set(trace.obj_ids)) == len({obj for _, obj, _ in requests})  # string ids, hashed by libCacheSim
    n, expected = libcachesim_file_misses(path, "csv", params, DRAM_PAGES)
    cache = sequential_lru(trace)["cache"]
    assert (cache["accesses"], cache["misses"]) == (n, expected) == (3000, expected)


def test_txt_one_object_id_per_line(tmp_path):
    requests = skewed_requests(2000, 300, 1, seed=4)
    path = tmp_path / "t.txt"
    path.write_text("".join(f"{obj}\n" for _, obj, _ in requests))
    trace = LibCacheSimTrace(path, "txt", PAGE)
    assert list(trace.obj_ids) == [obj for _, obj, _ in requests]
    n, expected = libcachesim_file_misses(path, "txt", {}, DRAM_PAGES)
    assert sequential_lru(trace)["cache"]["misses"] == expected and n == 2000


def test_limit_reads_only_the_first_requests(tmp_path):
    path = write_oracle_general(tmp_path / "t.oracleGeneral", skewed_requests(100, 10, 1))
    assert LibCacheSimTrace(path, "oracleGeneral", PAGE, limit=7).describe()["requests"] == 7


# ---- parameters, parsed as libCacheSim's cachesim -t parses them -------------------------------------
def test_trace_params_parse_as_cachesim_does():
    assert parse_trace_params("time-col=1, obj-id-col=2,obj_size_col=3,delimiter=,,has-header=yes") == {
        "time_field": 1, "obj_id_field": 2, "obj_size_field": 3, "delimiter": ",", "has_header": True,
        "has_header_set": True}
    assert parse_trace_params("delimiter=\\t,obj-id-is-num=0") == {"delimiter": "\t", "obj_id_is_num": False,
                                                                   "obj_id_is_num_set": True}
    assert parse_trace_params("format=<IQI, obj-id-col=2, delimiter=,") == {
        "binary_fmt_str": "<IQI", "obj_id_field": 2, "delimiter": ","}
    assert parse_trace_params("") == {}


@pytest.mark.parametrize("text, message", [
    ("nosuch=1", "'nosuch' is not one of libCacheSim's trace parameters: time-col"),
    ("time-col=0", "time-col = '0' must be a column number (counted from 1) >= 1"),
    ("obj-id-col=two", "obj-id-col = 'two' must be a column number"),
    ("has-header=maybe", "has-header = 'maybe' must be one of true"),
    ("delimiter=ab", "delimiter = 'ab' must be one character"),
    ("time-col", "'time-col' is not KEY=VALUE"),
])
def test_bad_trace_params_name_the_parameter(text, message):
    with pytest.raises(ValueError) as info:
        parse_trace_params(text)
    assert message in str(info.value)


# ---- bad files: libCacheSim aborts its process on them; the replay reports them ------------------------
def test_a_line_libcachesim_cannot_read_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("5\n6\nnot-an-id\n")
    with pytest.raises(ValueError) as info:
        LibCacheSimTrace(path, "txt", PAGE)
    assert str(info.value).startswith(f"{path}: libCacheSim's txt reader failed: invalid object id")


def test_binary_without_its_format_is_an_error(tmp_path):
    path = write_oracle_general(tmp_path / "t.bin", skewed_requests(10, 5, 1))
    with pytest.raises(ValueError, match="libCacheSim's binary reader failed: .*fmt_str"):
        LibCacheSimTrace(path, "binary", PAGE)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LibCacheSimTrace(tmp_path / "none.csv", "csv", PAGE)
    (tmp_path / "empty.oracleGeneral").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.oracleGeneral: no requests"):
        LibCacheSimTrace(tmp_path / "empty.oracleGeneral", "oracleGeneral", PAGE)


# ---- the command line -------------------------------------------------------------------------------
def test_chm_replay_reads_a_libcachesim_trace_and_reports_the_dram_misses(tmp_path, capsys):
    path = write_oracle_general(tmp_path / "t.oracleGeneral", skewed_requests(2000, 300, PAGE, seed=5))
    _, expected = libcachesim_file_misses(path, "oracleGeneral", {}, DRAM_PAGES)
    out = tmp_path / "out"
    rc = chm_main(["replay", str(path), "--trace-format", "oracleGeneral", "--profile", PROFILE, "--sequential",
                   "--device-policy", "lru", "--policy", "hymcache", "--no-progress", "--out", str(out)]
                  + [a for key, value in DRAM_OVERRIDES.items() for a in ("--set", f"{key}={value}")])
    assert rc == 0
    result = json.loads((out / "replay.json").read_text())
    assert (result["policy"], result["device_policy"], result["label"]) == ("hymcache", "lru", "hymcache on lru")
    assert result["sequential"] and result["cache"]["misses"] == expected
    assert f"{expected} misses" in capsys.readouterr().out


def _chm_replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHM), "replay", *args, "--no-progress"], capture_output=True, text=True, timeout=120)


def test_chm_replay_of_an_unreadable_libcachesim_trace_exits_1_naming_the_file(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("1\nxx\n")
    run = _chm_replay(str(path), "--trace-format", "txt")
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith(f"chm replay: error: {path}: libCacheSim's txt reader failed: invalid object id")


@pytest.mark.parametrize("argv, message", [
    (["--trace-format", "nosuch"], "argument --trace-format: 'nosuch' is not one of mooncake, csv, txt"),
    (["--trace-format", "csv", "--trace-params", "id-col=2"], "argument --trace-params: 'id-col' is not one of"),
    (["--trace-params", "time-col=1"], "--trace-params is for the libCacheSim formats; --trace-format is mooncake"),
    (["--ignore-obj-size"], "--ignore-obj-size is for the libCacheSim formats"),
])
def test_chm_replay_bad_trace_options_are_usage_errors(tmp_path, argv, message, capsys):
    path = tmp_path / "t.txt"
    path.write_text("1\n")
    assert chm_main(["replay", str(path), *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_chm_replay_trace_format_is_for_files_not_generators(capsys):
    assert chm_main(["replay", "microbench", "--trace-format", "csv", "--no-progress"]) == 2
    assert "--trace-format csv is for a trace file, not the microbench generator" in capsys.readouterr().err
