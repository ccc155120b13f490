"""The device side of a DRAM policy: its areas of DRAM frames, and the transparent cache.

Frames are global DRAM frame numbers (frame ``f`` is bytes
``[f * page, (f + 1) * page)`` of the DRAM region).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..config_fields import Config, Field
from ..frame_table import EvictionPolicy, FrameTable, Inserted, LruOrder
from ..native import lib


class Area:
    """A contiguous run of DRAM frames managed by one frame table."""

    def __init__(self, base: int, frames: int, eviction: Callable[[int], EvictionPolicy] = LruOrder):
        self.base = base
        self.end = base + frames
        self.table = FrameTable(frames, eviction=eviction)

    def __contains__(self, frame: int) -> bool:
        return self.base <= frame < self.end

    def lookup(self, page: int) -> int | None:
        local = self.table.lookup(page)
        return None if local is None else self.base + local

    def insert(self, page: int) -> Inserted | None:
        ins = self.table.insert(page)
        if ins is None or not self.base:
            return ins
        return ins._replace(frame=self.base + ins.frame)


class Policy:
    """Base of the device policies: one area (all of DRAM) used as a cache; subclasses refine.

    Capabilities the rest of the device asks about instead of comparing names:

    * ``splits_dram``: DRAM is split at deployment into read staging and a write buffer
      (``policy.write_buffer_fraction``); ``Config.write_buffer_frames`` is 0 otherwise;
    * ``drops_staged_on_release``: a released prefetch's pages leave DRAM at once (read once, in order);
    * ``refuses_writes``: a write may be refused (``WriteBufferFull``) until a flush frees room.
    """

    name = "base"
    splits_dram = False
    drops_staged_on_release = False
    refuses_writes = False
    config_fields: tuple[Field, ...] = ()  # its own section [policy.NAME] (emulator.policies.param)
    # Most flushed pages in flight before a background flush waits (None: no bound, flushes queue up on the SSDs).
    flush_pages_in_flight: int | None = None
    write_buffer_pages = 0  # pages of the write buffer in use (a policy with one: a property)

    def __init__(self, cfg: Config, eviction: Callable[[int], EvictionPolicy] = LruOrder):
        self.cfg = cfg
        self.areas: list[Area] = []
        self._area_at: list[Area] = []  # by global frame: the per-page calls find their area in one step
        self.read_area = self.add_area(Area(0, cfg.read_staging_frames, eviction))

    def add_area(self, area: Area) -> Area:
        """Manage ``area`` too; it starts where the last one ends."""
        if area.base != len(self._area_at):
            raise ValueError(f"an area starting at frame {area.base} leaves a gap after frame {len(self._area_at)}")
        self.areas.append(area)
        self._area_at += [area] * (area.end - area.base)
        return area

    # -- what the policy says about itself ---------------------------------------------
    @classmethod
    def params(cls, cfg: Config):
        """Its own section ``cfg.policy.NAME`` (a namespace), or None if it has none."""
        return getattr(cfg.policy, cls.name, None)

    @classmethod
    def describe(cls, cfg: Config) -> str:
        """One line for ``chm info``: the name and the settings that shape it."""
        params = cls.params(cfg)
        if params is None:
            return cls.name
        settings = (f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in vars(params).items())
        return f"{cls.name} ({', '.join(settings)})"

    @classmethod
    def check_config(cls, cfg: Config, need: Callable[[bool, str], None]) -> None:
        """Rules the profile must meet for this policy (``need(ok, message)``); sizes, mostly."""

    def native_lookup_areas(self) -> list[Area] | None:
        """The areas ``lookup`` asks for a page, in its order, when its lookup and touch are the built-in
        ones over native frame tables (then a DRAM-hit read can run in C: ``chm_dev_read_hit``); None when
        either runs in Python (a plug-in's lookup, touch or eviction order). A policy with its own lookup
        over native tables overrides this with ``_native_areas(ItsClass.lookup, its areas)``."""
        return self._native_areas(Policy.lookup, [self.read_area])

    def _native_areas(self, lookup: Callable, areas: list[Area]) -> list[Area] | None:
        """``areas`` if this policy's lookup is ``lookup``, its touch the built-in one, neither rebound
        on the instance but to the read area's table, and no area's eviction order a plug-in; else None."""
        cls = type(self)
        if cls.touch is not Policy.touch or cls.lookup is not lookup:
            return None
        table = self.read_area.table
        for name in ("lookup", "touch"):  # CachePolicy binds the read area's table methods to the instance
            own = vars(self).get(name)
            if own is not None and own != getattr(table, name):
                return None
        return None if any(area.table.plugin for area in areas) else areas

    def counters(self) -> dict[str, int]:
        """Event counters for the device's stats (``policy_counters``), summed over the areas."""
        total: dict[str, int] = {}
        for area in self.areas:
            for key, n in area.table.counters().items():
                total[key] = total.get(key, 0) + n
        return total

    # -- where things are --------------------------------------------------------
    def area_of(self, frame: int) -> Area:
        if not 0 <= frame < len(self._area_at):
            raise ValueError(f"frame {frame} is in no DRAM area (there are {len(self._area_at)} frames)")
        return self._area_at[frame]

    def lookup(self, page: int) -> int | None:
        """The frame holding the page's newest data, if resident."""
        return self.read_area.lookup(page)

    def staged_lookup(self, page: int) -> int | None:
        """The page's frame in the read-staging area, if there."""
        return self.read_area.lookup(page)

    def write_lookup(self, page: int) -> int | None:
        """The page's frame on the write path (a write there needs no new admission), if any."""
        return self.read_area.lookup(page)

    def read_copy(self, page: int) -> int | None:
        """A second (clean, staged) copy that writes must keep current; None if there is none."""
        return None

    def page_of(self, frame: int) -> int | None:
        area = self._area_at[frame]
        return area.table.page_of[frame - area.base]

    def is_dirty(self, frame: int) -> bool:
        area = self._area_at[frame]
        return bool(area.table.dirty[frame - area.base])

    # -- per-frame bookkeeping, forwarded to the owning table -----------------------
    def touch(self, frame: int) -> None:
        area = self._area_at[frame]
        area.table.touch(frame - area.base)

    def pin(self, frame: int) -> None:
        area = self._area_at[frame]
        area.table.pin(frame - area.base)

    def unpin(self, frame: int) -> None:
        area = self._area_at[frame]
        area.table.unpin(frame - area.base)

    def pins(self, frame: int) -> int:
        area = self._area_at[frame]
        return area.table.pins[frame - area.base]

    def mark_dirty(self, frame: int) -> None:
        area = self._area_at[frame]
        area.table.mark_dirty(frame - area.base)

    def drop(self, frame: int) -> None:
        """Let a clean, unpinned frame go (its page is read again from the media next time)."""
        area = self._area_at[frame]
        area.table.invalidate(frame - area.base)

    # -- decisions -------------------------------------------------------------------
    def allocate_clean(self, page: int) -> Inserted | None:
        """A frame to stage a clean page into (may evict; None if all are pinned)."""
        return self.read_area.insert(page)

    def admit_writes(self, new_pages: int) -> bool:
        """May ``new_pages`` pages not yet in the write path be written now?"""
        return True

    def allocate_write(self, page: int) -> Inserted | None:
        return self.allocate_clean(page)

    def flushed(self, frame: int) -> None:
        """A flush of ``frame`` completed and nothing rewrote it meanwhile."""
        area = self._area_at[frame]
        area.table.clear_dirty(frame - area.base)

    def released(self, frame: int) -> None:
        """A prefetch handle let go of ``frame``."""

    def flush_grant(self, dirty: Sequence[tuple[int, float]], now: float, reads_in_flight: int, force: bool) -> int:
        """How many of the queued dirty pages ``dirty`` ((frame, write time), oldest first) to flush now."""
        raise NotImplementedError

    def next_flush_at(self, dirty: Sequence[tuple[int, float]], now: float,
                      reads_idle_at: Callable[[int], float]) -> float | None:
        """When the background flusher next looks, if no page is written, read or flushed meanwhile: the
        earliest virtual time >= ``now`` at which ``flush_grant(dirty, t, reads_in_flight(t), False)`` grants
        pages (a rule that only counts pages dates its grant from when the last page it needs was written);
        None if it never will.

        The device's clock jumps from event to event, so this must be exact: a later time delays the flush,
        and one at which ``flush_grant`` grants nothing is an error (``Controller.run_until`` says so).
        ``reads_idle_at(n)``: the earliest time >= ``now`` with at most ``n`` SSD reads in flight."""
        raise NotImplementedError(f"policy {self.name!r} ({type(self).__name__}) says how many pages to flush "
                                  f"(flush_grant) but not when it next will (next_flush_at)")


class CachePolicy(Policy):
    """A transparent DRAM cache (CMM-H style): demand staging, victims chosen by ``eviction`` (an
    ``EvictionPolicy`` class, given the policy's own section as ``params``), and dirty pages written to
    flash ``policy.lru_writeback_delay_ns`` after the write, whatever the reads are doing."""

    eviction: type[EvictionPolicy] = LruOrder

    @classmethod
    def check_config(cls, cfg, need):
        params = cls.params(cfg) or cls.eviction.default_params()
        problem = cls.eviction.capacity_problem(cfg.read_staging_frames, params)
        need(problem is None, problem)

    def __init__(self, cfg: Config):
        params = self.params(cfg)
        super().__init__(cfg, lambda capacity: self.eviction(capacity, params))
        self._bind_fast_paths()

    def _bind_fast_paths(self) -> None:
        """One area at frame 0: global frames are the table's, so the hot per-page calls go straight to it
        (one Python call per page instead of three). Methods a subclass overrides stay its own."""
        table = self.read_area.table
        for method, target in (("lookup", table.lookup), ("staged_lookup", table.lookup),
                               ("write_lookup", table.lookup), ("touch", table.touch), ("pin", table.pin),
                               ("unpin", table.unpin), ("mark_dirty", table.mark_dirty),
                               ("allocate_clean", table.insert)):
            if getattr(type(self), method) is getattr(CachePolicy, method):
                setattr(self, method, target)

    def page_of(self, frame: int) -> int | None:
        return self.read_area.table.page_of[frame]

    def pins(self, frame: int) -> int:
        return self.read_area.table.pins[frame]

    def flush_grant(self, dirty, now, reads_in_flight, force):
        if force:
            return len(dirty)
        due_before = now - self.cfg.policy.lru_writeback_delay_ns
        n = 0
        for _, since in dirty:
            if since > due_before:
                break
            n += 1
        return n

    def next_flush_at(self, dirty, now, reads_idle_at):
        if not dirty:
            return None
        # flush_grant's own test (oldest <= t - delay), so the deadline is the first time it passes despite float
        # rounding; the native core's definition, which its flusher uses too
        return max(now, lib.chm_delay_due_at(dirty[0][1], self.cfg.policy.lru_writeback_delay_ns))
