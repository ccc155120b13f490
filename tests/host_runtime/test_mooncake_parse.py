"""The fast Mooncake line parser (msgspec) against its specification, the json.loads path
(traces._parse_line_reference): on every line, valid or not, the same record and lengths, or the same
exception with the same message -- and so MooncakeTrace's records and errors are what they were."""

from __future__ import annotations

import json
import random

import pytest

from emulator.shared_data import mooncake_conversation_trace
from host_runtime.replay.traces import MooncakeTrace, _mooncake_line_parser, _parse_line_reference

MiB = 1 << 20
BLOCKS_PER_HASH = (1, 4, 512)  # tokens per block 512, 128, 1: hash ids below 2^64, 2^62, 2^55

TRICKY = [
    # plain and spaced
    '{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3]}',
    '{"timestamp":1,"hash_ids":[1]}',
    ' \t{ "timestamp" :1 , "hash_ids" : [ 1 ] } \t ',
    '{"timestamp": 1,\r "hash_ids": [1]}\r',
    '{"hash_ids": [5, 4], "timestamp": 2.5}',
    # timestamps: exponents, signs, zeros, floats a float cannot hold exactly, big and huge integers
    '{"timestamp": 1.7e12, "hash_ids": [1]}', '{"timestamp": 1E5, "hash_ids": [1]}',
    '{"timestamp": 1e+5, "hash_ids": [1]}', '{"timestamp": 25e-1, "hash_ids": [1]}',
    '{"timestamp": 0.1, "hash_ids": [1]}', '{"timestamp": 1736953210123.4567, "hash_ids": [1]}',
    '{"timestamp": 2.2250738585072014e-308, "hash_ids": [1]}', '{"timestamp": 4.9e-324, "hash_ids": [1]}',
    '{"timestamp": 1e-400, "hash_ids": [1]}', '{"timestamp": -1e-400, "hash_ids": [1]}',
    '{"timestamp": -0, "hash_ids": [1]}', '{"timestamp": -0.0, "hash_ids": [1]}', '{"timestamp": 0e0, "hash_ids": [1]}',
    '{"timestamp": 9007199254740993, "hash_ids": [1]}', '{"timestamp": 9223372036854775807, "hash_ids": [1]}',
    '{"timestamp": 9223372036854775808, "hash_ids": [1]}', '{"timestamp": 18446744073709551616, "hash_ids": [1]}',
    '{"timestamp": 1180591620717411303424, "hash_ids": [1]}', '{"timestamp": 1e20, "hash_ids": [1]}',
    '{"timestamp": 123456789012345678901234567890e-10, "hash_ids": [1]}',
    '{"timestamp": 1' + '0' * 300 + ', "hash_ids": [1]}', '{"timestamp": 1' + '0' * 301 + ', "hash_ids": [1]}',
    '{"timestamp": 1' + '0' * 400 + ', "hash_ids": [1]}', '{"timestamp": 1' + '0' * 300 + '.0, "hash_ids": [1]}',
    '{"timestamp": ' + str(2**1023) + ', "hash_ids": [1]}', '{"timestamp": ' + str(2**1024) + ', "hash_ids": [1]}',
    '{"timestamp": 1' + '0' * 5000 + ', "hash_ids": [1]}',
    '{"timestamp": 1e308, "hash_ids": [1]}', '{"timestamp": 1e400, "hash_ids": [1]}',
    '{"timestamp": -1e400, "hash_ids": [1]}', '{"timestamp": NaN, "hash_ids": [1]}',
    '{"timestamp": Infinity, "hash_ids": [1]}', '{"timestamp": -Infinity, "hash_ids": [1]}',
    '{"timestamp": -1, "hash_ids": [1]}', '{"timestamp": -9223372036854775809, "hash_ids": [1]}',
    '{"timestamp": true, "hash_ids": [1]}', '{"timestamp": null, "hash_ids": [1]}',
    '{"timestamp": "5", "hash_ids": [1]}', '{"timestamp": [5], "hash_ids": [1]}',
    # hash ids: bounds of each key width, huge integers, bools, floats, strings, duplicates, empty
    '{"timestamp": 1, "hash_ids": [-0, 1]}', '{"timestamp": 1, "hash_ids": [9223372036854775807]}',
    '{"timestamp": 1, "hash_ids": [9223372036854775808]}', '{"timestamp": 1, "hash_ids": [18446744073709551615]}',
    '{"timestamp": 1, "hash_ids": [18446744073709551616]}', '{"timestamp": 1, "hash_ids": [4611686018427387903]}',
    '{"timestamp": 1, "hash_ids": [4611686018427387904]}', '{"timestamp": 1, "hash_ids": [36028797018963967]}',
    '{"timestamp": 1, "hash_ids": [36028797018963968]}', '{"timestamp": 1, "hash_ids": [1' + '0' * 5000 + ']}',
    '{"timestamp": 1, "hash_ids": [-1]}', '{"timestamp": 1, "hash_ids": [1, -2]}',
    '{"timestamp": 1, "hash_ids": [2.0]}', '{"timestamp": 1, "hash_ids": [1e2]}', '{"timestamp": 1, "hash_ids": [1.5]}',
    '{"timestamp": 1, "hash_ids": [1.7, true, "3"]}', '{"timestamp": 1, "hash_ids": [2, true]}',
    '{"timestamp": 1, "hash_ids": [2, false]}', '{"timestamp": 1, "hash_ids": [2, 3, "3"]}',
    '{"timestamp": 1, "hash_ids": [1, null]}', '{"timestamp": 1, "hash_ids": [NaN]}',
    '{"timestamp": 1, "hash_ids": [[1]]}', '{"timestamp": 1, "hash_ids": [1, 2, 1]}',
    '{"timestamp": 1, "hash_ids": [' + ', '.join(map(str, range(300))) + ', 7]}',
    '{"timestamp": 1, "hash_ids": []}', '{"timestamp": 1, "hash_ids": "123"}', '{"timestamp": 1, "hash_ids": {}}',
    '{"timestamp": 1, "hash_ids": null}',
    # lengths
    '{"timestamp": 1, "hash_ids": [1], "input_length": 512, "output_length": 0}',
    '{"timestamp": 1, "hash_ids": [1], "input_length": 513}', '{"timestamp": 1, "hash_ids": [1, 2], "input_length": 513}',
    '{"timestamp": 1, "hash_ids": [1], "input_length": 0}', '{"timestamp": 1, "hash_ids": [1], "output_length": -1}',
    '{"timestamp": 1, "hash_ids": [1], "input_length": null, "output_length": null}',
    '{"timestamp": 1, "hash_ids": [1], "input_length": 2.0}', '{"timestamp": 1, "hash_ids": [1], "output_length": 2.5}',
    '{"timestamp": 1, "hash_ids": [1], "input_length": true}', '{"timestamp": 1, "hash_ids": [1], "output_length": "7"}',
    '{"timestamp": 1, "hash_ids": [1], "input_length": 1' + '0' * 5000 + '}',
    '{"timestamp": 1, "hash_ids": [1], "output_length": 1' + '0' * 30 + '}',
    # duplicate keys: json keeps the last
    '{"timestamp": 1, "timestamp": 2, "hash_ids": [1]}', '{"timestamp": "x", "timestamp": 2, "hash_ids": [1]}',
    '{"timestamp": 2, "timestamp": "x", "hash_ids": [1]}', '{"hash_ids": [3], "timestamp": 1, "hash_ids": [1]}',
    '{"hash_ids": [1, 1], "timestamp": 1, "hash_ids": [1]}', '{"hash_ids": [1], "timestamp": 1, "hash_ids": [1, 1]}',
    '{"timestamp": 1, "hash_ids": [1], "input_length": 9999, "input_length": 2}',
    '{"timestamp": NaN, "timestamp": 3, "hash_ids": [1]}',
    # unicode escapes and non-ASCII
    '{"\\u0074imestamp": 1, "hash_ids": [1]}', '{"timestamp": 1, "hash\\u005fids": [1]}',
    '{"timestamp": 1, "hash_ids": [1], "timestamp\\u0000": 1}', '{"timestamp": 1, "hash_ids": [1], "n\\u00e9": "\\ud800"}',
    '{"timestamp": 1, "hash_ids": [1], "note": "caf\u00e9 \u2603"}', '{"timestamp": 1, "hash_ids": [1], "n": "\\ud83d\\ude00"}',
    '\ufeff{"timestamp": 1, "hash_ids": [1]}',
    # extra fields, nested, and what json takes there but msgspec would not judge alike
    '{"timestamp": 1, "hash_ids": [1], "x": 1}', '{"timestamp": 1, "hash_ids": [1], "x": {"y": [1, {"z": null}]}}',
    '{"timestamp": 1, "hash_ids": [1], "x": NaN}', '{"timestamp": 1, "hash_ids": [1], "x": 1' + '0' * 5000 + '}',
    '{"timestamp": 1, "hash_ids": [1], "x": ' + '[' * 5000 + ']' * 5000 + '}',
    '{"timestamp": 1, "hash_ids": [1], "x": ' + '[' * 50 + ']' * 50 + '}',
    '{"timestamp": 1, "hash_ids": [1], "x": "a\tb"}', '{"timestamp": 1, "hash_ids": [1], "x": "\\x"}',
    # not JSON, not an object, missing keys, trailing data
    '{"timestamp": 1, "hash_', '{"timestamp": 1, "hash_ids": [1],}', '{"timestamp": 1, "hash_ids": [1,]}',
    '{"timestamp": 01, "hash_ids": [1]}', '{"timestamp": 1., "hash_ids": [1]}', '{"timestamp": .5, "hash_ids": [1]}',
    '{"timestamp": +1, "hash_ids": [1]}', "{'timestamp': 1, 'hash_ids': [1]}", '{"timestamp": 1, "hash_ids": [1]} x',
    '{"timestamp": 1, "hash_ids": [1]}{}', '{"timestamp": 1, "hash_ids": [1]}\x00', '\x0c{"timestamp": 1, "hash_ids": [1]}',
    '{"timestamp": 1, "hash_ids": [1]}\x0c', '[1, 2]', '"x"', '5', 'null', '{}', '{"time": 1, "hash_ids": [1]}',
    '{"timestamp": 1}', '{"hash_ids": [1]}', '\udcff', '{"timestamp": 1, "hash_ids": [1], "x": "\udcff"}',
    '{"timestamp": 1, "hash_ids": [1], "x": "\udced\udca0\udc80"}',
]


def outcome(fn, line: bytes, blocks_per_hash: int):
    """What a parser makes of a line: its result (repr: -0.0 is not 0.0, True is not 1), or its error."""
    try:
        return "ok", repr(fn(line, blocks_per_hash))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        return "error", type(exc).__name__, str(exc)


def fast(line: bytes, blocks_per_hash: int):
    return _mooncake_line_parser(blocks_per_hash)(line)


def check(line: bytes, blocks_per_hash: int):
    assert outcome(fast, line, blocks_per_hash) == outcome(_parse_line_reference, line, blocks_per_hash), line[:200]


@pytest.mark.parametrize("blocks_per_hash", BLOCKS_PER_HASH)
@pytest.mark.parametrize("line", TRICKY, ids=range(len(TRICKY)))
def test_fast_parser_equals_the_reference_on_tricky_lines(line, blocks_per_hash):
    check(line.encode("utf-8", "surrogateescape") + b"\n", blocks_per_hash)


def test_tricky_lines_cover_both_outcomes():
    results = [outcome(_parse_line_reference, line.encode("utf-8", "surrogateescape"), 1)[0] for line in TRICKY]
    assert results.count("ok") >= 30 and results.count("error") >= 30


def test_utf16_and_utf32_lines_equal_the_reference():
    """json.loads takes bytes in any UTF (by their zero bytes or a BOM); msgspec only UTF-8."""
    text = '{"timestamp": 3, "hash_ids": [1, 2]}'
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"):
        for bph in BLOCKS_PER_HASH:
            check(text.encode(encoding), bph)


def _number(rng: random.Random) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        return str(rng.randrange(-3, 2**20))
    if kind == 1:
        return str(rng.randrange(2**rng.randrange(1, 80)))
    if kind == 2:
        return repr(rng.uniform(0, 2e12))
    if kind == 3:
        return f"{rng.randrange(1, 10**rng.randrange(1, 25))}e{rng.randrange(-330, 330)}"
    if kind == 4:
        return f"{rng.random():.{rng.randrange(1, 30)}f}E{rng.choice('+-')}{rng.randrange(0, 25)}"
    if kind == 5:
        return repr(rng.choice([0.0, -0.0, 5e-324, 1.7976931348623157e308, 2.0**63, 2.0**63 - 1024]))
    if kind == 6:
        return rng.choice(["-0", "0", "1", "NaN", "Infinity", "-Infinity", "true", "false", "null", '"3"', "1.0"])
    if kind == 7:
        return str(rng.choice([2**55, 2**62, 2**63, 2**64]) + rng.randrange(-2, 2))
    if kind == 8:  # digits a float cannot hold, rounding at the edge of a half-way point
        return f"{rng.randrange(10**16, 10**19)}.{rng.randrange(10**17):017d}"
    if kind == 9:
        return repr(rng.uniform(0, 1) * 10.0**rng.randrange(-20, 20))
    if kind == 10:
        return f"{rng.randrange(0, 10**6)}.{rng.randrange(10**6):06d}e{rng.randrange(-10, 10)}"
    return str(-rng.randrange(1, 2**rng.randrange(1, 70)))


def _record(rng: random.Random) -> str:
    fields = [("timestamp", _number(rng))]
    n = rng.choice([0, 1, 1, 2, 3, 5, 8, 20])
    ids = [rng.randrange(50) if rng.random() < 0.9 else rng.randrange(2**64) for _ in range(n)]
    items = [str(h) if rng.random() < 0.97 else _number(rng) for h in ids]
    fields.append(("hash_ids", "[" + ", ".join(items) + "]"))
    for name in ("input_length", "output_length"):
        if rng.random() < 0.6:
            fields.append((name, str(rng.randrange(-1, 512 * max(n, 1) + 3)) if rng.random() < 0.9 else _number(rng)))
    if rng.random() < 0.1:
        fields.append(rng.choice([("extra", '{"a": [1, 2]}'), ("\\u0074imestamp", _number(rng)),
                                  ("hash_ids", "[" + ", ".join(items[::-1]) + "]"), ("timestamp", _number(rng))]))
    rng.shuffle(fields)
    sep = rng.choice([", ", ",", " ,\t"])
    return "{" + sep.join(f'"{k}": {v}' for k, v in fields) + "}"


def _mutate(rng: random.Random, line: bytes) -> bytes:
    data = bytearray(line)
    for _ in range(rng.randrange(1, 3)):
        i = rng.randrange(len(data) + 1)
        op = rng.randrange(3)
        byte = rng.choice(b'{}[],:"0123456789-+.eE \t\r\x00\x0ctruefalsnNI\\u\xff\xc3')
        if op == 0 and i < len(data):
            del data[i]
        elif op == 1:
            data.insert(i, byte)
        elif i < len(data):
            data[i] = byte
    return bytes(data)


def test_fast_parser_equals_the_reference_on_random_lines():
    rng = random.Random(20240611)
    for _ in range(4000):
        line = _record(rng).encode()
        if rng.random() < 0.3:
            line = _mutate(rng, line)
        check(line + b"\n", rng.choice(BLOCKS_PER_HASH))


def test_float_timestamps_round_as_python_does():
    """msgspec's float parser against float(): the timestamp of an accepted line is float(text), exactly."""
    rng = random.Random(7)
    parse = _mooncake_line_parser(1)
    for _ in range(5000):
        text = _number(rng)
        try:
            ref = _parse_line_reference(b'{"timestamp": %s, "hash_ids": [1]}' % text.encode(), 1)
        except ValueError:
            continue
        assert repr(parse(b'{"timestamp": %s, "hash_ids": [1]}' % text.encode())) == repr(ref), text


def _reference_trace(path, blocks_per_hash):
    records, lengths = [], []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                record, length = _parse_line_reference(line, blocks_per_hash)
                records.append(record)
                lengths.append(length)
    return records, lengths


@pytest.mark.parametrize("tokens_per_block", [512, 128])
def test_shared_trace_reads_as_the_reference_reads_it(tokens_per_block):
    path = mooncake_conversation_trace()
    trace = MooncakeTrace(path, MiB, tokens_per_block=tokens_per_block)
    records, lengths = _reference_trace(path, 512 // tokens_per_block)
    assert trace.records == records and trace.lengths == lengths
    assert all(type(ts) is float for ts, _ in trace.records)


def test_trace_of_tricky_valid_lines_and_its_errors(tmp_path):
    def accepted(line):  # within the span a trace may have at the smallest time scale (1e21 ms)
        try:
            return _parse_line_reference(line.encode("utf-8", "surrogateescape"), 4)[0][0] <= 1e21
        except (ValueError, KeyError, TypeError, RecursionError):
            return False

    good = [line for line in TRICKY if accepted(line)]
    assert len(good) >= 30
    path = tmp_path / "good.jsonl"
    path.write_bytes(b"\n \n".join(line.encode("utf-8", "surrogateescape") for line in good) + b"\n")
    trace = MooncakeTrace(path, MiB, tokens_per_block=128, time_scale=1e-9)
    records, lengths = _reference_trace(path, 4)
    assert repr(trace.records) == repr(records) and trace.lengths == lengths
    assert len(trace.records) == len(good)
    for line in TRICKY:
        raw = line.encode("utf-8", "surrogateescape")
        result = outcome(_parse_line_reference, raw + b"\n", 4)
        if result[0] == "ok":
            continue
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(b'{"timestamp": 0, "hash_ids": [1]}\n\n' + raw + b"\n")
        with pytest.raises(ValueError) as info:
            MooncakeTrace(bad, MiB, tokens_per_block=128)
        assert str(info.value).startswith(f"{bad}:3: not a Mooncake record")
        assert str(info.value).endswith(f"): {result[1]}: {result[2]}")


def test_limit_stops_before_a_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": [2]}\nnot json\n')
    assert len(MooncakeTrace(path, MiB, limit=2).records) == 2
    with pytest.raises(ValueError, match=":3: not a Mooncake record"):
        MooncakeTrace(path, MiB, limit=3)


def test_json_module_is_the_reference():
    """The reference parses with json.loads: NaN is a float there (and an error in the trace), not a
    syntax error."""
    assert json.loads(b'{"timestamp": NaN}')["timestamp"] != json.loads(b'{"timestamp": NaN}')["timestamp"]
    with pytest.raises(ValueError, match="timestamp = nan must be a finite number"):
        _parse_line_reference(b'{"timestamp": NaN, "hash_ids": [1]}')
