"""DRAM-management policies: what lives in device DRAM, chosen by name from one registry.

A *device policy* (``Policy``) answers the controller's questions: where a page
is, which frame a page is staged or written into (and whom that evicts),
whether a write is admitted, what a completed flush or a released prefetch
does, how much dirty data to flush now. Most policies are a transparent cache
(``CachePolicy``: demand staging, dirty pages written back after
``policy.lru_writeback_delay_ns``) that differ only in *what to evict*: an
``EvictionPolicy``, libCacheSim's op table (``find / insert / evict /
to_evict / remove``), which the frame table asks for victims.

Names come from three places, in this order:

* the modules of this package: each registers its policies with ``register``
  (adding a built-in policy is adding one module here, plus its test);
* families: ``libcachesim:ALGORITHM`` runs any algorithm of the ``libcachesim``
  binding (``emulator/policies/libcachesim.py``);
* plug-ins: the ``chm.policies`` entry points of installed distributions, each
  naming a ``Policy`` or ``EvictionPolicy`` subclass (README, "Write your own
  policy").

API (also for callers outside the emulator, e.g. ``chm replay``):
``available()``, ``policy_class(name)``, ``make_policy(cfg)``,
``name_problem(name)``, ``register(name, cls)``, ``unregister(name)``,
``param(...)`` (a field of a policy's own config section).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import replace
from typing import Any, Callable, NamedTuple, Sequence

from ..config_fields import FIELDS, Field
from ..errors import ConfigError
from ..frame_table import EvictionPolicy, Inserted, Pinned
from .base import Area, CachePolicy, Policy

__all__ = ["ENTRY_POINT_GROUP", "Area", "CachePolicy", "EvictionPolicy", "Inserted", "Pinned", "Policy",
           "available", "make_policy", "name_problem", "param", "policy_class", "register", "register_family",
           "unregister"]

ENTRY_POINT_GROUP = "chm.policies"
FAMILY_SEPARATOR = ":"  # "libcachesim:ARC": a family's prefix, then one of its names
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_-]*")  # a registered name: also the key of its [policy.NAME] section

_registry: dict[str, type[Policy]] = {}


class _Family(NamedTuple):
    names: Callable[[], Sequence[str]]  # the names it offers (ImportError: its library is not installed)
    make: Callable[[str], type[Policy]]  # the policy class for one of them
    why_not: Callable[[str], str | None]  # why a name it knows is not offered, or None


_families: dict[str, _Family] = {}  # by prefix
_builtins_loaded = False


def param(name: str, kind: type, lo: float | None = None, hi: float | None = None, *, default: Any,
          doc: str = "", choices: tuple | None = None) -> Field:
    """A field of a policy's own config section ``[policy.NAME]`` (``register`` fills in NAME).

    ``default`` is required: a profile need not give a policy's section."""
    return Field("policy", name, kind, lo, hi, choices=choices, doc=doc, default=default)


def register(name: str, cls: type) -> type[Policy]:
    """Register ``cls`` under ``name``; returns the device policy class.

    ``cls`` is a ``Policy`` subclass, or an ``EvictionPolicy`` subclass, which then runs as a transparent
    DRAM cache (``CachePolicy``) choosing its victims. Its ``config_fields`` (made with ``param``) become
    the section ``[policy.NAME]``, handed to it as ``params``."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"policy name {name!r} must match {NAME_PATTERN.pattern} "
                         f"(a '{FAMILY_SEPARATOR}' is for families such as libcachesim:ARC)")
    if not isinstance(cls, type) or not issubclass(cls, (Policy, EvictionPolicy)):
        raise TypeError(f"policy {name!r}: {cls!r} is neither a Policy nor an EvictionPolicy subclass")
    if name in _POLICY_FIELD_NAMES:
        raise ValueError(f"policy name {name!r} is a field of [policy]; choose another")
    known = _registry.get(name)
    if known is not None:
        if known is cls or getattr(known, "source", None) is cls:
            return known
        raise ValueError(f"policy {name!r} is already registered ({known.__module__}.{known.__qualname__})")
    _registry[name] = _as_policy(name, cls)
    return _registry[name]


def unregister(name: str) -> None:
    """Forget a registered policy (tests; a plug-in is found again through its entry point)."""
    _registry.pop(name, None)


def register_family(prefix: str, names: Callable[[], Sequence[str]], make: Callable[[str], type[Policy]],
                    why_not: Callable[[str], str | None] = lambda name: None) -> None:
    """Names ``PREFIX:NAME`` for every NAME that ``names()`` lists; ``make(NAME)`` gives the policy class;
    ``why_not(NAME)`` explains a name it does not offer."""
    _families[prefix] = _Family(names, make, why_not)


def available() -> tuple[str, ...]:
    """Every policy name ``policy.name`` accepts: built-ins, families' names, installed plug-ins."""
    _load_builtins()
    names = sorted(_registry)
    for prefix, family in _families.items():
        try:
            names += [f"{prefix}{FAMILY_SEPARATOR}{n}" for n in family.names()]
        except ImportError:  # the family's library is not installed: it offers nothing
            pass
    names += [ep.name for ep in _entry_points() if ep.name not in _registry]
    return tuple(dict.fromkeys(names))


def policy_class(name: str) -> type[Policy]:
    """The device policy class registered as ``name``; ConfigError (naming what is available) if none."""
    problem = name_problem(name)
    if problem is not None:
        raise ConfigError(f"policy.name = {name!r} {problem}")
    return _registry[name] if name in _registry else _resolve(name)


def make_policy(cfg) -> Policy:
    """The device policy ``cfg.policy.name``, built for ``cfg``."""
    return policy_class(cfg.policy.name)(cfg)


def name_problem(name: str) -> str | None:
    """None if ``name`` names a policy, else what is wrong (for ``policy.name``'s error message)."""
    if not isinstance(name, str):
        return "must be a string"
    _load_builtins()
    if name in _registry:
        return None
    prefix, sep, member = name.partition(FAMILY_SEPARATOR)
    if sep and prefix in _families:
        family = _families[prefix]
        try:
            members = family.names()
        except ImportError as exc:
            return f"needs the {prefix} package, which cannot be imported ({exc})"
        if member in members:
            return None
        reason = family.why_not(member)
        if reason is not None:
            return f"is not offered: {member} {reason}"
        return f"is not available: {prefix} has no {member!r}; it has {', '.join(members)}"
    plugins = {ep.name: ep for ep in _entry_points()}
    if name in plugins:
        try:
            register(name, plugins[name].load())
        except Exception as exc:  # a broken plug-in: say which and why, whatever it raised
            return (f"is the {ENTRY_POINT_GROUP} entry point {plugins[name].value!r}, which does not load: "
                    f"{type(exc).__name__}: {exc}")
        return None
    families = ", ".join(f"{p}{FAMILY_SEPARATOR}NAME" for p in _families)
    return (f"is not one of {', '.join(sorted(_registry))}"
            + (f", {families}" if families else "")
            + (f", {', '.join(plugins)}" if plugins else "")
            + f" (plug-ins register under the entry point group {ENTRY_POINT_GROUP!r})")


# ---- internals ----------------------------------------------------------------------------------

_POLICY_FIELD_NAMES = frozenset(f.name for f in FIELDS if f.section == "policy")  # a policy name must not clash


def _as_policy(name: str, cls: type) -> type[Policy]:
    """The device policy for ``cls``: itself, or a CachePolicy around an eviction policy; fields get their section."""
    section = f"policy.{name}"
    fields = tuple(replace(f, section=section) for f in getattr(cls, "config_fields", ()))
    for f in fields:
        if f.required:
            raise ValueError(f"policy {name!r}: field {f.key} needs a default (a profile need not give [{section}])")
    if issubclass(cls, Policy):
        if cls.name == name and cls.config_fields == fields:
            return cls
        return type(cls.__name__, (cls,), {"name": name, "config_fields": fields, "__module__": cls.__module__,
                                           "source": cls})
    return type(f"{cls.__name__}Cache", (CachePolicy,), {
        "name": name, "eviction": cls, "config_fields": fields, "__module__": cls.__module__,
        "__doc__": cls.__doc__, "source": cls})


def _resolve(name: str) -> type[Policy]:
    prefix, _, member = name.partition(FAMILY_SEPARATOR)
    return _families[prefix].make(member)


def _entry_points():
    import importlib.metadata  # here, not at the top: ~20 ms of start-up that only a plug-in name needs

    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)  # looked up at call time: tests patch it


def _load_builtins() -> None:
    """Import every module of this package once: each registers its policies."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
