"""Traces in every format libCacheSim reads (oracleGeneral, csv, txt, binary, vscsi, ...), read by
libCacheSim's own reader through its Python binding (``libcachesim``), not by a reader of ours.

Each request of such a trace is one object access at its ``clock_time`` (seconds, libCacheSim's unit, from
the first request; ``time_scale`` converts). An object of ``obj_size`` bytes is ``ceil(obj_size /
block_bytes)`` blocks (at least one; ``ignore_obj_size``: always one), so with ``block_bytes`` = the device
page an access is a read of the object's pages, and its first touch a write (driver.py: what the device holds
is read, the rest written).
The request's operation (get, set, delete) is not used.

The formats ``native_reader.NATIVE_FORMATS`` names (csv, txt, oracleGeneral, lcs) are read by the native
reader, pinned request for request to libCacheSim's (tests/host_runtime/test_native_reader.py): no Python object
per request. A trace it does not read (``NativeUnsupported``), or one it refuses, goes to libCacheSim's own
reader as every other format does, so a bad trace is reported in the words below, whichever reader found it.

libCacheSim's C reader aborts the whole process on a file it cannot read (a missing file, a txt line that is
not an id, a binary trace without its format), so that reading runs in a child process (``_lcs_child.py``);
its abort becomes a ValueError naming the file and libCacheSim's message.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import struct
import subprocess
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from .blocks import MAX_OBJECT_BLOCKS, OBJECT_BLOCK_BITS, OutOfOrder
from .traces import Phase, Request, Stream, check_span, check_time_scale

# libCacheSim's oracleGeneral record: time (s), obj_id, obj_size, next access (-1: unknown)
ORACLE_GENERAL_RECORD = struct.Struct("<IQIq")


def write_oracle_general(path: str | os.PathLike, requests) -> Path:
    """Write ``(time s, obj_id, obj_size)`` requests as an oracleGeneral trace (tests and benches)."""
    path = Path(path)
    with path.open("wb") as f:
        for t, obj, size in requests:
            f.write(ORACLE_GENERAL_RECORD.pack(t, obj, size, -1))
    return path

# chm replay --trace-format NAME -> libcachesim.TraceType member; names as libCacheSim's cachesim spells them.
TRACE_FORMATS: dict[str, str] = {
    "csv": "CSV_TRACE",
    "txt": "PLAIN_TXT_TRACE",
    "binary": "BIN_TRACE",
    "oracleGeneral": "ORACLE_GENERAL_TRACE",
    "lcs": "LCS_TRACE",
    "vscsi": "VSCSI_TRACE",
    "twr": "TWR_TRACE",
    "twrNS": "TWRNS_TRACE",
    "oracleSimTwr": "ORACLE_SIM_TWR_TRACE",
    "oracleSysTwr": "ORACLE_SYS_TWR_TRACE",
    "oracleSimTwrNS": "ORACLE_SIM_TWRNS_TRACE",
    "oracleSysTwrNS": "ORACLE_SYS_TWRNS_TRACE",
    "valpinTrace": "VALPIN_TRACE",
}

_COLUMN, _FLAG, _CHAR, _TEXT, _COUNT = "column", "flag", "char", "text", "count"
# libCacheSim's trace parameters (cachesim -t "KEY=VALUE, ..."), aliases included -> (ReaderInitParam attribute,
# kind of value). A flag also sets its ``*_set`` companion, so libCacheSim does not guess it.
TRACE_PARAMS: dict[str, tuple[str, str]] = {
    "time-col": ("time_field", _COLUMN), "time-field": ("time_field", _COLUMN),
    "obj-id-col": ("obj_id_field", _COLUMN), "obj-id-field": ("obj_id_field", _COLUMN),
    "obj-size-col": ("obj_size_field", _COLUMN), "obj-size-field": ("obj_size_field", _COLUMN),
    "size-col": ("obj_size_field", _COLUMN), "size-field": ("obj_size_field", _COLUMN),
    "op-col": ("op_field", _COLUMN), "op-field": ("op_field", _COLUMN),
    "ttl-col": ("ttl_field", _COLUMN), "ttl-field": ("ttl_field", _COLUMN),
    "cnt-col": ("cnt_field", _COLUMN), "cnt-field": ("cnt_field", _COLUMN),
    "tenant-col": ("tenant_field", _COLUMN), "tenant-field": ("tenant_field", _COLUMN),
    "next-access-col": ("next_access_vtime_field", _COLUMN), "next-access-field": ("next_access_vtime_field", _COLUMN),
    "obj-id-is-num": ("obj_id_is_num", _FLAG),
    "has-header": ("has_header", _FLAG), "header": ("has_header", _FLAG),
    "delimiter": ("delimiter", _CHAR),
    "format": ("binary_fmt_str", _TEXT),
    "block-size": ("block_size", _COUNT),
}
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")  # libCacheSim's is_true()
NS_PER_S = 1e9  # libCacheSim's clock_time is in seconds
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# libCacheSim's log entries: "[LEVEL] date file:line (tid=N): text", the text possibly over several lines
_LEVELS = "ERROR|WARN|INFO|DEBUG|VERBOSE"
_LOG_ENTRY = re.compile(rf"\[({_LEVELS})\][^\n]*?\(tid=\d+\):(.*?)(?=\[(?:{_LEVELS})\]|\Z)", re.S)
_MAX_WARNINGS = 5


def trace_format(name: str) -> str:
    """The canonical spelling of a libCacheSim format name (matched without regard to case, as cachesim does)."""
    for known in TRACE_FORMATS:
        if known.lower() == name.lower():
            return known
    if name.lower() == "oraclegeneralbin":  # cachesim's other name for it
        return "oracleGeneral"
    raise ValueError(f"{name!r} is not one of mooncake, {', '.join(TRACE_FORMATS)}")


def parse_trace_params(text: str) -> dict[str, Any]:
    """``"time-col=1, obj-id-col=2, delimiter=,"`` -> ReaderInitParam attributes, parsed as libCacheSim's
    cachesim parses its -t option (an empty delimiter value is a comma: ``delimiter=,,``)."""
    out: dict[str, Any] = {}
    rest = text.strip()
    while rest:
        item, sep, rest = rest.partition("=")
        key = item.strip().lower().replace("_", "-")
        if not sep or not key:
            raise ValueError(f"{item.strip()!r} is not KEY=VALUE (e.g. 'time-col=1,obj-id-col=2')")
        if key not in TRACE_PARAMS:
            raise ValueError(f"{key!r} is not one of libCacheSim's trace parameters: "
                             f"{', '.join(TRACE_PARAMS)}")
        attr, kind = TRACE_PARAMS[key]
        if kind == _CHAR and rest.startswith(","):  # a comma delimiter, written "delimiter=,," as cachesim reads it
            value, rest = ",", rest[1:]
        else:
            value, _, rest = rest.partition(",")
        rest = rest.lstrip(" ,")
        out[attr] = _param_value(key, kind, value if kind == _CHAR else value.strip())
        if kind == _FLAG:
            out[attr + "_set"] = True
    return out


def _param_value(key: str, kind: str, value: str) -> Any:
    if kind in (_COLUMN, _COUNT):
        try:
            number = int(value, 0)
        except ValueError:
            number = None
        if number is None or number < 1:
            what = "a column number (counted from 1)" if kind == _COLUMN else "an integer"
            raise ValueError(f"{key} = {value!r} must be {what} >= 1")
        return number
    if kind == _FLAG:
        if value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"{key} = {value!r} must be one of {', '.join(_TRUE + _FALSE)}")
    if kind == _CHAR:
        if value.strip() in ("\\", "\\,"):
            return ","
        if value.strip() == "\\t":
            return "\t"
        if len(value) != 1 and len(value.strip()) == 1:  # spaces around it, as in "delimiter=; , ..."
            value = value.strip()
        if len(value) != 1:  # empty, too: no guessing a comma
            raise ValueError(f"delimiter = {value!r} must be one character (a comma: delimiter=,, ; a tab: \\t)")
        return value
    if not value:
        raise ValueError(f"{key} = '' must not be empty")
    return value


def _integer(text: str) -> int | None:
    """``text`` as the C library's strtoll reads it whole (decimal, else 0x / 0o / 0b), or None."""
    for base in (10, 0):
        try:
            return int(text.strip(), base)
        except ValueError:
            pass
    return None


def _number(text: str) -> float | None:
    value = _integer(text)
    if value is not None:
        return value
    try:
        return float(text)
    except ValueError:
        return None


_CSV_COLUMNS = {attr: key for key, (attr, kind) in reversed(TRACE_PARAMS.items()) if kind == _COLUMN}  # -> "x-col"


def check_csv(path: Path, params: Mapping[str, Any], requests: int, ignore_obj_size: bool = False) -> None:
    """The csv trace's first ``requests`` rows hold every column ``params`` name, and its time, size and numeric
    object id columns hold numbers libCacheSim reads as written: where they do not, its reader quietly reads 0
    or 1 (a column past the row's end, ``1e30`` as a size, ``x`` as a time). ValueError naming the line."""
    columns = {attr: params[attr] for attr in _CSV_COLUMNS if params.get(attr)}
    if not columns:
        return
    need = max(columns.values())
    checks = [("time_field", "clock_time", lambda v: (x := _number(v)) is not None and 0 <= x < 2 ** 63,
               "a number in [0, 2^63) (seconds)")]
    if not ignore_obj_size:
        checks.append(("obj_size_field", "obj_size", lambda v: (x := _integer(v)) is not None and 0 <= x < 2 ** 63,
                       "an integer in [0, 2^63)"))
    with path.open(newline="", errors="replace") as f:
        reader = csv.reader(f, delimiter=params.get("delimiter", ","))
        rows = ((reader.line_num, row) for row in reader if row)  # libCacheSim refuses blank lines itself
        try:
            first = next(rows, None)
            if first is None:
                return
            if params.get("has_header_set"):
                header = params.get("has_header")
            else:  # libCacheSim's guess: a first row whose numbers are no numbers is a header
                header = not all(ok(first[1][columns[attr] - 1]) for attr, _, ok, _ in checks
                                 if attr in columns and len(first[1]) >= columns[attr])
            if header:
                if len(first[1]) < need:
                    _short_row(path, first, columns)
                first = next(rows, None)
                if first is None:
                    return
            numeric_id = params.get("obj_id_is_num") if params.get("obj_id_is_num_set") else None
            id_col = columns.get("obj_id_field")
            if numeric_id is None:  # libCacheSim guesses from the first request, as here
                numeric_id = id_col is not None and len(first[1]) >= id_col and _integer(first[1][id_col - 1]) is not None
            if numeric_id and id_col is not None:
                checks.append(("obj_id_field", "obj_id", lambda v: (x := _integer(v)) is not None and 0 <= x < 2 ** 64,
                               "an integer in [0, 2^64) (obj-id-is-num)"))
            for line, row in itertools.islice(itertools.chain([first], rows), requests):
                if len(row) < need:
                    _short_row(path, (line, row), columns)
                for attr, what, ok, allowed in checks:
                    if attr in columns and not ok(row[columns[attr] - 1]):
                        raise ValueError(f"{path}:{line}: {what} = {row[columns[attr] - 1]!r:.60} "
                                         f"({_CSV_COLUMNS[attr]} = {columns[attr]}) must be {allowed}")
        except csv.Error as exc:
            raise ValueError(f"{path}:{reader.line_num}: not a csv line: {exc}") from None


def _short_row(path: Path, line_row: tuple[int, list], columns: Mapping[str, int]) -> None:
    line, row = line_row
    named = ", ".join(f"{_CSV_COLUMNS[a]} = {c}" for a, c in sorted(columns.items(), key=lambda ac: ac[1])
                      if c > len(row))
    raise ValueError(f"{path}:{line}: {len(row)} column{'s' * (len(row) != 1)}, but {named} (columns are counted "
                     f"from 1; libCacheSim would read a missing column as 0)")


_READ_AHEAD = 4  # batches a reader thread decodes ahead of the replay


def _read_ahead(open_reader) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The batches of ``open_reader()`` (a NativeTraceReader), decoded by a thread of their own while the caller
    uses the ones before (the reader's C call lets go of the GIL: the replay's loop and the decoding share the
    machine's cores). Its errors are raised here, in order; leaving early stops it."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(_READ_AHEAD)
    stop = threading.Event()
    end = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)  # wakes to see ``stop`` when the caller has gone
                return True
            except queue.Full:
                pass
        return False

    def decode() -> None:
        try:
            with open_reader() as reader:
                for batch in reader:
                    if not put(batch):
                        return
            put(end)
        except BaseException as exc:  # raised in the caller's thread
            put(exc)

    thread = threading.Thread(target=decode, name="trace-reader", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


class _Checker:
    """The checks of a trace's requests, batch by batch (each batch the requests after the last): the first
    request with a negative time or size, or too many blocks, and the span from the earliest to the latest
    request (check_span), each a ValueError naming the request."""

    def __init__(self, trace: "LibCacheSimTrace"):
        self.trace, self.seen = trace, 0
        self.lo = self.hi = None  # (clock_time, request number) of the earliest and the latest, the first of equals

    def check(self, times: np.ndarray, obj_ids: np.ndarray, sizes: np.ndarray) -> None:
        trace, path, base = self.trace, self.trace.path, self.seen
        too_big = (sizes > 0) & ((sizes - 1) // trace.block_bytes + 1 > MAX_OBJECT_BLOCKS)
        for i in np.flatnonzero((times < 0) | (sizes < 0) | too_big)[:1].tolist():  # the first bad request
            t, size, n = int(times[i]), int(sizes[i]), base + i + 1
            if t < 0:
                raise ValueError(f"{path}: request {n}: clock_time = {t} must be >= 0")
            if size < 0:
                raise ValueError(f"{path}: request {n}: obj_size = {size} must be >= 0")
            raise ValueError(f"{path}: request {n}: obj_size = {size} is {trace._blocks(size)} blocks of "
                             f"{trace.block_bytes} bytes, more than {MAX_OBJECT_BLOCKS}")
        self.seen += len(times)
        if not len(times):
            return
        lo, hi = int(np.argmin(times)), int(np.argmax(times))
        if self.lo is None or times[lo] < self.lo[0]:
            self.lo = (int(times[lo]), base + lo + 1)
        if self.hi is None or times[hi] > self.hi[0]:
            self.hi = (int(times[hi]), base + hi + 1)
        (t_hi, n_hi), (t_lo, n_lo) = self.hi, self.lo
        check_span(path, (t_hi - t_lo) * NS_PER_S * trace.time_scale, f"request {n_hi} (clock_time {t_hi})",
                   f"request {n_lo} (clock_time {t_lo})", trace.time_scale, "s")


@dataclass
class LibCacheSimTrace:
    """A trace libCacheSim reads; every request is its own stream, started at its clock time (open loop)."""

    path: str | Path
    trace_format: str  # a key of TRACE_FORMATS
    block_bytes: int
    trace_params: Mapping[str, Any] = field(default_factory=dict)  # ReaderInitParam attributes (parse_trace_params)
    ignore_obj_size: bool = False
    limit: int | None = None
    time_scale: float = 1.0
    bucket_by: str = "time"
    name: str = field(init=False)  # the format's name
    warnings: list[str] = field(init=False, default_factory=list)  # libCacheSim's warnings while reading

    def __post_init__(self):
        if self.trace_format not in TRACE_FORMATS:
            raise ValueError(f"trace_format = {self.trace_format!r} is not one of {', '.join(TRACE_FORMATS)}")
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes = {self.block_bytes} must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit = {self.limit!r} must be >= 1")
        self.time_scale = check_time_scale(self.time_scale)
        self.name = self.trace_format
        path = Path(self.path)
        if not path.is_file():
            raise ValueError(f"trace file {str(path)!r} does not exist")
        if path.stat().st_size == 0:  # libCacheSim aborts on an empty file; say what is wrong instead
            raise ValueError(f"{path}: no requests in the trace (the file is empty)")
        self._columns: tuple[array, array, array] | None = None  # the whole trace, once read
        self._counted: dict | None = None  # describe()'s counts, from a native replay of the whole trace
        self._native = self._open_native(path)  # the first batch read and checked; False: libCacheSim reads it
        if not self._native:
            self._columns = self._read(path)
            if not self._columns[0]:
                raise ValueError(f"{path}: no requests in the trace (libCacheSim's {self.trace_format} reader "
                                 f"found none)")
            if self.trace_format == "csv":  # what libCacheSim's reader would read as 0 or 1 silently
                check_csv(path, self.trace_params, len(self._columns[0]), self.ignore_obj_size)
            checker = _Checker(self)
            checker.check(*(np.frombuffer(c, t) for c, t in zip(self._columns, (np.int64, np.uint64, np.int64))))

    # ---- reading ------------------------------------------------------------------------------
    def _reader(self):
        from .native_reader import NativeTraceReader

        return NativeTraceReader(self.path, self.trace_format, self.trace_params, self.ignore_obj_size, self.limit)

    def _open_native(self, path: Path) -> bool:
        """Whether the native reader reads the trace (native_reader.py); it checks the first batch. A trace it
        does not read, or one it refuses there, goes to libCacheSim's reader (the module docstring)."""
        from .native_reader import NATIVE_FORMATS

        if self.trace_format not in NATIVE_FORMATS:
            return False
        try:
            with self._reader() as reader:
                batch = reader.read_batch()
        except ValueError:  # NativeUnsupported, or a trace it refuses: libCacheSim's reader says what it reads
            return False
        if not len(batch[0]):
            raise ValueError(f"{path}: no requests in the trace (libCacheSim's {self.trace_format} reader found none)")
        _Checker(self).check(*batch)
        return True

    def _batches(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The trace in batches of (times, obj_ids, sizes) arrays, checked (``_Checker``) as they come: streamed
        from the file by the native reader, else from the columns libCacheSim's reader read."""
        if self._columns is not None:
            times, ids, sizes = (np.frombuffer(c, t) for c, t in zip(self._columns, (np.int64, np.uint64, np.int64)))
            from .native_reader import BATCH

            for i in range(0, len(times), BATCH):
                yield times[i:i + BATCH], ids[i:i + BATCH], sizes[i:i + BATCH]
            return
        checker = _Checker(self)
        for batch in _read_ahead(self._reader):
            checker.check(*batch)
            yield batch

    def _all(self) -> tuple[array, array, array]:
        """The whole trace as three columns (time, object id, size): read once, then kept."""
        if self._columns is None:
            parts = list(self._batches())
            self._columns = tuple(array(code, np.concatenate([p[k] for p in parts]).tobytes())
                                  for k, code in enumerate("qQq"))
        return self._columns

    @property
    def times(self) -> array:
        return self._all()[0]

    @property
    def obj_ids(self) -> array:
        return self._all()[1]

    @property
    def sizes(self) -> array:
        return self._all()[2]

    def native_batches(self, whole: bool = False):
        """The native replay loop's feed (driver.Replay._feed_native): ("objects", (times, obj_ids, sizes, first
        time, ns per clock unit, ignore_obj_size)) batches, each request its own stream from the first request's
        time. Streamed, unless ``whole`` (a trace out of time order: from the columns, timed from their earliest
        request, as ``phases`` times them); a streamed request earlier than the first raises OutOfOrder."""

        ns = NS_PER_S * self.time_scale
        if whole:
            times = np.frombuffer(self._all()[0], np.int64)
            first = int(times.min())
            for batch in self._batches():
                yield "objects", (*batch, first, ns, self.ignore_obj_size)
            return
        first = None
        for batch in self._batches():
            if first is None:
                first = int(batch[0][0])
            if int(batch[0].min()) < first:
                raise OutOfOrder()
            yield "objects", (*batch, first, ns, self.ignore_obj_size)

    def counted(self, requests: int, objects: int, block_references: int) -> None:
        """What a native replay of the whole trace counted (``describe`` then needs no pass of its own)."""
        self._counted = {"requests": requests, "objects": objects, "block_references": block_references}

    def _read(self, path: Path) -> tuple[array, array, array]:
        spec = {"path": str(path), "trace_type": TRACE_FORMATS[self.trace_format], "params": dict(self.trace_params),
                "ignore_obj_size": self.ignore_obj_size, "limit": self.limit}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                          os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-m", "host_runtime.replay._lcs_child", json.dumps(spec)],
                              capture_output=True, env=env)
        stderr = _ANSI.sub("", proc.stderr.decode(errors="replace"))
        logs = [(level, " ".join(text.split())) for level, text in _LOG_ENTRY.findall(stderr)]
        errors = [text for level, text in logs if level == "ERROR"]
        warnings = list(dict.fromkeys(text for level, text in logs if level == "WARN"))
        if len(warnings) > _MAX_WARNINGS:
            warnings[_MAX_WARNINGS:] = [f"... and {len(warnings) - _MAX_WARNINGS} more"]
        self.warnings = warnings
        if proc.returncode != 0:
            if not errors:  # not libCacheSim's own error: the child's last words (a Python exception, a signal)
                tail = [line for line in stderr.splitlines() if line.strip()]
                errors = [tail[-1].strip() if tail else f"exit status {proc.returncode}"]
            raise ValueError(f"{path}: libCacheSim's {self.trace_format} reader failed: {'; '.join(errors)}")
        out = proc.stdout
        (n,) = struct.unpack_from("<Q", out)
        columns, offset = [], 8
        for typecode in ("q", "Q", "q"):
            column = array(typecode)
            column.frombytes(out[offset: offset + n * column.itemsize])
            offset += n * column.itemsize
            columns.append(column)
        return tuple(columns)

    def _blocks(self, size: int) -> int:
        return max(1, -(-size // self.block_bytes))

    def keys_of(self, obj_id: int, size: int) -> list[int]:
        """The object's blocks, each a key of its own."""
        base = obj_id << OBJECT_BLOCK_BITS
        return [base | j for j in range(self._blocks(size))]

    def phases(self) -> Iterator[Phase]:
        # from the first request: epoch-second stamps keep nanosecond resolution
        ns, first = NS_PER_S * self.time_scale, min(self.times)
        yield Phase("trace", [Stream((t - first) * ns, [Request(self.keys_of(o, s))])
                              for t, o, s in zip(self.times, self.obj_ids, self.sizes)])

    def populate_keys(self):
        return ()

    def describe(self) -> dict:
        counts = self._counted
        if counts is None:
            sizes = np.frombuffer(self.sizes, np.int64)
            blocks = np.where(sizes > 0, (sizes - 1) // self.block_bytes + 1, 1)  # _blocks
            counts = {"requests": len(sizes), "objects": int(np.unique(np.frombuffer(self.obj_ids, np.uint64)).size),
                      "block_references": int(np.sum(blocks))}
        return {"trace": str(self.path), "format": self.trace_format, **counts,
                "ignore_obj_size": self.ignore_obj_size, "time_scale": self.time_scale}
