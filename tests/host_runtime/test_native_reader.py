"""The native trace reader (host_runtime/replay/native_reader.py) pinned to libCacheSim's own reader.

Every format in NATIVE_FORMATS: seeded random traces, with the edge cases of each (a header or none, guessed or
told; comma, tab, space, pipe delimiters; columns in other orders, extra columns; CRLF; no newline at the end;
blank txt lines; quoted and padded fields; hex and octal ids; ids near 2^64; hashed ids (obj-id-is-num=false)
of every length; float and huge times; size 0;
limits; ignore_obj_size; files longer than the reader's 1 MiB buffer and a header line longer than it), read by
libcachesim's TraceReader (in one child process, as lcs_trace's _lcs_child reads them) and by the native
reader: the (clock_time, obj_id, obj_size) sequences must be equal. Then the files libCacheSim cannot read
right: a ValueError naming the file, the line or record, the field and the value.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require_oracle

from host_runtime.replay.lcs_trace import ORACLE_GENERAL_RECORD, TRACE_FORMATS, parse_trace_params
from host_runtime.replay.native_reader import NATIVE_FORMATS, NativeTraceReader, NativeUnsupported, xxh3_64

# libcachesim's reader through its binding, opened by host_runtime/replay/_lcs_child.py, for many traces at once
_CHILD = r"""
import json, sys
from host_runtime.replay._lcs_child import open_reader
out = [[[r.clock_time, r.obj_id, r.obj_size] for r in open_reader(spec)] for spec in json.load(open(sys.argv[1]))]
json.dump(out, open(sys.argv[2], "w"))
"""

U64 = 1 << 64
LCS_MAGIC = 0x123456789ABCDEF0


class Case:
    def __init__(self, name, data: bytes, trace_format: str, params: dict, ignore_obj_size=False, limit=None):
        self.name, self.data, self.trace_format, self.params = name, data, trace_format, params
        self.ignore_obj_size, self.limit = ignore_obj_size, limit

    def __repr__(self):
        return self.name


def _p(text: str, **extra) -> dict:
    return {**parse_trace_params(text), **extra}


def _csv(rows, delimiter=",", header=None, newline="\n", final_newline=True) -> bytes:
    lines = ([delimiter.join(header)] if header else []) + [delimiter.join(map(str, row)) for row in rows]
    text = newline.join(lines) + (newline if final_newline else "")
    return text.encode()


def _rows(rng: random.Random, n: int, *, sizes=(0, 1, 4096, 1 << 20), ids=1 << 20):
    t = rng.randrange(1 << 31)
    out = []
    for _ in range(n):
        t += rng.randrange(3)
        size = rng.choice(sizes) if rng.random() < 0.3 else rng.randrange(1, 1 << 24)
        out.append((t, rng.randrange(ids), size))
    return out


def _oracle(records) -> bytes:
    return b"".join(ORACLE_GENERAL_RECORD.pack(t, o, s, n) for t, o, s, n in records)


def _lcs(version: int, records) -> bytes:
    header = bytearray(8192)
    struct.pack_into("<QQ", header, 0, LCS_MAGIC, version)
    struct.pack_into("<qqq", header, 16, 1, len(records), len({r[1] for r in records}))  # stat: version, n_req, n_obj
    struct.pack_into("<Q", header, 8192 - 8, LCS_MAGIC)
    size_of = {1: 24, 2: 28, 3: 36, 4: 40, 5: 44, 6: 52, 7: 68, 8: 100}[version]
    body = bytearray()
    for t, o, s, nxt in records:
        if version == 1:
            rec = struct.pack("<IQIq", t, o, s, nxt)
        elif version == 2:
            rec = struct.pack("<IQIIq", t, o, s, 3 | (7 << 8), nxt)
        else:
            rec = struct.pack("<IQqIIq", t, o, s, 1 | (2 << 8), 60, nxt)
        body += rec + bytes(size_of - len(rec))  # features: zeros
    return bytes(header) + bytes(body)


def _cases() -> list[Case]:
    rng = random.Random(23)
    cols = "time-col=1,obj-id-col=2,obj-size-col=3"
    cases = []
    rows = _rows(rng, 3000)
    cases.append(Case("csv_header_told", _csv(rows, header=["time", "obj_id", "obj_size"]), "csv",
                      _p(cols + ",delimiter=,,has-header=true")))
    cases.append(Case("csv_header_guessed", _csv(rows, header=["time", "obj_id", "obj_size"]), "csv", _p(cols)))
    cases.append(Case("csv_no_header_guessed", _csv(rows), "csv", _p(cols)))
    cases.append(Case("csv_no_header_told", _csv(rows), "csv", _p(cols + ",has-header=false")))
    # a first data line with more letters (hex ids) than digits: libCacheSim guesses it is a header and skips it
    hexrows = [(1, "0xabcdefabcdef", 5)] + [(t, f"0x{o:x}", s) for t, o, s in _rows(rng, 50, sizes=(1,))]
    cases.append(Case("csv_header_guess_hex", _csv(hexrows), "csv", _p(cols)))
    # one digit more than letters: a request; as many: a header
    cases.append(Case("csv_header_guess_digits_win", _csv([(12, "0xab", 5)] + hexrows[1:]), "csv", _p(cols)))
    cases.append(Case("csv_header_guess_tie", _csv([(1, "0xab", 5)] + hexrows[1:]), "csv", _p(cols)))
    # tab, columns in another order, extra text columns
    wide = [(f"k{o}", o, "get", t, s, "x y") for t, o, s in _rows(rng, 2000)]
    cases.append(Case("csv_tab_reordered", _csv(wide, "\t", ["key", "id", "op", "ts", "size", "note"]), "csv",
                      _p("time-col=4,obj-id-col=2,obj-size-col=5,op-col=3,has-header=true", delimiter="\t")))
    cases.append(Case("csv_space", _csv(_rows(rng, 500), " "), "csv", _p(cols, delimiter=" ")))
    cases.append(Case("csv_pipe_crlf", _csv(_rows(rng, 500), "|", ["a", "b", "c"], "\r\n"), "csv",
                      _p(cols + ",has-header=true", delimiter="|")))
    cases.append(Case("csv_no_final_newline", _csv(_rows(rng, 200), final_newline=False), "csv", _p(cols)))
    # ids near 2^64, hex and octal ids, padded and quoted fields, float / exponent / hex times, size 0
    special = [(0, U64 - 1, 1), (1, U64 - 2, 0), (2, 1 << 63, 7), ("3.99", "0xffffffffffffffff", "0x10"),
               ("1e3", "0777", "010"), ("  4 ", " 12 ", " 9 "), ('"5"', '"13"', '"4096"'), ("0x1p4", 14, 0),
               ("-2.5", 15, 1), (9007199254740993, 16, 3), ("123456789012345678", 17, (1 << 63) - 1),
               ("+6", "+18", "+5")]
    special += [(t, rng.randrange(U64 - 1000, U64), s) for t, _, s in _rows(rng, 300)]
    cases.append(Case("csv_special_values", _csv(special), "csv", _p(cols + ",has-header=false")))
    cases.append(Case("csv_limit", _csv(rows), "csv", _p(cols), limit=100))
    cases.append(Case("csv_limit_1_is_no_cap", _csv(rows[:50]), "csv", _p(cols), limit=1))
    cases.append(Case("csv_ignore_obj_size", _csv(rows), "csv", _p(cols), ignore_obj_size=True))
    cases.append(Case("csv_no_size_col", _csv(rows[:300]), "csv", _p("time-col=1,obj-id-col=2")))
    cases.append(Case("csv_no_time_col", _csv(rows[:300]), "csv", _p("obj-id-col=2,obj-size-col=3")))
    cases.append(Case("csv_id_col_shadows_time", _csv(rows[:300]), "csv", _p("time-col=2,obj-id-col=2,obj-size-col=3")))
    cases.append(Case("csv_obj_id_is_num_told", _csv(rows[:300]), "csv", _p(cols + ",obj-id-is-num=true")))
    # obj-id-is-num=false: ids hashed (XXH3 of the field as libcsv gives it: unquoted, trimmed), of every length
    keys = ["user%d" % rng.randrange(10 ** 6) for _ in range(1500)] + ["", "12", "0x10", "  padded  ", "\u00e9t\u00e9",
            "k" * 300, "x" * 3000, '"a,b"', '"say ""hi"""', '"  kept  "', " tab\tin"]
    rng.shuffle(keys)
    named = [(t, k, s) for (t, _, s), k in zip(_rows(rng, len(keys)), keys)]
    cases.append(Case("csv_hashed_ids", _csv(named, header=["t", "key", "size"]), "csv",
                      _p(cols + ",obj-id-is-num=false,has-header=true")))
    cases.append(Case("csv_hashed_ids_tab", _csv([(k, t, s) for t, k, s in named if "\t" not in k], "\t"), "csv",
                      _p("obj-id-col=1,time-col=2,obj-size-col=3,obj-id-is-num=false,has-header=false",
                         delimiter="\t")))
    # longer than the reader's 1 MiB buffer: lines cross chunk boundaries; a 2 MiB header line makes it grow
    big = _rows(rng, 70000)
    cases.append(Case("csv_many_chunks", _csv(big), "csv", _p(cols)))
    cases.append(Case("csv_long_header", _csv(big[:100], header=["t" * (2 << 20), "id", "size"]), "csv",
                      _p(cols + ",has-header=true")))
    # txt: one id per line; "\n" lines are skipped
    ids = [rng.randrange(U64) if rng.random() < 0.1 else rng.randrange(5000) for _ in range(3000)]
    lines = [str(o) for o in ids]
    for i in range(0, len(lines), 97):
        lines[i] += "\n"  # a blank line after it
    lines[5], lines[6], lines[7] = "0x1f", "  42", "0755"
    cases.append(Case("txt", ("\n".join(lines) + "\n").encode(), "txt", {}))
    cases.append(Case("txt_crlf_no_final_newline", "\r\n".join(map(str, ids[:500])).encode(), "txt", {}))
    cases.append(Case("txt_limit", ("\n".join(map(str, ids)) + "\n").encode(), "txt", {}, limit=1000))
    # oracleGeneral: uint32 time, uint64 id, uint32 size (0: skipped), int64 next access
    recs = [(rng.randrange(1 << 32), rng.randrange(U64), rng.choice([0, 1, 512, (1 << 32) - 1, rng.randrange(1 << 32)]),
             rng.choice([-1, rng.randrange(1 << 40)])) for _ in range(5000)]
    cases.append(Case("oracleGeneral", _oracle(recs), "oracleGeneral", {}))
    cases.append(Case("oracleGeneral_limit_ignore_size", _oracle(recs), "oracleGeneral", {}, True, 777))
    cases.append(Case("oracleGeneral_many_chunks", _oracle(recs * 12), "oracleGeneral", {}))
    for version in (1, 2, 3, 4, 8):
        lrecs = [(t, o, s if version < 3 or rng.random() < 0.5 else rng.randrange(1 << 40), n) for t, o, s, n in recs]
        cases.append(Case(f"lcs_v{version}", _lcs(version, lrecs), "lcs", {}))
    cases.append(Case("lcs_v1_limit", _lcs(1, recs), "lcs", {}, limit=300))
    return cases


CASES = _cases()


def test_every_format_has_cases():
    assert set(NATIVE_FORMATS) <= set(TRACE_FORMATS)
    assert {c.trace_format for c in CASES} == set(NATIVE_FORMATS)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Each case's file, and what libCacheSim's reader reads from it: {name: (path, [(time, id, size), ...])}."""
    folder = tmp_path_factory.mktemp("native_reader")
    specs = []
    for case in CASES:
        path = folder / f"{case.name}.{case.trace_format}"
        path.write_bytes(case.data)
        specs.append({"path": str(path), "trace_type": TRACE_FORMATS[case.trace_format], "params": case.params,
                      "ignore_obj_size": case.ignore_obj_size, "limit": case.limit})
    (folder / "specs.json").write_text(json.dumps(specs))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder / "specs.json"), str(folder / "out.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((folder / "out.json").read_text())
    return {case.name: (Path(spec["path"]), [tuple(r) for r in result])
            for case, spec, result in zip(CASES, specs, results)}


def _native(case: Case, path: Path, **kw):
    reader = NativeTraceReader(path, case.trace_format, case.params, case.ignore_obj_size, case.limit, **kw)
    times, ids, sizes = reader.read_all()
    assert times.dtype == np.int64 and ids.dtype == np.uint64 and sizes.dtype == np.int64
    return list(zip(times.tolist(), ids.tolist(), sizes.tolist()))


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_same_requests_as_libcachesim(case, traces):
    path, expected = traces[case.name]
    assert expected, f"libCacheSim read no request of {case.name}"  # a case that tests something
    got = _native(case, path)
    assert len(got) == len(expected)
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert first is None, f"request {first + 1}: native {got[first]}, libCacheSim {expected[first]}"


def test_cases_reach_the_edges(traces):
    """The cases hold what they claim: size-0 requests skipped, the guessed header skipped, ids near 2^64."""
    assert len(traces["csv_header_told"][1]) == len(traces["csv_no_header_told"][1]) < 3000  # size 0: skipped
    assert len(traces["csv_header_guess_hex"][1]) == 50  # its first line taken for a header
    assert len(traces["csv_header_guess_tie"][1]) == 50 and len(traces["csv_header_guess_digits_win"][1]) == 51
    assert max(o for _, o, _ in traces["csv_special_values"][1]) == U64 - 1
    assert len(traces["csv_limit"][1]) == 100 and len(traces["csv_limit_1_is_no_cap"][1]) > 1
    assert {s for _, _, s in traces["csv_ignore_obj_size"][1]} == {1}
    assert {t for t, _, _ in traces["csv_id_col_shadows_time"][1]} == {0}
    assert len({o for _, o, _ in traces["csv_hashed_ids"][1]}) > 1000  # hashed, not read as 0


def test_xxh3_is_xxhash():
    """The hash of csv ids that are not numbers is XXH3_64bits, on every length to 2 KiB (each of its paths)."""
    xxhash = require_oracle("xxhash")
    rng = random.Random(64)
    for n in range(2049):
        data = rng.randbytes(n)
        assert xxh3_64(data) == xxhash.xxh3_64_intdigest(data), n


def test_batches_and_reset(traces):
    """Any batch size gives the same requests; reset starts over (the header skipped again)."""
    case = next(c for c in CASES if c.name == "csv_header_told")
    path, expected = traces[case.name]
    assert _native(case, path, batch=7) == expected
    reader = NativeTraceReader(path, "csv", case.params, batch=1000)
    first = reader.read_batch(10)
    assert list(zip(*(c.tolist() for c in first))) == expected[:10]
    list(reader)
    assert reader.read_batch()[0].size == 0 and reader.requests == len(expected)
    reader.reset()
    assert list(zip(*(c.tolist() for c in reader.read_all()))) == expected
    with NativeTraceReader(path, "csv", case.params) as again:  # closed on leaving, once
        assert list(zip(*(c.tolist() for c in again.read_batch(3)))) == expected[:3]
    again.close()
    with pytest.raises(ValueError, match="closed"):
        again.read_batch()


# ---- what libCacheSim cannot read right: an error naming the file, the line or record, the field, the value ----

def _error(tmp_path, data: bytes, trace_format="csv", params=None, name="trace.csv", **kw) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError) as exc:
        NativeTraceReader(path, trace_format, params if params is not None else
                          _p("time-col=1,obj-id-col=2,obj-size-col=3"), **kw).read_all()
    assert str(path) in str(exc.value)
    return str(exc.value)


def test_non_numeric_field(tmp_path):
    rows = [(i, i, 10) for i in range(1, 20)]
    rows[15] = (16, 16, "abc")
    assert "line 17: obj-size-col 3: 'abc' is not a number" in _error(tmp_path, _csv(rows, header=["t", "o", "s"]))
    rows[15] = ("x", 16, 1)
    assert "line 16: time-col 1: 'x' is not a number" in _error(tmp_path, _csv(rows))
    rows[15] = (16, "12abc", 1)
    assert "line 16: obj-id-col 2: '12abc' is not a number" in _error(tmp_path, _csv(rows))


def test_out_of_range_field(tmp_path):
    assert "line 2: obj-id-col 2: '18446744073709551616' is out of range" in _error(
        tmp_path, _csv([(1, 1, 1), (2, U64, 1)]))
    assert "line 2: obj-size-col 3: '-5' is out of range" in _error(tmp_path, _csv([(1, 1, 1), (2, 2, -5)]))
    assert "line 1: obj-id-col 2: '-1' is out of range" in _error(tmp_path, _csv([(1, -1, 1)]))
    assert "time-col 1: '1e300' is out of range" in _error(tmp_path, _csv([(1, 1, 1), ("1e300", 2, 1)]))


def test_missing_column(tmp_path):
    msg = _error(tmp_path, b"1,1,1\n2,2,2\n3,3,3\n4,4,4\n5,5\n")
    assert "line 5: 2 columns, but obj-size-col is 3" in msg


def test_blank_csv_line(tmp_path):
    assert "line 3: an empty line" in _error(tmp_path, b"1,1,1\n2,2,2\n\n3,3,3\n")


def test_first_line_without_the_delimiter(tmp_path):
    assert "line 1:" in _error(tmp_path, b"1;1;1\n2;2;2\n")


def test_bad_quote(tmp_path):
    assert "line 2: column 2:" in _error(tmp_path, b'1,1,1\n2,"2"x,2\n')


def test_txt_line_not_a_number(tmp_path):
    assert "line 3: 'abc' is not a number" in _error(tmp_path, b"1\n2\nabc\n", "txt", {}, "trace.txt")
    assert "line 2: '\\x0d' is not a number" in _error(tmp_path, b"1\r\n\r\n3\r\n", "txt", {}, "trace.txt")


def test_truncated_oracle_general_record(tmp_path):
    data = _oracle([(1, 1, 1, -1)] * 3) + b"\x01" * 10
    assert "record 4: 10 of its 24 bytes" in _error(tmp_path, data, "oracleGeneral", {}, "t.oracleGeneral")


def test_bad_lcs_header(tmp_path):
    good = _lcs(1, [(1, 1, 1, -1)])
    assert "start magic" in _error(tmp_path, b"\0" * 8 + good[8:], "lcs", {}, "t.lcs")
    assert "shorter than its 8192-byte header" in _error(tmp_path, good[:100], "lcs", {}, "t.lcs")
    assert "version 9" in _error(tmp_path, good[:8] + struct.pack("<Q", 9) + good[16:], "lcs", {}, "t.lcs")
    assert "record 2: 4 of its 24 bytes" in _error(tmp_path, good + b"abcd", "lcs", {}, "t.lcs")


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.csv: cannot open: No such file"):
        NativeTraceReader(tmp_path / "nope.csv", "csv", _p("obj-id-col=1"))


def test_unsupported_is_its_own_error(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"1,a,1\n")
    for params in (_p("obj-id-col=2,cnt-col=3"), {"obj_id_field": 2, "obj_id_is_num": False}):
        with pytest.raises(NativeUnsupported):
            NativeTraceReader(path, "csv", params)
    with pytest.raises(NativeUnsupported, match="glib quarks"):
        NativeTraceReader(path, "txt", _p("obj-id-is-num=false"))
    with pytest.raises(NativeUnsupported):
        NativeTraceReader(path, "vscsi", {})
