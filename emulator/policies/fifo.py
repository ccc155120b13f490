"""``fifo``: a transparent cache evicting in arrival order (libCacheSim's FIFO)."""

from __future__ import annotations

from ..frame_table import NativeOrder, QueueView
from . import register


class FifoOrder(NativeOrder):
    """First in, first out: a hit changes nothing. Pinned pages are skipped where they stand (they keep
    their place, and go first once unpinned). Runs in the native core (``CHM_POLICY_FIFO``,
    emulator/native/policy_fifo.c)."""

    native_name = "fifo"

    @property
    def order(self) -> QueueView:
        """The pages, oldest first."""
        return QueueView(self)


register("fifo", FifoOrder)
