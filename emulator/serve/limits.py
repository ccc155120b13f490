"""Limits of ``chm serve`` that its command line and its server both apply (a leaf: imports nothing)."""

DEFAULT_MAX_BAD_ENTRIES = 64  # malformed entries (or corrupted sq tails) of one client before it is detached
MAX_BAD_ENTRIES_LIMIT = 1 << 32  # 0 never detaches
DEFAULT_MAP_LEASE_MS = 100.0  # chm_mmap: a lease not acked within this expires (its client is slow or stalled)
MAP_LEASE_MS_RANGE = (1.0, 60_000.0)
DEFAULT_MAP_MAX_EXPIRED = 4  # chm_mmap: a client whose leases expired this many times is cut off (-EPERM)
MAP_MAX_EXPIRED_RANGE = (1, 1 << 20)
