"""Limits of ``chm serve`` that its command line and its server both apply (a leaf: imports nothing)."""

DEFAULT_MAX_BAD_ENTRIES = 64  # malformed entries (or corrupted sq tails) of one client before it is detached
MAX_BAD_ENTRIES_LIMIT = 1 << 32  # 0 never detaches
