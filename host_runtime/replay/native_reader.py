"""Traces in libCacheSim's csv, txt, oracleGeneral and lcs formats, read by a native reader of ours
(``native/trace_reader.{h,c}``, built by ``native_build.py``), in batches of numpy arrays, streaming:
no Python object per request, memory bounded by one batch and the reader's 1 MiB buffer, not by the trace.

libCacheSim's Python binding gives no batched access to its reader from C (its wheel ships no headers), so this
is a reader of the same formats, request for request the same as libCacheSim 0.3.5's through the binding
(``tests/host_runtime/test_native_reader.py`` pins the two on every format in ``NATIVE_FORMATS``):
``clock_time`` as libCacheSim reports it (csv: the time column read as ``(int64_t)strtod``, not shifted to the
first request; binary: the record's uint32), object ids as numbers (``obj-id-is-num``, the binding's default) or,
in a csv with ``obj-id-is-num=false``, the XXH3 hash of the field as libCacheSim makes them, size-0 requests
skipped and ``limit`` as libCacheSim's ``cap_at_n_req`` (1 is no cap).

Where libCacheSim reads a request that is not in the file (a blank csv line, a missing column, a field that is no
number, a truncated record) or aborts, this reader raises ValueError naming the file, the line or record, the
field and the value. What libCacheSim reads and this reader does not (txt ids that are not numbers, ``cnt-col``,
zstd files, ``obj_id_is_num`` false without ``obj_id_is_num_set``, where libCacheSim counts numeric-looking ids and
aborts) raises :class:`NativeUnsupported`, a ValueError: use libcachesim's reader for those.

    reader = NativeTraceReader("trace.csv", "csv", parse_trace_params("time-col=1,obj-id-col=2,obj-size-col=3"))
    for times, obj_ids, sizes in reader:   # int64, uint64, int64 arrays, up to ``batch`` requests each
        ...
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from .native_build import TRACE_READER

_module = TRACE_READER.load()
ffi, lib = _module.ffi, _module.lib

NATIVE_FORMATS: dict[str, int] = {"csv": lib.TR_CSV, "txt": lib.TR_TXT, "oracleGeneral": lib.TR_ORACLE_GENERAL,
                                  "lcs": lib.TR_LCS}
BATCH = 1 << 16

# ReaderInitParam attributes (lcs_trace.parse_trace_params) that do not change a request's time, id or size
_NO_EFFECT = {"op_field", "ttl_field", "tenant_field", "next_access_vtime_field", "block_size", "binary_fmt_str",
              "has_header_set", "obj_id_is_num_set"}
_COLUMNS = {"time_field": "time_col", "obj_id_field": "obj_id_col", "obj_size_field": "obj_size_col",
            "cnt_field": "cnt_col"}
_KNOWN = _NO_EFFECT | set(_COLUMNS) | {"delimiter", "has_header", "obj_id_is_num", "ignore_size_zero_req"}


class NativeUnsupported(ValueError):
    """libCacheSim reads the trace, this reader does not (txt ids that are not numbers, cnt-col, zstd): use
    libcachesim's reader."""


def _params(trace_format: str, params: Mapping[str, Any], ignore_obj_size: bool, limit: int | None):
    if trace_format not in NATIVE_FORMATS:
        raise NativeUnsupported(f"trace_format = {trace_format!r} is not one the native reader reads "
                                f"({', '.join(NATIVE_FORMATS)})")
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise NativeUnsupported(f"trace parameter{'s' * (len(unknown) > 1)} {', '.join(unknown)}: not read by the "
                                f"native reader")
    p = ffi.new("tr_params *")
    p.format = NATIVE_FORMATS[trace_format]
    for attr, field in _COLUMNS.items():
        setattr(p, field, int(params.get(attr) or 0))
    delimiter = params.get("delimiter", ",")
    if not isinstance(delimiter, str) or len(delimiter.encode("latin-1", "replace")) != 1:
        raise ValueError(f"delimiter = {delimiter!r} must be one character")
    p.delimiter = delimiter.encode("latin-1")[0]
    p.has_header = int(bool(params["has_header"])) if params.get("has_header_set") else -1  # -1: guess
    p.obj_id_is_num = int(bool(params.get("obj_id_is_num", True)))
    if not p.obj_id_is_num and not params.get("obj_id_is_num_set"):
        raise NativeUnsupported("obj_id_is_num = False without obj_id_is_num_set: libCacheSim then counts the ids "
                                "that look numeric and aborts past 20,000 requests if 99% do")
    p.ignore_obj_size = int(bool(ignore_obj_size))
    p.ignore_size_zero_req = int(bool(params.get("ignore_size_zero_req", True)))
    p.cap_at_n_req = -1 if limit is None else int(limit)
    return p


def xxh3_64(data: bytes) -> int:
    """XXH3_64bits(data): the id libCacheSim gives a csv object id that is not a number."""
    return lib.tr_xxh3_64(data, len(data))


def _raise(reader) -> None:
    status = lib.tr_status(reader)
    message = ffi.string(lib.tr_message(reader)).decode(errors="replace")
    if status == lib.TR_E_UNSUPPORTED:
        raise NativeUnsupported(message)
    if status == lib.TR_E_NOMEM:
        raise MemoryError(message)
    raise ValueError(message)


class NativeTraceReader:
    """A trace in one of ``NATIVE_FORMATS``, read in batches: iterate for ``(times int64, obj_ids uint64,
    sizes int64)`` numpy arrays of up to ``batch`` requests each (each batch its own arrays).

    ``params``: ReaderInitParam attributes, as ``lcs_trace.parse_trace_params`` returns them (``time_field``,
    ``obj_id_field``, ``obj_size_field``, ``delimiter``, ``has_header`` + ``has_header_set``, ``obj_id_is_num``;
    ``op_field``, ``ttl_field``, ``tenant_field``, ``block_size`` are accepted and change nothing here).
    ``ignore_obj_size``: every size is 1. ``limit``: libCacheSim's ``cap_at_n_req`` (at most that many requests;
    None or 1: all)."""

    def __init__(self, path: str | os.PathLike, trace_format: str, params: Mapping[str, Any] | None = None,
                 ignore_obj_size: bool = False, limit: int | None = None, batch: int = BATCH):
        if batch < 1:
            raise ValueError(f"batch = {batch} must be >= 1")
        self.path, self.trace_format, self.batch = Path(path), trace_format, batch
        p = _params(trace_format, dict(params or {}), ignore_obj_size, limit)
        reader = lib.tr_open(os.fsencode(self.path), p)
        if reader == ffi.NULL:
            raise MemoryError(f"{self.path}: out of memory")
        self._reader = ffi.gc(reader, lib.tr_close)
        if lib.tr_status(reader) != lib.TR_OK:
            _raise(reader)

    def read_batch(self, max_requests: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next up to ``max_requests`` (default ``batch``) requests; empty arrays at the end."""
        n = self.batch if max_requests is None else max_requests
        if self._reader is None:
            raise ValueError(f"{self.path}: the reader is closed")
        times, obj_ids, sizes = np.empty(n, np.int64), np.empty(n, np.uint64), np.empty(n, np.int64)
        got = lib.tr_next_batch(self._reader, ffi.from_buffer("int64_t[]", times),
                                ffi.from_buffer("uint64_t[]", obj_ids), ffi.from_buffer("int64_t[]", sizes), n)
        if got < 0:
            _raise(self._reader)
        return (times, obj_ids, sizes) if got == n else (times[:got], obj_ids[:got], sizes[:got])

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        while True:
            batch = self.read_batch()
            if not len(batch[0]):
                return
            yield batch

    def read_all(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every request left, as three arrays (for small traces and tests: this holds the whole trace)."""
        parts = list(self)
        if not parts:
            return np.empty(0, np.int64), np.empty(0, np.uint64), np.empty(0, np.int64)
        return tuple(np.concatenate(column) for column in zip(*parts))

    def reset(self) -> None:
        """Back to the first request."""
        if lib.tr_reset(self._reader) != lib.TR_OK:
            _raise(self._reader)

    @property
    def requests(self) -> int:
        """Requests returned since open or reset."""
        return lib.tr_requests(self._reader)

    def close(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            ffi.gc(reader, None)  # detaches the destructor (it returns None, not the pointer)
            lib.tr_close(reader)

    def __enter__(self) -> "NativeTraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
