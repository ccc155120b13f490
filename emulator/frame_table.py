"""The DRAM frame table: which device page lives in which DRAM frame, and the
op table of the eviction policy that chooses victims.

The frame table keeps the bookkeeping (page <-> frame, dirty bits, pin counts,
free ways); *what to evict* is asked of an ``EvictionPolicy`` (one per set),
the small table of operations libCacheSim's caches have (``find``, ``insert``,
``to_evict``, ``evict``, ``remove``). With the default policy, ``LruOrder``,
this class is the reference model that ``rtl_model/chm_frame_table`` is
checked against, so its decisions are fully specified:

* ``frames`` frames in ``sets = frames // ways`` sets of ``ways`` ways
  (``ways == frames``: fully associative). Page ``p`` maps to set
  ``p % sets``; frame index = ``set * ways + way``.
* ``insert`` takes the lowest-numbered free way of the set; if none is free,
  the victim the set's eviction policy chooses among the ways that are not
  pinned (LRU: the least recently used; its page and dirty bit are reported
  as the victim). If every way is pinned it returns None.
* ``lookup`` does not change the eviction order; ``touch`` counts a hit
  (LRU: makes the frame most recently used); ``insert`` tells the policy the
  page arrived (LRU: the new frame is the most recently used).
* ``victim`` (the RTL bench's ``lru_victim``) says which frame ``insert``
  would evict, changing nothing.

One implementation, native: the table and the built-in policies (``LruOrder``
here; fifo, clock, sieve, s3fifo in ``emulator/policies/``, all
``NativeOrder``s) are the C structures of ``emulator/native/`` (frame_table.c, policy_*.c), and
this module wraps them. ``lookup_or_insert`` and ``access_many`` make a whole
access (or a whole sequence of them) one call into C. An eviction policy
written in Python (a plug-in: an ``EvictionPolicy`` that is not a
``NativeOrder``, or a subclass of one that overrides an operation) still
works: the C table keeps the bookkeeping and asks the plug-in for each victim
through this module, which is slower (docs/policies.md, "Write your own policy").
"""

from __future__ import annotations

import copy
import errno
from array import array
from collections.abc import Sequence
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable, Iterator, NamedTuple

from .errors import ChmError
from .native import ffi, lib

Pinned = Callable[[int], bool]  # is this resident page pinned (never a victim)?

NO_PAGE = lib.CHM_NO_PAGE
MAX_FRAMES = 1 << 30  # the page index holds 2 slots per frame in 32-bit slot numbers
_OK, _ALL_PINNED, _NEEDS_VICTIM = lib.CHM_OK, lib.CHM_ALL_PINNED, lib.CHM_NEEDS_VICTIM
# The per-page calls, bound once: a module global is found faster than an attribute of ``lib``.
_lookup, _touch, _insert, _lookup_or_insert = (lib.chm_ft_lookup, lib.chm_ft_touch, lib.chm_ft_insert,
                                               lib.chm_ft_lookup_or_insert)
_pin, _unpin, _mark_dirty = lib.chm_ft_pin, lib.chm_ft_unpin, lib.chm_ft_mark_dirty


class Inserted(NamedTuple):
    frame: int
    victim_page: int | None  # page evicted to make room, or None
    victim_dirty: bool


class Access(NamedTuple):
    """What ``lookup_or_insert`` did: a hit (touched) or a miss (inserted, perhaps evicting)."""
    frame: int
    hit: bool
    victim_page: int | None
    victim_dirty: bool


class AccessCounts(NamedTuple):
    """What ``access_many`` did over a sequence of accesses."""
    hits: int
    misses: int
    evictions: int
    dirty_evictions: int


class EvictionPolicy:
    """What to evict: one set's replacement state, keyed by page (libCacheSim's op table).

    The frame table calls, for a set of ``capacity`` ways:

    * ``find(page, update=True) -> bool``: is ``page`` tracked here; ``update``: count a hit on it
      (the frame table calls ``hit(page)`` for that: ``find`` with ``update``, the answer unused);
    * ``insert(page)``: ``page`` became resident (the set has room for it);
    * ``evict(pinned, incoming) -> page``: choose a victim among the resident pages for which
      ``pinned(page)`` is false, drop it and return it, to make room for ``incoming`` (not
      resident). Called only when the set is full and at least one resident page is not pinned;
    * ``to_evict(pinned) -> page``: the page ``evict`` would return now, changing nothing
      (default: ``evict`` on a copy; override it where that is cheaper);
    * ``remove(page)``: ``page`` left the set without an eviction (invalidated); no ghost entry.

    How pinned pages affect the order is each policy's own choice, documented on the class.
    ``params`` is the policy's own config section ``[policy.NAME]`` (a namespace of the fields in
    ``config_fields``), or None: then ``default_params()``.
    """

    config_fields: tuple = ()  # emulator.policies.param(...) fields of its section [policy.NAME]

    def __init__(self, capacity: int, params: Any = None):
        self.capacity = capacity

    @classmethod
    def default_params(cls) -> SimpleNamespace:
        return SimpleNamespace(**{f.name: f.default for f in cls.config_fields})

    @classmethod
    def capacity_problem(cls, capacity: int, params: Any) -> str | None:
        """None if a set of ``capacity`` ways suits this policy with ``params``, else why not (a profile error)."""
        return None

    def find(self, page: int, update: bool = True) -> bool:
        raise NotImplementedError

    def hit(self, page: int) -> None:
        self.find(page, True)

    def insert(self, page: int) -> None:
        raise NotImplementedError

    def evict(self, pinned: Pinned, incoming: int | None = None) -> int:
        raise NotImplementedError

    def to_evict(self, pinned: Pinned) -> int:
        return copy.deepcopy(self).evict(pinned)

    def remove(self, page: int) -> None:
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """Events worth reporting in the device's stats (e.g. divergences from the reference); default none."""
        return {}


class NativeOrder(EvictionPolicy):
    """An eviction policy of the native core: the one its ``emulator/native/policy_*.c`` registers as
    ``native_name`` (``kind``, its number, is the core's ``chm_policy_kind`` of that name, looked up once).

    In a frame table it is that table's set ``set_index``: the table runs it in C, and this object only
    reads its sizes. On its own (``LruOrder(8)``, or a subclass's inherited operations) it drives a
    private one-set table of ``capacity`` frames, so the op table works as for any policy; ``pinned`` is
    then asked of every resident page per ``evict``/``to_evict`` (slow, as for a plug-in).
    """

    native_name = "external"
    kind: int = lib.CHM_POLICY_EXTERNAL
    OPS = ("find", "hit", "insert", "evict", "to_evict", "remove")  # a subclass overriding one is a plug-in

    def __init__(self, capacity, params=None):
        super().__init__(capacity)
        self.params = self.default_params() if params is None else params
        self._table: FrameTable | None = None
        self.set_index = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "native_name" in cls.__dict__:
            cls.kind = lib.chm_policy_kind(cls.native_name.encode())
            if cls.kind < 0:
                raise ValueError(f"{cls.__name__}: the native core has no policy named {cls.native_name!r}")

    def native_params(self) -> dict[str, Any]:
        """The ``struct chm_policy_params`` fields besides ``kind`` (from ``self.params``)."""
        return {}

    @classmethod
    def runs_natively(cls) -> bool:
        return cls.kind != lib.CHM_POLICY_EXTERNAL and all(getattr(cls, op) is getattr(NativeOrder, op)
                                                            for op in cls.OPS)

    def bind(self, table: FrameTable, set_index: int) -> None:
        """Become the view of ``table``'s set ``set_index`` (the table runs the policy)."""
        self._table, self.set_index = table, set_index

    @property
    def table(self) -> FrameTable:
        if self._table is None:  # on its own: a private one-set table of the native policy this class extends
            native = next(c for c in type(self).__mro__ if issubclass(c, NativeOrder) and c.runs_natively())
            self._table = FrameTable(self.capacity, eviction=lambda ways: native(ways, self.params))
        return self._table

    def native_policy(self):
        """Its ``struct chm_policy_params``."""
        return ffi.new("struct chm_policy_params *", {"kind": self.kind, **self.native_params()})

    def info(self):
        """The sizes the policy derives from its parameters for ``capacity`` ways (``struct chm_policy_info``)."""
        info = ffi.new("struct chm_policy_info *")
        if lib.chm_policy_info(self.capacity, self.native_policy(), info):
            raise ValueError(f"{type(self).__name__} cannot work with {self.capacity} ways and {self.params}")
        return info

    def queue(self, which: int = lib.CHM_QUEUE_MAIN) -> list[int]:
        """The pages of one of the set's queues, oldest (next under the hand) first."""
        t, n = self.table, self.capacity
        out = ffi.new("uint64_t[]", max(n, 1))
        return list(out[0:lib.chm_ft_queue(t._c, self.set_index, which, out, n)])

    # -- the op table, acting on the table's set --
    def find(self, page, update=True):
        t = self.table
        frame = t.lookup(page)
        if frame is None or frame // t.ways != self.set_index:
            return False
        if update:
            t.touch(frame)
        return True

    def hit(self, page):
        self.find(page, True)

    def insert(self, page):
        t = self.table
        if not lib.chm_ft_free_ways(t._c, self.set_index):
            raise RuntimeError(f"{type(self).__name__}.insert({page}): the set is full (evict first)")
        t.insert(page)

    def evict(self, pinned, incoming=None):
        t, out = self.table, self.table._out
        with _PinnedFor(t, self.set_index, pinned):
            rc = lib.chm_ft_evict(t._c, self.set_index, NO_PAGE if incoming is None else incoming, out)
        if rc == _ALL_PINNED:
            raise RuntimeError(f"{type(self).__name__} asked for a victim while every resident page is pinned")
        if rc:
            t._check(rc, "evict", page=incoming)
        return out.victim_page

    def to_evict(self, pinned):
        t = self.table
        with _PinnedFor(t, self.set_index, pinned):
            frame = lib.chm_ft_to_evict(t._c, self.set_index)
        return None if frame < 0 else t.page_of[frame]

    def remove(self, page):
        t = self.table
        frame = t.lookup(page)
        if frame is None:
            raise KeyError(page)
        t.invalidate(frame)


class _PinnedFor:
    """Pins, for one call, the frames of a set whose pages ``pinned`` names (a standalone policy's op table)."""

    def __init__(self, table: FrameTable, set_index: int, pinned: Pinned):
        ways = table.ways
        frames = range(set_index * ways, (set_index + 1) * ways)
        self.table = table
        self.frames = [f for f in frames if (p := table.page_of[f]) is not None and pinned(p)]

    def __enter__(self):
        for frame in self.frames:
            self.table.pin(frame)

    def __exit__(self, *exc):
        for frame in self.frames:
            self.table.unpin(frame)


class LruOrder(NativeOrder):
    """Least recently used. Pinned pages are skipped where they stand: they keep their place in the order."""

    native_name = "lru"

    @property
    def order(self) -> QueueView:
        """The pages, least recently used first."""
        return QueueView(self)


class QueueView:
    """A policy's main queue as the ``OrderedDict`` the Python policies kept (oldest first)."""

    def __init__(self, order: NativeOrder):
        self._order = order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order.queue())

    def __len__(self) -> int:
        return len(self._order.queue())

    def __contains__(self, page) -> bool:
        return self._order.find(page, False)

    def popitem(self, last: bool = True) -> tuple[int, None]:
        pages = self._order.queue()
        if not pages:
            raise KeyError("popitem(): the queue is empty")
        page = pages[-1] if last else pages[0]
        self._order.remove(page)
        return page, None


class _PageColumn(Sequence):
    """``FrameTable.page_of``: each frame's page, or None (a read-only view of the table's array)."""

    __slots__ = ("_pages",)

    def __init__(self, pages: memoryview):
        self._pages = pages

    def __len__(self) -> int:
        return len(self._pages)

    def __getitem__(self, frame: int) -> int | None:
        page = self._pages[frame]
        return None if page == NO_PAGE else page


def _column(owner, pointer, length: int, fmt: str) -> memoryview:
    """A read-only memoryview of a per-frame array ``owner`` holds; the view keeps ``owner`` alive."""
    keep = ffi.gc(pointer, lambda _pointer, owner=owner: None)
    return memoryview(ffi.buffer(keep, length * ffi.sizeof(ffi.typeof(pointer).item))).cast(fmt).toreadonly()


def _as_pages(pages) -> memoryview:
    """``pages`` as 64-bit page numbers in a buffer cffi can pass (converted if need be)."""
    try:
        view = memoryview(pages)
    except TypeError:
        return memoryview(array("Q", pages))
    if view.itemsize == 8 and view.format.lstrip("<=@") in ("Q", "q", "L", "l") and view.c_contiguous:
        return view
    return memoryview(array("Q", view.tolist()))


class FrameTable:
    def __init__(self, frames: int, ways: int | None = None,
                 eviction: Callable[[int], EvictionPolicy] = LruOrder):
        """``eviction(capacity)`` makes one set's eviction policy (default LRU, the RTL's)."""
        ways = frames if ways is None else ways
        if frames < 1 or ways < 1 or frames % ways:
            raise ValueError(f"frames={frames} must be a positive multiple of ways={ways}")
        if frames > MAX_FRAMES:
            raise ValueError(f"frames={frames} is more than a frame table holds ({MAX_FRAMES})")
        self.frames, self.ways, self.sets = frames, ways, frames // ways
        self.orders = [eviction(ways) for _ in range(self.sets)]  # per set: what to evict
        first = self.orders[0]
        native = (isinstance(first, NativeOrder) and type(first).runs_natively()
                  and all(type(o) is type(first) and o.native_params() == first.native_params() for o in self.orders))
        policy = first.native_policy() if native else ffi.new("struct chm_policy_params *",
                                                                  {"kind": lib.CHM_POLICY_EXTERNAL})
        out = ffi.new("struct chm_ft **")
        rc = lib.chm_ft_new(frames, ways, policy, out)
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(f"frame table of {frames} frames")
        if rc:
            raise ValueError(f"{type(first).__name__} cannot work with {ways} ways and {getattr(first, 'params', None)}")
        self._c = ffi.gc(out[0], lib.chm_ft_free)
        self._out = ffi.new("struct chm_access *")
        self.page_of = _PageColumn(_column(self, lib.chm_ft_page_of(self._c), frames, "Q"))
        self.dirty = _column(self, lib.chm_ft_dirty(self._c), frames, "B")
        self.pins = _column(self, lib.chm_ft_pins(self._c), frames, "I")
        self.plugin = not native  # victims chosen by Python policies (the slower path)
        if native:
            for s, order in enumerate(self.orders):
                order.bind(self, s)
        else:
            self._pinned = partial(lib.chm_ft_page_pinned, self._c)  # the plug-ins' pinned(page), in C

    def __len__(self) -> int:
        return lib.chm_ft_resident(self._c)

    def set_of(self, page: int) -> int:
        return page % self.sets

    def free_ways(self, page: int) -> int:
        return lib.chm_ft_free_ways(self._c, page % self.sets)

    def lookup(self, page: int) -> int | None:
        frame = _lookup(self._c, page)
        return None if frame < 0 else frame

    def touch(self, frame: int) -> None:
        rc = _touch(self._c, frame)
        if rc:
            self._check(rc, "touch", frame=frame)
        if self.plugin:
            self.orders[frame // self.ways].hit(self.page_of[frame])

    def insert(self, page: int) -> Inserted | None:
        """Place ``page`` (not present) in its set; None if every way is pinned."""
        if self.plugin:
            return self._insert_for_plugin(page)
        out = self._out
        rc = _insert(self._c, page, out)
        if rc == _OK:
            victim = out.victim_page
            if victim == NO_PAGE:
                return Inserted(out.frame, None, False)
            return Inserted(out.frame, victim, bool(out.victim_dirty))
        if rc == _ALL_PINNED:
            return None
        self._check(rc, "insert", page=page)

    def _insert_for_plugin(self, page: int) -> Inserted | None:
        out, s = self._out, page % self.sets
        order = self.orders[s]
        rc = lib.chm_ft_insert(self._c, page, out)
        if rc == _NEEDS_VICTIM:
            victim_page = order.evict(self._pinned, page)
            frame = self.lookup(victim_page) if isinstance(victim_page, int) and victim_page >= 0 else None
            if frame is None or frame // self.ways != s or self.pins[frame]:  # a plug-in's bug must not lose data
                why = ("not resident" if frame is None else "pinned" if self.pins[frame] else
                       f"in set {frame // self.ways}, not the incoming page's set {s}")
                raise RuntimeError(f"eviction policy {type(order).__name__} chose page {victim_page!r}, which is {why}")
            rc = lib.chm_ft_insert_replacing(self._c, page, frame, out)
        if rc == _ALL_PINNED:
            return None
        if rc:
            self._check(rc, "insert", page=page)
        order.insert(page)
        victim = out.victim_page
        return Inserted(out.frame, None if victim == NO_PAGE else victim, bool(out.victim_dirty))

    def lookup_or_insert(self, page: int) -> Access | None:
        """One access: a hit is touched, a miss inserted (evicting as ``insert``); None if every way is pinned."""
        if self.plugin:
            frame = self.lookup(page)
            if frame is not None:
                self.touch(frame)
                return Access(frame, True, None, False)
            ins = self.insert(page)
            return None if ins is None else Access(ins.frame, False, ins.victim_page, ins.victim_dirty)
        out = self._out
        rc = _lookup_or_insert(self._c, page, out)
        if rc == _OK:
            victim = out.victim_page
            return Access(out.frame, bool(out.hit), None if victim == NO_PAGE else victim, bool(out.victim_dirty))
        if rc == _ALL_PINNED:
            return None
        self._check(rc, "lookup_or_insert", page=page)

    def access_many(self, pages, writes=None, hits=None) -> AccessCounts:
        """``lookup_or_insert`` of each page in turn (one call into C), marking the frame dirty where
        ``writes[i]`` is set; ``hits`` (a writable buffer of ``len(pages)`` bytes) gets 1 per hit.

        ``pages``: a buffer of 64-bit page numbers (``array('Q')``, a numpy array) or any iterable of
        ints. ChmError(EBUSY) at the first access whose set has every way pinned (the accesses before it
        are made)."""
        pages = _as_pages(pages)
        n = len(pages)
        for name, buf in (("writes", writes), ("hits", hits)):
            if buf is not None and memoryview(buf).nbytes != n:
                raise ValueError(f"{name} has {memoryview(buf).nbytes} bytes for {n} pages")
        if self.plugin:
            return self._access_many_for_plugin(pages, writes, hits)
        counts = ffi.new("struct chm_access_counts *")
        rc = lib.chm_ft_access_many(self._c, ffi.from_buffer("uint64_t[]", pages),
                                    ffi.NULL if writes is None else ffi.from_buffer("uint8_t[]", writes), n,
                                    ffi.NULL if hits is None else ffi.from_buffer("uint8_t[]", hits, require_writable=True),
                                    counts)
        if rc == _ALL_PINNED:
            i = counts.accesses
            raise ChmError(errno.EBUSY, f"access #{i} (page {pages[i]}): every way of set {pages[i] % self.sets} "
                                        f"is pinned")
        if rc:
            self._check(rc, "access_many", page=pages[counts.accesses])
        return AccessCounts(counts.hits, counts.misses, counts.evictions, counts.dirty_evictions)

    def _access_many_for_plugin(self, pages, writes, hits) -> AccessCounts:
        n_hits = misses = evictions = dirty_evictions = 0
        for i, page in enumerate(pages):
            access = self.lookup_or_insert(page)
            if access is None:
                raise ChmError(errno.EBUSY, f"access #{i} (page {page}): every way of set {page % self.sets} "
                                            f"is pinned")
            if access.hit:
                n_hits += 1
            else:
                misses += 1
                evictions += access.victim_page is not None
                dirty_evictions += access.victim_dirty
            if writes is not None and writes[i]:
                self.mark_dirty(access.frame)
            if hits is not None:
                hits[i] = access.hit
        return AccessCounts(n_hits, misses, evictions, dirty_evictions)

    def victim(self, page: int) -> int | None:
        """The frame ``insert(page)`` would evict, or None if a way is free or all are pinned."""
        if not self.plugin:
            frame = lib.chm_ft_victim(self._c, page)
            return None if frame < 0 else frame
        s = page % self.sets
        if lib.chm_ft_free_ways(self._c, s) or lib.chm_ft_pinned_ways(self._c, s) == self.ways:
            return None
        return self.lookup(self.orders[s].to_evict(self._pinned))

    lru_victim = victim  # the name the RTL lockstep bench uses (its policy is LRU)

    def invalidate(self, frame: int) -> None:
        page = self.page_of[frame] if self.plugin else None
        rc = lib.chm_ft_invalidate(self._c, frame)
        if rc:
            self._check(rc, "invalidate", frame=frame)
        if self.plugin:
            self.orders[frame // self.ways].remove(page)

    def mark_dirty(self, frame: int) -> None:
        if _mark_dirty(self._c, frame):
            self._check(lib.CHM_E_FRAME, "mark_dirty", frame=frame)

    def clear_dirty(self, frame: int) -> None:
        if lib.chm_ft_clear_dirty(self._c, frame):
            self._check(lib.CHM_E_FRAME, "clear_dirty", frame=frame)

    def pin(self, frame: int) -> None:
        rc = _pin(self._c, frame)
        if rc:
            self._check(rc, "pin", frame=frame)

    def unpin(self, frame: int) -> None:
        rc = _unpin(self._c, frame)
        if rc:
            self._check(rc, "unpin", frame=frame)

    def counters(self) -> dict[str, int]:
        """The eviction policies' event counters, summed over the sets."""
        total: dict[str, int] = {}
        for order in self.orders:
            for key, n in order.counters().items():
                total[key] = total.get(key, 0) + n
        return total

    def check(self) -> None:
        """Raise RuntimeError if one of the native table's invariants does not hold (tests)."""
        line = lib.chm_ft_check(self._c)
        if line:
            raise RuntimeError(f"frame table invariant broken: line {line} of emulator/native/frame_table.c or of "
                               f"the policy's policy_*.c")

    def _check(self, rc: int, what: str, frame: int | None = None, page: int | None = None) -> None:
        """Raise what a native status other than a decision means."""
        where = f"{what}: frame {frame}" if frame is not None else f"{what}: page {page}"
        if rc == lib.CHM_E_FRAME:
            raise IndexError(f"{where} is out of range ({self.frames} frames)")
        if rc == lib.CHM_E_EMPTY:
            raise AssertionError(f"{where} is empty")
        if rc == lib.CHM_E_PINNED:
            raise AssertionError(f"{where} is pinned")
        if rc == lib.CHM_E_NOT_PINNED:
            raise AssertionError(f"{where} is not pinned")
        if rc == lib.CHM_E_PIN_LIMIT:
            raise OverflowError(f"{where} has its pin counter full")
        if rc == lib.CHM_E_RESIDENT:
            raise AssertionError(f"{where} is already in frame {self.lookup(page)}")
        if rc == lib.CHM_E_ARG:
            raise ValueError(f"{where}: not a page number")
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(where)
        self.check()
        raise RuntimeError(f"{where}: native status {rc}")
