"""The replay's variants (the device policy each runs, prefetch on or off), their profiles and their labels."""

from __future__ import annotations

from typing import Any, Mapping

from emulator.config import Config, load_profile

# variant -> (device policy, prefetch on)
VARIANTS: dict[str, tuple[str, bool]] = {
    "lru": ("lru", False),
    "hymcache": ("hymcache", True),
    "hymcache-noprefetch": ("hymcache", False),
}


def replay_config(profile: str, variant: str, overrides: Mapping[str, Any] | None = None,
                  device_policy: str | None = None) -> Config:
    """The profile with data off and the device DRAM policy set: ``device_policy`` if given, else the one
    ``overrides`` name (``policy.name``), else the variant's default."""
    if variant not in VARIANTS:
        raise ValueError(f"policy = {variant!r} is not one of {', '.join(VARIANTS)}")
    changes = {"emulation.data": False, "policy.name": VARIANTS[variant][0], **(overrides or {})}
    if device_policy is not None:
        changes["policy.name"] = device_policy
    return load_profile(profile).with_overrides(changes)


def replay_label(variant: str, device_policy: str) -> str:
    """How a run is named in tables and plots: the variant, plus the device policy when it is not the variant's own."""
    return variant if device_policy == VARIANTS[variant][0] else f"{variant} on {device_policy}"
