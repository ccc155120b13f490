"""The prefetch engine: explicit staging of objects, issue -> wait -> release.

Reference model for ``rtl_model/chm_prefetch_engine``. The engine accounts a
bounded window of staging pages and a bounded number of handles; it issues an
object's page fetches in address order, accepts their arrivals in any order,
and reports the object ready once every page has arrived. The frames
themselves come from the frame table (the emulator) or a free list (the RTL).

The accounting is the native core's (``chm_pf_*`` in
``emulator/native/prefetch.c``); this module wraps it.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Iterator

from .errors import ChmError
from .native import ffi, lib


class Staging:
    """One prefetched object: while held, ``arrived`` follows the engine; once released, it stays as it was."""

    __slots__ = ("handle", "first_page", "pages", "_arrived", "_engine")

    def __init__(self, handle: int, first_page: int, pages: int, arrived: int = 0, engine: PrefetchEngine | None = None):
        self.handle, self.first_page, self.pages = handle, first_page, pages
        self._arrived, self._engine = arrived, engine

    @property
    def arrived(self) -> int:
        return self._arrived if self._engine is None else self._engine._object(self.handle).arrived

    @property
    def ready(self) -> bool:
        return self.arrived == self.pages

    def _freeze(self, arrived: int) -> None:
        self._arrived, self._engine = arrived, None

    def __eq__(self, other) -> bool:
        if not isinstance(other, Staging):
            return NotImplemented
        return (self.handle, self.first_page, self.pages, self.arrived) == \
            (other.handle, other.first_page, other.pages, other.arrived)

    def __repr__(self) -> str:
        return (f"Staging(handle={self.handle}, first_page={self.first_page}, pages={self.pages}, "
                f"arrived={self.arrived})")


class _HeldObjects(Mapping):
    """``PrefetchEngine.objects``: handle -> Staging for the objects held, in issue order."""

    def __init__(self, engine: PrefetchEngine):
        self._engine = engine

    def __getitem__(self, handle: int) -> Staging:
        try:
            return self._engine.get(handle)
        except ChmError:
            raise KeyError(handle) from None

    def __iter__(self) -> Iterator[int]:
        c = self._engine._c
        n = lib.chm_pf_objects(c)
        handles = ffi.new("int64_t[]", max(n, 1))
        return iter(handles[0:lib.chm_pf_handles(c, handles, n)])

    def __len__(self) -> int:
        return lib.chm_pf_objects(self._engine._c)

    def __contains__(self, handle) -> bool:
        return isinstance(handle, int) and lib.chm_pf_get(self._engine._c, handle, self._engine._obj) == lib.CHM_OK


class PrefetchEngine:
    def __init__(self, window_pages: int, max_handles: int):
        self.window_pages, self.max_handles = window_pages, max_handles
        out = ffi.new("struct chm_pf **")
        rc = lib.chm_pf_new(window_pages, max_handles, out)
        if rc:
            raise MemoryError("prefetch engine") if rc == lib.CHM_E_NOMEM else \
                ValueError(f"max_handles={max_handles} is too many")
        self._c = ffi.gc(out[0], lib.chm_pf_free)
        self._obj = ffi.new("struct chm_pf_object *")
        self._fetch_handle, self._fetch_page = ffi.new("int64_t *"), ffi.new("uint64_t *")
        self._arrived = ffi.new("uint64_t *")
        self._views: dict[int, Staging] = {}  # what get() handed out, fixed by release()
        self.objects = _HeldObjects(self)

    @property
    def pages_held(self) -> int:
        return lib.chm_pf_pages_held(self._c)

    def issue(self, handle: int, first_page: int, pages: int) -> None:
        """Accept a prefetch of ``pages`` pages from ``first_page`` under ``handle``."""
        rc = lib.chm_pf_issue(self._c, handle, first_page, pages)
        if rc == lib.CHM_OK:
            return
        if rc == lib.CHM_PF_HANDLE_IN_USE:
            raise ChmError(errno.EINVAL, f"prefetch handle {handle} is already in use")
        if rc == lib.CHM_PF_NEVER_FITS:
            raise ChmError(errno.EINVAL, f"object of {pages} pages can never fit the prefetch window of {self.window_pages} pages")
        if rc == lib.CHM_PF_NO_HANDLE:
            raise ChmError(errno.EBUSY, f"the device's prefetch handles are all in use: {len(self.objects)} of "
                                        f"{self.max_handles} handles outstanding (policy.prefetch_max_handles)")
        if rc == lib.CHM_PF_WINDOW_FULL:
            raise ChmError(errno.EBUSY, f"the device's prefetch window is full: {self.pages_held} of "
                                        f"{self.window_pages} pages held, {pages} more requested "
                                        f"(policy.prefetch_window_bytes)")
        if rc == lib.CHM_E_NOMEM:
            raise MemoryError(f"prefetch handle {handle}")
        raise ValueError(f"prefetch of {pages} pages from page {first_page}: past the last page number")

    def next_fetch(self) -> tuple[int, int] | None:
        """The next page fetch to send to the SSD side, in issue order."""
        if lib.chm_pf_next_fetch(self._c, self._fetch_handle, self._fetch_page):
            return self._fetch_handle[0], self._fetch_page[0]
        return None

    def arrived(self, handle: int) -> bool:
        """One page of ``handle`` has arrived; True when the object became ready."""
        rc = lib.chm_pf_arrived(self._c, handle, self._arrived)
        if rc == lib.CHM_PF_UNKNOWN_HANDLE:
            raise KeyError(handle)
        if rc == lib.CHM_PF_TOO_MANY_ARRIVALS:
            raise AssertionError(f"handle {handle}: more arrivals than pages")
        return bool(rc)

    def arrive_all(self, handle: int) -> None:
        """Every page of ``handle`` not yet arrived arrives (``arrived`` until the object is ready)."""
        obj = self._object(handle)
        if obj.arrived < obj.pages:
            c, arrived = self._c, self._arrived
            while (rc := lib.chm_pf_arrived(c, handle, arrived)) == 0:
                pass
            if rc != 1:
                raise AssertionError(f"handle {handle}: arrivals failed ({rc})")

    def _object(self, handle: int):
        """The engine's record of a held object (``struct chm_pf_object``)."""
        if lib.chm_pf_get(self._c, handle, self._obj) != lib.CHM_OK:
            raise ChmError(errno.EINVAL, f"unknown or released prefetch handle {handle}")
        return self._obj

    def get(self, handle: int) -> Staging:
        view = self._views.get(handle)
        if view is None:
            obj = self._object(handle)
            view = self._views[handle] = Staging(handle, obj.first_page, obj.pages, engine=self)
        return view

    def release(self, handle: int) -> Staging:
        obj = self._object(handle)
        view = self._views.pop(handle, None) or Staging(handle, obj.first_page, obj.pages)
        view._freeze(obj.arrived)
        lib.chm_pf_release(self._c, handle, self._obj)
        return view
