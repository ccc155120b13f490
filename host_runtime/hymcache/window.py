"""The KV Manager's per-request prefetch window: how many blocks one request keeps staged. A module of its own
so that the replay (which models the same rule) imports it without the Manager's ZeroMQ and libchm."""

from __future__ import annotations

WINDOW_BYTES = 128 << 20       # the paper's ~128 MB of KV per request
MIN_WINDOW_BLOCKS = 2          # double buffering, whatever the block size


def window_blocks(window_bytes: int, block_bytes: int) -> int:
    """Blocks one request keeps staged (prefetched ahead of consumption): the window's worth of blocks,
    never fewer than MIN_WINDOW_BLOCKS. The replayer and the serving simulation use the same rule."""
    return max(MIN_WINDOW_BLOCKS, window_bytes // block_bytes)
