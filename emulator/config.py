"""Device profiles: the modelled hardware and the emulator's settings.

A profile is a TOML file with the sections and fields listed in ``FIELDS``
(declared in ``emulator.config_fields``, with the validated profile's type
``Config``), plus each DRAM policy's own section ``[policy.NAME]`` (the fields
its class declares in ``config_fields``; see ``emulator.policies``). Each
section converts into a typed Struct built from its fields (type and range
checked on load); errors name the profile, the field, the value and the
allowed range. Units are in the field names: bytes, nanoseconds, GB/s (1 GB/s
is exactly one byte per nanosecond, which keeps the timing model free of unit
conversions).
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import msgspec

from common.checks import explain

from . import config_fields
from .config_fields import (FAULT_ERRNOS, FAULT_OPS, IO_ALIGN, OPTIONAL_SECTIONS, SECTIONS, Config, Field, GiB, KiB,
                            MiB, TiB, section_type)
from .errors import ConfigError

__all__ = ["FAULT_ERRNOS", "FAULT_OPS", "FIELDS", "FIELDS_BY_KEY", "IO_ALIGN", "OPTIONAL_SECTIONS", "SECTIONS",
           "Config", "ConfigError", "Field", "GiB", "KiB", "MiB", "TiB", "from_dict", "load_profile",
           "parse_field_value", "profile_names"]


def _registry():
    """``emulator.policies``, imported on first use: it loads the native core, which reading a profile's text
    does not need. (The dependency runs one way: the policies import ``emulator.config_fields``.)"""
    from . import policies

    return policies


def _policy_name_problem(name: str) -> str | None:
    return _registry().name_problem(name)


# The declaration's fields, policy.name with its further check: the registry must know the name.
FIELDS: tuple[Field, ...] = tuple(replace(f, validator=_policy_name_problem) if f.key == "policy.name" else f
                                  for f in config_fields.FIELDS)
FIELDS_BY_KEY = {f.key: f for f in FIELDS}
_SECTION_FIELDS = {s: tuple(f for f in FIELDS if f.section == s) for s in SECTIONS}


def _convert(given: Mapping[str, Any], fields: tuple[Field, ...], source: str, unknown: str) -> dict[str, Any]:
    """One section, typed (``section_type``): {name: value} with the defaults filled in, or ConfigError in the
    profiles' wording; ``unknown`` is what follows ``unknown field KEY`` (the fields there are)."""
    by_name = {f.name: f for f in fields}
    try:
        typed = msgspec.convert({k: by_name[k].read(v) if k in by_name else v for k, v in given.items()},
                                section_type(fields), strict=True)
    except msgspec.ValidationError as exc:
        raise _refusal(exc, given, fields, source, unknown) from None
    values = msgspec.structs.asdict(typed)
    for f in fields:
        f.further(values[f.name], source)
    return values


def _refusal(exc: msgspec.ValidationError, data: Mapping[str, Any], fields: tuple[Field, ...], source: str,
             unknown: str) -> ConfigError:
    """msgspec's refusal of a section's ``data`` in the profiles' wording: the field, the value, the range."""
    message = str(exc)
    if message.startswith(("Object contains unknown field `", "Object missing required field `")):
        key = f"{fields[0].section}.{message.split('`')[1]}"
        if message.startswith("Object missing"):
            return ConfigError(f"{source}: missing field {key}")
        return ConfigError(f"{source}: unknown field {key}{unknown}")
    name = message.rpartition(" - at `$.")[2].rstrip("`").split(".")[0].split("[")[0]
    field = next((f for f in fields if f.name == name), None)
    if field is not None and name in data:
        return field.refused(data[name], source)
    return ConfigError(f"{source}: " + explain(exc, data, section_type(fields)))  # no field's value: common wording


def with_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """``cfg`` with ``overrides`` ({``section.field`` or ``policy.NAME.field``: value}), validated anew
    (``Config.with_overrides``)."""
    raw = cfg.as_dict()
    for key, value in overrides.items():
        if key in FIELDS_BY_KEY:
            section, name = key.split(".")
            raw[section][name] = value
            continue
        parts = key.split(".") if isinstance(key, str) else []
        if len(parts) != 3 or parts[0] != "policy":
            raise ConfigError(f"{cfg.source}: unknown field {key!r}; known fields: {', '.join(FIELDS_BY_KEY)} "
                              f"and policy.NAME.FIELD of a policy's own section")
        _, policy, name = parts
        if name not in {f.name for f in _policy_fields(policy, cfg.source)}:
            raise ConfigError(f"{cfg.source}: unknown field {key!r}; {_known_policy_fields(policy)}")
        section = raw["policy"].setdefault(policy, {})
        section[name] = value
    return from_dict(raw, source=f"{cfg.source}+overrides")


def _policy_fields(policy: str, source: str) -> tuple[Field, ...]:
    """The fields of policy ``policy``'s own section (``[policy.NAME]``)."""
    problem = _registry().name_problem(policy)
    if problem is not None:
        raise ConfigError(f"{source}: unknown section [policy.{policy}]: {policy!r} {problem}")
    return tuple(_registry().policy_class(policy).config_fields)


def _known_policy_fields(policy: str) -> str:
    fields = _registry().policy_class(policy).config_fields
    if not fields:
        return f"policy {policy!r} has no fields of its own"
    return f"policy {policy!r} has the fields {', '.join(f.key for f in fields)}"


def _policy_sections(name: str, given: Mapping[str, Any], source: str) -> dict[str, SimpleNamespace]:
    """The policies' own sections: each one given (validated, defaults filled in), and the active
    policy ``name``'s even when not given (all defaults)."""
    wanted = dict(given)
    if name not in wanted and _policy_fields(name, source):
        wanted[name] = {}
    sections = {}
    for policy, values in wanted.items():
        fields = _policy_fields(policy, source)
        if not fields:  # a section of a policy with no fields of its own: only the empty one
            for key in values:
                raise ConfigError(f"{source}: unknown field policy.{policy}.{key}; {_known_policy_fields(policy)}")
            sections[policy] = SimpleNamespace()
            continue
        sections[policy] = SimpleNamespace(**_convert(values, fields, source, f"; {_known_policy_fields(policy)}"))
    return sections


def from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Validate a nested mapping {section: {field: value}} into a Config."""
    raw = copy.deepcopy(dict(raw))
    for section in raw:
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; known sections: {', '.join(SECTIONS)}")
    sections: dict[str, SimpleNamespace] = {}
    for section in SECTIONS:
        given = raw.get(section)
        if given is None and section in OPTIONAL_SECTIONS:
            given = {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"{source}: missing section [{section}]")
        # [policy.NAME] tables: the policies' own sections, checked below against the policy's fields
        subsections = {k: v for k, v in given.items() if isinstance(v, Mapping) and f"policy.{k}" not in FIELDS_BY_KEY
                       } if section == "policy" else {}
        values = _convert({k: v for k, v in given.items() if k not in subsections}, _SECTION_FIELDS[section],
                          source, "")
        if section == "policy":
            values.update(_policy_sections(values["name"], subsections, source))
        sections[section] = SimpleNamespace(**values)
    cfg = Config(source=source, **sections)
    cfg._splits_dram = _registry().policy_class(cfg.policy.name).splits_dram
    cfg._with_overrides = with_overrides
    _check_consistency(cfg)
    return cfg


def _check_consistency(cfg: Config) -> None:
    """Cross-field rules: alignment and sizes that only make sense together."""
    src = cfg.source
    page = cfg.device.page_size_bytes

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{src}: {msg}")

    need(page & (page - 1) == 0, f"device.page_size_bytes = {page} must be a power of two")
    need(cfg.dram.size_bytes % page == 0, f"dram.size_bytes = {cfg.dram.size_bytes} must be a multiple of device.page_size_bytes = {page}")
    need(cfg.dram_frames >= 2, f"dram.size_bytes = {cfg.dram.size_bytes} must hold at least 2 pages of {page} bytes")
    need(cfg.ssd.stripe_bytes % page == 0, f"ssd.stripe_bytes = {cfg.ssd.stripe_bytes} must be a multiple of device.page_size_bytes = {page}")
    need(cfg.ssd.capacity_bytes % cfg.ssd.stripe_bytes == 0,
         f"ssd.capacity_bytes = {cfg.ssd.capacity_bytes} must be a multiple of ssd.stripe_bytes = {cfg.ssd.stripe_bytes}")
    window_pages = -(-cfg.policy.prefetch_window_bytes // page)
    need(window_pages < cfg.read_staging_frames,
         f"policy.prefetch_window_bytes = {cfg.policy.prefetch_window_bytes} needs {window_pages} frames; "
         f"the read-staging area has {cfg.read_staging_frames} and one must stay free for demand reads")
    need(cfg.faults.first_failing_op == 0 or cfg.faults.errno != "none",
         f"faults.first_failing_op = {cfg.faults.first_failing_op} needs faults.errno set to one of "
         f"{', '.join(FAULT_ERRNOS[1:])} (it is 'none')")
    _registry().policy_class(cfg.policy.name).check_config(cfg, need)  # the policy's own rules (sizes its structures need)


def parse_field_value(text: str) -> Any:
    """A field's value as typed on a command line (``--set``, ``--sweep``): parsed as TOML, so ``1e6``,
    ``true`` and ``"lru"`` work; a bare word that is not TOML is the string itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def profile_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(__package__).joinpath("profiles").iterdir()
                  if p.name.endswith(".toml"))


def load_profile(name_or_path: str | Path) -> Config:
    """Load a shipped profile by name (``small``, ``paper``, ``cmmh``) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"profile file {str(path)!r} does not exist")
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"profile file {source!r} is not a TOML text file: byte {exc.start} is not UTF-8 "
                              f"({exc.reason})") from None
        except OSError as exc:
            raise ConfigError(f"cannot read profile file {source!r}: {exc.strerror}") from None
    else:
        if str(name_or_path) not in profile_names():
            raise ConfigError(f"unknown profile {str(name_or_path)!r}; shipped profiles: {', '.join(profile_names())}")
        text = resources.files(__package__).joinpath("profiles").joinpath(f"{name_or_path}.toml").read_text()
        source = f"profile {name_or_path!r}"
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return from_dict(raw, source=source)
