"""Device profiles: the modelled hardware and the emulator's settings.

A profile is a TOML file with the sections and fields listed in ``FIELDS``,
plus each DRAM policy's own section ``[policy.NAME]`` (the fields its class
declares in ``config_fields``; see ``emulator.policies``). Every field is
checked on load (type and range); errors name the profile, the field, the
value and the allowed range. Units are in the field names: bytes,
nanoseconds, GB/s (1 GB/s is exactly one byte per nanosecond, which keeps the
timing model free of unit conversions).
"""

from __future__ import annotations

import copy
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from .errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
IO_ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths

FAULT_ERRNOS = ("none", "ENOSPC", "EIO")  # what an injected media failure completes with
FAULT_OPS = ("write", "read", "any")
_REQUIRED = object()  # Field.default of a field every profile must give


@dataclass(frozen=True)
class Field:
    section: str
    name: str
    kind: type
    lo: float | None = None
    hi: float | None = None
    choices: tuple | None = None
    doc: str = ""
    default: Any = _REQUIRED  # a field with a default may be left out of a profile
    validator: Callable[[Any], str | None] | None = None  # a further check: None, or what is wrong with the value

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def check(self, value: Any, where: str) -> Any:
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if self.kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, self.kind) or (self.kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"{where}: {self.key} = {value!r} must be of type {self.kind.__name__}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: {self.key} = {value!r} is not one of {', '.join(map(str, self.choices))}")
        if self.kind in (int, float):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where}: {self.key} = {value!r} must be finite")
            if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
                raise ConfigError(f"{where}: {self.key} = {value!r} is out of range [{self.lo:g}, {self.hi:g}]")
        if self.validator is not None and (problem := self.validator(value)) is not None:
            raise ConfigError(f"{where}: {self.key} = {value!r} {problem}")
        return value


def _policy_name_problem(name: str) -> str | None:
    from .policies import name_problem  # the registry imports this module

    return name_problem(name)


FIELDS: tuple[Field, ...] = (
    Field("device", "name", str, doc="human-readable description of the modelled device"),
    Field("device", "page_size_bytes", int, IO_ALIGN, 64 * MiB, doc="DRAM frame size: unit of staging, eviction and flushing"),
    Field("host_link", "kind", str, choices=("rdma", "cxl"), doc="how the host reaches the device"),
    Field("host_link", "latency_ns", float, 0, 1e6, doc="one-way request-to-first-byte latency"),
    Field("host_link", "bandwidth_gbps", float, 0.01, 1e4, doc="GB/s of payload"),
    Field("controller", "clock_mhz", float, 1, 1e5, doc="controller pipeline clock"),
    Field("controller", "cycles_per_command", int, 1, 1_000_000, doc="decode + dispatch of one command"),
    Field("controller", "cycles_per_lookup", int, 1, 1_000_000, doc="frame-table lookup of one page"),
    Field("controller", "cycles_per_admission", int, 1, 1_000_000, doc="write-buffer check-and-reserve of one page"),
    Field("controller", "cycles_per_prefetch_page", int, 1, 1_000_000, doc="prefetch engine: issue of one page fetch"),
    Field("dram", "size_bytes", int, IO_ALIGN, 64 * TiB, doc="device DRAM"),
    Field("dram", "latency_ns", float, 0, 1e6),
    Field("dram", "bandwidth_gbps", float, 0.01, 1e5),
    Field("ssd", "count", int, 1, 64),
    Field("ssd", "capacity_bytes", int, IO_ALIGN, 1 << 50, doc="per SSD; also the size of its sparse backing file"),
    Field("ssd", "stripe_bytes", int, IO_ALIGN, 1 << 40, doc="address space is striped over the SSDs in units of this"),
    Field("ssd", "read_latency_ns", float, 0, 1e9),
    Field("ssd", "write_latency_ns", float, 0, 1e9),
    Field("ssd", "read_bandwidth_gbps", float, 0.001, 1e4),
    Field("ssd", "write_bandwidth_gbps", float, 0.001, 1e4),
    Field("ssd", "parallelism", int, 1, 1_000_000, doc="commands one SSD serves at once (channels x dies)"),
    Field("ssd", "read_slowdown_under_writes", float, 1, 100, doc="read service-time factor while writes are in flight"),
    Field("policy", "name", str, validator=_policy_name_problem,
          doc="DRAM policy: a registered name (emulator.policies.available()) or libcachesim:ALGORITHM"),
    Field("policy", "write_buffer_fraction", float, 0, 0.95, doc="hymcache: share of DRAM reserved as write buffer"),
    Field("policy", "prefetch_window_bytes", int, 0, 64 * TiB, doc="most bytes of prefetched objects held at once"),
    Field("policy", "prefetch_max_handles", int, 1, 1 << 20, doc="most prefetch handles outstanding at once"),
    Field("policy", "prefetch_client_share", float, 1e-6, 1.0,
          doc="share of the prefetch window (pages and handles) one client may hold, unless it asks for less at attach"),
    Field("policy", "flush_batch_bytes", int, IO_ALIGN, 64 * TiB, doc="hymcache: flusher writes batches of this size"),
    Field("policy", "flush_max_reads_in_flight", int, 0, 1 << 20, doc="hymcache: flush only while at most this many SSD reads are in flight"),
    Field("policy", "flush_max_delay_ns", float, 0, 1e15, doc="hymcache: flush a partial batch once its oldest page is this old"),
    Field("policy", "lru_writeback_delay_ns", float, 0, 1e15, doc="lru: dirty pages go to flash this long after the write"),
    Field("emulation", "data", bool, doc="move real bytes (false: state and time only, for trace replay)"),
    Field("emulation", "io_queue_depth", int, 1, 4096, doc="io_uring submission queue depth"),
    # Test-only fault injection in the io_uring backend (no root needed); profiles need not list [faults].
    Field("faults", "errno", str, choices=FAULT_ERRNOS, default="none",
          doc="errno an injected media failure completes with (none: no faults)"),
    Field("faults", "ops", str, choices=FAULT_OPS, default="write", doc="which media operations may fail"),
    Field("faults", "first_failing_op", int, 0, 1 << 62, default=0,
          doc="the Nth media operation of faults.ops (counted from 1 since open) is the first to fail; 0: none fails"),
    Field("faults", "failing_ops", int, 1, 1 << 62, default=1,
          doc="how many consecutive media operations of faults.ops fail, from faults.first_failing_op on"),
    Field("faults", "read_delay_ms", float, 0, 60_000, default=0,
          doc="every media read completes no sooner than this long after it is submitted (a slow disk); 0: off"),
)
FIELDS_BY_KEY = {f.key: f for f in FIELDS}
SECTIONS = tuple(dict.fromkeys(f.section for f in FIELDS))
# Sections whose every field has a default: a profile may leave them out.
OPTIONAL_SECTIONS = tuple(s for s in SECTIONS if all(f.default is not _REQUIRED for f in FIELDS if f.section == s))


class Config(SimpleNamespace):
    """A validated profile: ``cfg.ssd.read_latency_ns`` etc., plus derived sizes."""

    source: str
    _splits_dram: bool  # the policy's capability (emulator.policies), resolved once by from_dict

    # ---- derived quantities: one definition each -------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.ssd.count * self.ssd.capacity_bytes

    @property
    def dram_frames(self) -> int:
        return self.dram.size_bytes // self.device.page_size_bytes

    @property
    def write_buffer_frames(self) -> int:
        if not self._splits_dram:  # the policy's capability, resolved once by from_dict
            return 0
        return int(self.dram_frames * self.policy.write_buffer_fraction)

    @property
    def read_staging_frames(self) -> int:
        return self.dram_frames - self.write_buffer_frames

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}}; a policy's own section is a nested dict (``raw["policy"]["s3fifo"]``)."""
        def plain(value):
            return dict(vars(value)) if isinstance(value, SimpleNamespace) else value

        return {s: {k: plain(v) for k, v in vars(getattr(self, s)).items()} for s in SECTIONS}

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Config":
        """``overrides`` maps ``section.field`` (or ``policy.NAME.field``, a policy's own section) to values."""
        raw = self.as_dict()
        for key, value in overrides.items():
            if key in FIELDS_BY_KEY:
                section, name = key.split(".")
                raw[section][name] = value
                continue
            parts = key.split(".") if isinstance(key, str) else []
            if len(parts) != 3 or parts[0] != "policy":
                raise ConfigError(f"{self.source}: unknown field {key!r}; known fields: {', '.join(FIELDS_BY_KEY)} "
                                  f"and policy.NAME.FIELD of a policy's own section")
            _, policy, name = parts
            if name not in _policy_fields(policy, self.source):
                raise ConfigError(f"{self.source}: unknown field {key!r}; {_known_policy_fields(policy)}")
            section = raw["policy"].setdefault(policy, {})
            section[name] = value
        return from_dict(raw, source=f"{self.source}+overrides")


def _policy_fields(policy: str, source: str) -> dict[str, Field]:
    """The fields of policy ``policy``'s own section (``[policy.NAME]``), by name."""
    from .policies import name_problem, policy_class  # the registry imports this module

    problem = name_problem(policy)
    if problem is not None:
        raise ConfigError(f"{source}: unknown section [policy.{policy}]: {policy!r} {problem}")
    return {f.name: f for f in policy_class(policy).config_fields}


def _known_policy_fields(policy: str) -> str:
    from .policies import policy_class

    fields = policy_class(policy).config_fields
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
        for key in values:
            if key not in fields:
                raise ConfigError(f"{source}: unknown field policy.{policy}.{key}; {_known_policy_fields(policy)}")
        sections[policy] = SimpleNamespace(**{
            f.name: f.check(values[f.name], source) if f.name in values else f.default for f in fields.values()})
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
        values = {}
        # [policy.NAME] tables: the policies' own sections, checked below against the policy's fields
        subsections = {k: v for k, v in given.items() if isinstance(v, Mapping)} if section == "policy" else {}
        for name in given:
            if name not in subsections and f"{section}.{name}" not in FIELDS_BY_KEY:
                raise ConfigError(f"{source}: unknown field {section}.{name}")
        for field in (f for f in FIELDS if f.section == section):
            if field.name not in given:
                if field.required:
                    raise ConfigError(f"{source}: missing field {field.key}")
                values[field.name] = field.default
                continue
            values[field.name] = field.check(given[field.name], source)
        if section == "policy":
            values.update(_policy_sections(values["name"], subsections, source))
        sections[section] = SimpleNamespace(**values)
    from .policies import policy_class  # the registry imports this module

    cfg = Config(source=source, **sections)
    cfg._splits_dram = policy_class(cfg.policy.name).splits_dram
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
    from .policies import policy_class

    policy_class(cfg.policy.name).check_config(cfg, need)  # the policy's own rules (sizes its structures need)


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
