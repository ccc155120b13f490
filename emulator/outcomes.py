"""What the controller's commands answer (their outcomes), and the errors they raise by name."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import NamedTuple

from .errors import ChmError, WriteBufferFull

_tuple_new = tuple.__new__  # an outcome made without NamedTuple.__new__'s Python frame: the hot path makes one per call


def _all_pinned(what: str, page: int) -> ChmError:
    return ChmError(errno.EBUSY, f"no DRAM frame can be evicted to {what} page {page}: all are pinned")


def _write_too_big(addr: int, length: int, new_pages: int, buffer_pages: int) -> ChmError:
    return ChmError(errno.EINVAL, f"write of {length} bytes at {addr} spans {new_pages} pages, more than the whole "
                                  f"write buffer ({buffer_pages} pages): split it")


def _write_refused(addr: int, length: int, new_pages: int) -> WriteBufferFull:
    return WriteBufferFull(f"write of {length} bytes at {addr} needs {new_pages} write-buffer pages; the buffer has "
                           f"no room until a flush completes", new_pages=new_pages)


class ReadOutcome(NamedTuple):
    """What a read did: when its last byte reached the host, and its pages by how DRAM held them (the
    ``page_hits``, ``page_misses`` and ``merged_misses`` it counted). A read served by the native hit path
    is all hits: it serves only pages resident and ready."""

    finish: float
    hit_pages: int  # resident and ready
    missed_pages: int  # staged from the media by this read
    merged_pages: int  # resident but still being staged (by an earlier read or prefetch): waited for


class WriteOutcome(NamedTuple):
    """What an accepted write did: when it finished, its pages by whether the write path already had a
    frame for them, and the write buffer's pages in use after it (0 for a policy without one)."""

    finish: float
    new_pages: int  # needed a new frame (admitted into the write buffer, for a policy with one)
    overwritten_pages: int  # already had a frame on the write path
    write_buffer_pages: int


class PrefetchOutcome(NamedTuple):
    """What an accepted prefetch did: its handle, when the host learns it, its pages by whether it staged
    them (``prefetch_staged_pages``) or found them resident (``prefetch_resident_pages``), and the pages
    the device's prefetch window holds after it (``snapshot()["prefetch_pages_held"]``)."""

    handle: int
    ack: float
    staged_pages: int
    resident_pages: int
    window_pages_held: int


class SequentialOutcome(NamedTuple):
    """What ``run_sequential`` did: when the last operation finished, the pages its writes needed a new frame
    for (their ``WriteOutcome.new_pages``, summed: with the reads' ``page_misses``, the cache misses), and
    how many of the operations the native path ran (the others went through read, write and flush)."""

    finish: float
    write_misses: int
    native_ops: int


class UnflushedData(ChmError):
    """close() gave up draining: ``pages`` pages (``nbytes`` bytes) acknowledged but never flushed are lost;
    ``error`` is the media error that kept them off the media."""

    def __init__(self, pages: int, nbytes: int, error: ChmError):
        super().__init__(error.errno, f"{pages} pages ({nbytes} bytes) of acknowledged writes were left unflushed "
                                      f"(lost): {error.message}")
        self.pages, self.nbytes, self.error = pages, nbytes, error


@dataclass
class Staged:
    """What the controller keeps per prefetch handle (the engine keeps the window)."""

    frames: list[int]  # pinned read frames, in page order
    ready_at: float
