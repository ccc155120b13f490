"""``recompute``: no reuse at all, GPU prefix caching off."""

from __future__ import annotations

from .base import RemoteTier


class RecomputeTier(RemoteTier):
    name = "recompute"
    gpu_prefix_caching = False
