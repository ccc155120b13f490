"""The prefetch engine: explicit staging of objects, issue -> wait -> release.

Reference model for ``rtl_model/chm_prefetch_engine``. The engine accounts a
bounded window of staging pages and a bounded number of handles; it issues an
object's page fetches in address order, accepts their arrivals in any order,
and reports the object ready once every page has arrived. The frames
themselves come from the frame table (the emulator) or a free list (the RTL).
"""

from __future__ import annotations

import errno
from collections import deque
from dataclasses import dataclass

from .errors import ChmError


@dataclass
class Staging:
    handle: int
    first_page: int
    pages: int
    arrived: int = 0

    @property
    def ready(self) -> bool:
        return self.arrived == self.pages


class PrefetchEngine:
    def __init__(self, window_pages: int, max_handles: int):
        self.window_pages, self.max_handles = window_pages, max_handles
        self.objects: dict[int, Staging] = {}
        self.pages_held = 0
        self.fetch_queue: deque[tuple[int, int]] = deque()  # (handle, page) in issue order

    def issue(self, handle: int, first_page: int, pages: int) -> None:
        """Accept a prefetch of ``pages`` pages from ``first_page`` under ``handle``."""
        if handle in self.objects:
            raise ChmError(errno.EINVAL, f"prefetch handle {handle} is already in use")
        if pages > self.window_pages:
            raise ChmError(errno.EINVAL, f"object of {pages} pages can never fit the prefetch window of {self.window_pages} pages")
        if len(self.objects) >= self.max_handles:
            raise ChmError(errno.EBUSY, f"the device's prefetch handles are all in use: {len(self.objects)} of "
                                        f"{self.max_handles} handles outstanding (policy.prefetch_max_handles)")
        if self.pages_held + pages > self.window_pages:
            raise ChmError(errno.EBUSY, f"the device's prefetch window is full: {self.pages_held} of "
                                        f"{self.window_pages} pages held, {pages} more requested "
                                        f"(policy.prefetch_window_bytes)")
        self.objects[handle] = Staging(handle, first_page, pages)
        self.pages_held += pages
        self.fetch_queue.extend((handle, first_page + i) for i in range(pages))

    def next_fetch(self) -> tuple[int, int] | None:
        """The next page fetch to send to the SSD side, in issue order."""
        return self.fetch_queue.popleft() if self.fetch_queue else None

    def arrived(self, handle: int) -> bool:
        """One page of ``handle`` has arrived; True when the object became ready."""
        obj = self.objects[handle]
        assert obj.arrived < obj.pages, f"handle {handle}: more arrivals than pages"
        obj.arrived += 1
        return obj.ready

    def get(self, handle: int) -> Staging:
        obj = self.objects.get(handle)
        if obj is None:
            raise ChmError(errno.EINVAL, f"unknown or released prefetch handle {handle}")
        return obj

    def release(self, handle: int) -> Staging:
        obj = self.get(handle)
        del self.objects[handle]
        self.pages_held -= obj.pages
        return obj
