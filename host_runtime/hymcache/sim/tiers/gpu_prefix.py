"""``gpu-prefix``: vLLM's prefix cache only, nothing remote (the interface's own behaviour)."""

from __future__ import annotations

from .base import RemoteTier


class GpuPrefixTier(RemoteTier):
    name = "gpu-prefix"
