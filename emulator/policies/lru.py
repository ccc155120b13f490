"""``lru``: the stock transparent cache (CMM-H), least recently used first.

The eviction policy is the frame table's own reference, ``LruOrder`` (the RTL's
``chm_frame_table`` implements it; both run in the native core): pinned pages
are skipped where they stand.
"""

from ..frame_table import LruOrder
from . import register

register("lru", LruOrder)
