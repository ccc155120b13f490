"""``chm replay`` on bad input (issue #21): trace lines, libCacheSim csv parameters and rows, flags. Each is an
error naming the field, the value and the allowed range (a trace line: its file and line), never a traceback,
a hang or a silent 0; and a request of very many blocks costs work in proportion to what the device can take."""

from __future__ import annotations

import json

import pytest

from emulator.cli import main as chm_main
from host_runtime.hymcache.master import MAX_BATCH
from host_runtime.replay import LibCacheSimTrace, MooncakeTrace, Replay, parse_trace_params, replay_config
from host_runtime.replay.lcs_trace import write_oracle_general
from host_runtime.replay.models import parse_bytes

MiB = 1 << 20
PAGE = 64 << 10  # the small profile's page
OK = '{"timestamp": 0, "input_length": 600, "hash_ids": [0, 1]}'


def _lines(tmp_path, *lines: str | bytes, name="t.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


# ---- Mooncake lines ------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, problem", [
    ('[1, 2]', "the line is a JSON list, not an object"),
    ('"timestamp"', "the line is a JSON str, not an object"),
    ('null', "the line is a JSON NoneType, not an object"),
    ('{"timestamp": 1' + "0" * 400 + ', "hash_ids": [1]}', "timestamp = 1000000000000000"),  # no float: not inf
    ('{"timestamp": 1, "hash_ids": []}', "hash_ids = [] must be a non-empty list"),
    ('{"timestamp": 1, "hash_ids": [0, 18446744073709551616]}', "element 1 is 18446744073709551616 (int)"),
    ('{"timestamp": 1, "hash_ids": [0, 1' + "0" * 40 + ']}', "must be a list of integers in [0, 2^62): element 1"),
    ('{"timestamp": 1, "hash_ids": [5, 6, 5]}', "element 2 repeats element 0, 5"),
    ('{"timestamp": 1, "hash_ids": {"0": 1}}', "hash_ids = {'0': 1} must be a non-empty list"),
    ('{"timestamp": 1, "hash_ids": [1], "input_length": 1' + "0" * 400 + '}', "input_length = 1000"),
    ('[' * 100_000 + ']' * 100_000, "RecursionError"),  # nested past the parser's depth
    ('{"timestamp": 1, "hash_ids": [1], "\u00fc": "\u1e9e"}\n{"timestamp": 2, "hash_ids": [-1]}', "element 0 is -1"),
])
def test_a_bad_mooncake_line_is_an_error_naming_file_line_and_range(tmp_path, line, problem):
    path = _lines(tmp_path, OK, line)
    with pytest.raises(ValueError) as info:
        MooncakeTrace(path, MiB)
    text = str(info.value)
    assert f"{path}:2: not a Mooncake record" in text or f"{path}:3: not a Mooncake record" in text
    assert problem in text and len(text) < 1000  # a huge value is quoted short


def test_a_bad_element_of_a_huge_hash_id_list_is_quoted_short(tmp_path):
    path = _lines(tmp_path, json.dumps({"timestamp": 0, "hash_ids": list(range(100_000)) + ["x"]}))
    with pytest.raises(ValueError) as info:
        MooncakeTrace(path, MiB)
    assert "element 100000 is 'x' (str)" in str(info.value) and len(str(info.value)) < 1000


def test_a_trace_spanning_more_than_int64_nanoseconds_is_an_error_naming_both_lines(tmp_path):
    path = _lines(tmp_path, OK, "", '{"timestamp": 1e300, "hash_ids": [0, 2]}')
    with pytest.raises(ValueError) as info:
        MooncakeTrace(path, MiB)
    assert str(info.value).startswith(f"{path}: line 3 (timestamp 1e+300) comes 1e+297 s of virtual time after "
                                      f"line 1 (timestamp 0)")
    assert "at most 9.223e+09 s (2^63 ns, ~292 years)" in str(info.value)
    assert len(MooncakeTrace(path, MiB, limit=1).records) == 1  # the span of the lines read
    # the bound is on the scaled span: 1e13 ms is 1e19 ns, past 2^63; half of it is within
    far = _lines(tmp_path, OK, '{"timestamp": 1e13, "hash_ids": [0, 2]}')
    with pytest.raises(ValueError, match=r"line 2 \(timestamp 1e\+13\) comes 1e\+10 s .* after line 1"):
        MooncakeTrace(far, MiB)
    assert len(MooncakeTrace(far, MiB, time_scale=0.5).records) == 2


def test_a_span_of_31_years_replays_with_only_its_windows_that_have_requests(tmp_path):
    path = _lines(tmp_path, OK, '{"timestamp": 1e12, "hash_ids": [0, 2]}')  # 1e12 ms: 1.7 M windows of 600 s
    trace = MooncakeTrace(path, 256 << 10, tokens_per_block=512)
    result = Replay(replay_config("small", "lru"), "lru", trace, progress=False).run()
    assert [row["bucket"] for row in result["rows"]] == ["0", "1e+09"]
    assert result["total"]["blocks_read"] == 1  # hash 0, stored by the first request


@pytest.mark.parametrize("time_scale", [0.0, -1.0, 1e308, float("nan"), float("inf"), True, "1"])
def test_time_scale_outside_its_range_is_an_error(tmp_path, time_scale):
    with pytest.raises(ValueError, match=r"time_scale = .* must be a number in \[1e-09, 1e\+09\]"):
        MooncakeTrace(_lines(tmp_path, OK), MiB, time_scale=time_scale)


# ---- flags ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--time-scale", "1e308"], "argument --time-scale: 1e+308 must be in [1e-09, 1e+09]"),
    (["--time-scale", "nan"], "argument --time-scale: nan must be in [1e-09, 1e+09]"),
    (["--window-s", "1e308"], "argument --window-s: 1e+308 must be in [1e-06, 1e+09]"),
    (["--window-s", "1e-320"], "argument --window-s: 9.99989e-321 must be in [1e-06, 1e+09]"),
    (["--block-bytes", "1e400"], "--block-bytes = '1e400' is not a finite byte count"),
    (["--window-bytes", "1e400KiB"], "--window-bytes = '1e400KiB' is not a finite byte count"),
])
def test_chm_replay_flags_out_of_range_are_usage_errors(tmp_path, capsys, argv, message):
    assert chm_main(["replay", str(_lines(tmp_path, OK)), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["randread", "--region-bytes", "1e30"], "objects to populate is 5.96e+22 block references; a generated "
                                             "workload may have at most 1e+08"),
    (["randread", "--concurrency", "1000000", "--reads-per-client", "1000"], "concurrency x reads_per_client"),
    (["microbench", "--concurrency", str(10**12)], "is 6.72e+14 block references"),
    (["microbench", "--turns", str(10**9)], "is 1.02e+21 block references"),
    (["conversation", "--sessions", str(10**12)], "is 2e+12 block references"),
    (["conversation", "--mean-turns", "1e308"], "mean_turns = 1e+308 must be in [1, 10000]"),
    (["conversation", "--mean-prompt-tokens", "1e308"], "mean_prompt_tokens = 1e+308 must be in (0, 1e+09]"),
    (["conversation", "--mean-response-tokens", "inf"], "mean_response_tokens = inf must be in (0, 1e+09]"),
    (["conversation", "--system-prompt-tokens", str(10**15)], "system_prompt_tokens = 1000000000000000 must be in "
                                                               "[0, 2147483648)"),
    (["conversation", "--rate", "1e-320"], "s of virtual time; a workload may span at most 9.223e+09 s"),
    (["conversation", "--think-s", "1e308"], "s of virtual time; a workload may span at most 9.223e+09 s"),
])
def test_generator_flags_past_what_can_be_built_are_usage_errors(capsys, argv, message):
    """Each hung, ran out of memory or overflowed before it was bounded."""
    assert chm_main(["replay", *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_a_conversation_drawn_past_the_bound_stops_with_an_error_naming_the_session(capsys):
    assert chm_main(["replay", "conversation", "--mean-prompt-tokens", "1e9", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "session 3 turn 1: its context of" in err and "at most 16777216 blocks per session" in err, err


def test_parse_bytes_names_an_infinite_count():
    with pytest.raises(ValueError, match="--dram = '1e400' is not a finite byte count"):
        parse_bytes("1e400", "--dram")


def test_chm_replay_of_a_trace_with_a_bad_line_exits_1_naming_it(tmp_path, capsys):
    path = _lines(tmp_path, OK, '{"timestamp": 1' + "0" * 400 + ', "hash_ids": [1]}')
    assert chm_main(["replay", str(path), "--no-progress"]) == 1
    assert f"chm replay: error: {path}:2: not a Mooncake record" in capsys.readouterr().err


# ---- libCacheSim csv: columns and values libCacheSim would read as 0 or 1 ------------------------------------
CSV_PARAMS = "time-col=1,obj-id-col=2,obj-size-col=3,delimiter=,,has-header=true"


def _csv(tmp_path, *rows: str):
    return _lines(tmp_path, "time,id,size", *rows, name="t.csv")


@pytest.mark.parametrize("params, rows, message", [
    ("time-col=99,obj-id-col=2,obj-size-col=3,has-header=true", ["1,10,4096"],
     ":1: 3 columns, but time-col = 99 (columns are counted from 1"),
    ("time-col=1,obj-id-col=2,obj-size-col=7", ["1,10,4096"], ":1: 3 columns, but obj-size-col = 7"),
    (CSV_PARAMS, ["1,10,4096", "2,11", "3,12,5"], ":3: 2 columns, but obj-size-col = 3"),
    (CSV_PARAMS, ["1,10,4096", "3"], ":3: 1 column, but obj-id-col = 2, obj-size-col = 3"),
    (CSV_PARAMS, ["1,10,1e30"], ":2: obj_size = '1e30' (obj-size-col = 3) must be an integer in [0, 2^63)"),
    (CSV_PARAMS, ["1,10,100000000000000000000000"], ":2: obj_size = '100000000000000000000000'"),
    (CSV_PARAMS, ["1,10,-5"], ":2: obj_size = '-5' (obj-size-col = 3) must be an integer in [0, 2^63)"),
    (CSV_PARAMS, ["soon,10,5"], ":2: clock_time = 'soon' (time-col = 1) must be a number in [0, 2^63)"),
    (CSV_PARAMS, ["1e300,10,5"], ":2: clock_time = '1e300'"),
    (CSV_PARAMS, ["1,10,5", '2,"1,1",5'], ":3: obj_id = '1,1' (obj-id-col = 2) must be an integer in [0, 2^64)"),
])
def test_a_csv_row_libcachesim_would_misread_is_an_error_naming_the_line(tmp_path, params, rows, message):
    path = _csv(tmp_path, *rows)
    with pytest.raises(ValueError) as info:
        LibCacheSimTrace(path, "csv", PAGE, parse_trace_params(params))
    assert str(info.value).startswith(f"{path}:") and message in str(info.value)


def test_csv_numbers_libcachesim_reads_as_written_are_accepted(tmp_path):
    """Fractional seconds, spaces, signs, hex; a header libCacheSim guesses; string ids."""
    path = _csv(tmp_path, "1.5,10,4096", " 7,11, 4096", "+5,12,0x10")
    trace = LibCacheSimTrace(path, "csv", PAGE, parse_trace_params(CSV_PARAMS))
    assert (list(trace.times), list(trace.sizes)) == ([1, 7, 5], [4096, 4096, 16])
    guessed = _lines(tmp_path, "a,b,c", "1,10,4096", "2,k,8192", name="g.csv")  # a header libCacheSim guesses
    ids = LibCacheSimTrace(guessed, "csv", PAGE, parse_trace_params("time-col=1,obj-id-col=2,obj-size-col=3,"
                                                                    "obj-id-is-num=false"))
    assert list(ids.times) == [1, 2]


@pytest.mark.parametrize("text", ["time-col=1,delimiter=", "delimiter=  "])
def test_an_empty_delimiter_is_an_error_not_a_comma(text):
    with pytest.raises(ValueError) as info:
        parse_trace_params(text)
    assert "delimiter = '' must be one character (a comma: delimiter=,, ; a tab: \\t)" in str(info.value)


def test_delimiters_are_what_is_written():
    assert parse_trace_params("delimiter=,,time-col=1") == {"delimiter": ",", "time_field": 1}
    assert parse_trace_params("delimiter=,") == {"delimiter": ","}
    assert parse_trace_params("delimiter=\t,time-col=1") == {"delimiter": "\t", "time_field": 1}  # a literal tab
    assert parse_trace_params("delimiter=\\t") == {"delimiter": "\t"}
    assert parse_trace_params("delimiter=|") == {"delimiter": "|"}
    assert parse_trace_params("delimiter= ,time-col=1") == {"delimiter": " ", "time_field": 1}  # a space


def test_a_libcachesim_trace_spanning_more_than_int64_nanoseconds_is_an_error(tmp_path):
    path = write_oracle_general(tmp_path / "t.oracleGeneral", [(0, 1, 10), (1 << 31, 2, 10)])  # 68 years
    assert len(LibCacheSimTrace(path, "oracleGeneral", PAGE).times) == 2
    with pytest.raises(ValueError) as info:
        LibCacheSimTrace(path, "oracleGeneral", PAGE, time_scale=10.0)
    assert str(info.value).startswith(f"{path}: request 2 (clock_time 2147483648) comes 2.14748e+10 s of "
                                      f"virtual time after request 1 (clock_time 0) (timestamps in s, times "
                                      f"time_scale 10)")


# ---- a request of very many blocks ---------------------------------------------------------------------
def test_a_request_of_200k_blocks_offers_the_master_no_chunk_past_its_first_refusal(tmp_path):
    """One Mooncake line of 200,000 hash ids on a device of 8,192 blocks: the Master places 8,192 of the first
    chunk of MAX_BATCH keys, evicts what it can, refuses (ENOSPC) and takes them back. The later chunks would
    fail the same way after as much work each: they are not offered, so the work is one chunk, not n/MAX_BATCH
    of them (10^7 ids took 346 s). Counted: the keys the Master is asked to place."""
    n = 200_000
    path = _lines(tmp_path, json.dumps({"timestamp": 0, "hash_ids": list(range(n))}))
    trace = MooncakeTrace(path, MiB, tokens_per_block=512)  # one 1 MiB block per hash id
    # the Python loop (its put_start is watched here); the native loop is pinned to it (test_native_replay.py)
    replay = Replay(replay_config("small", "lru"), "lru", trace, progress=False, native=False)
    offered = []
    put_start = replay.master.put_start
    replay.master.put_start = lambda rid, keys, sizes: (offered.append(len(keys)), put_start(rid, keys, sizes))[1]
    result = replay.run()
    assert offered == [MAX_BATCH]
    assert result["master"]["no_space_puts"] == 1 and result["total"]["blocks_written"] == 0
