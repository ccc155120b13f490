"""What a device profile holds, declared once: the fields (section, type, range, default) and the validated
profile's type, ``Config``. Nothing here imports a policy: the policies declare their own sections' fields
with this module's ``Field`` (``emulator.policies.param``), and ``emulator.config``, which parses profiles,
imports the policies in one direction only.

Each field's ``type`` is its ``msgspec`` type with the range (``Annotated[int, Meta(ge=..., le=...)]``, a
``Literal`` of its choices); a profile's section converts into a Struct built from its fields
(``section_type``). A value the type refuses is a ``ConfigError`` in the profiles' wording:
``SOURCE: section.field = VALUE is out of range [LO, HI]`` (``must be of type ...``, ``is not one of ...``,
``must be finite``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any, Callable, Literal, Mapping

import msgspec
from msgspec import Meta

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

    @property
    def type(self) -> Any:
        """The field's type with its range, as ``msgspec.convert`` checks it."""
        if self.choices is not None:
            return Literal[self.choices]
        if self.kind in (int, float) and (self.lo is not None or self.hi is not None):
            bound = self.kind  # an int field's bounds are ints, a float field's floats
            return Annotated[self.kind, Meta(ge=None if self.lo is None else bound(self.lo),
                                             le=None if self.hi is None else bound(self.hi))]
        return self.kind

    def read(self, value: Any) -> Any:
        """The value as the field's type takes it: an integral float for an int field, an int for a float one
        (TOML writes ``1e6`` as a float, ``0`` as an int)."""
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if self.kind is int and isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    def refusal(self, value: Any) -> str:
        """Why the field's type refuses ``value`` (read), in the profiles' wording."""
        if not isinstance(value, self.kind) or (self.kind is not bool and isinstance(value, bool)):
            return f"must be of type {self.kind.__name__}"
        if self.choices is not None and value not in self.choices:
            return f"is not one of {', '.join(map(str, self.choices))}"
        if isinstance(value, float) and not math.isfinite(value):
            return "must be finite"
        return f"is out of range [{self.lo:g}, {self.hi:g}]"

    def refused(self, value: Any, where: str) -> ConfigError:
        value = self.read(value)
        return ConfigError(f"{where}: {self.key} = {value!r} {self.refusal(value)}")

    def further(self, value: Any, where: str) -> Any:
        """``value`` past the field's further check (``validator``), or ConfigError saying what is wrong."""
        if self.validator is not None and (problem := self.validator(value)) is not None:
            raise ConfigError(f"{where}: {self.key} = {value!r} {problem}")
        return value

    def check(self, value: Any, where: str) -> Any:
        """One value (a command line's, an override's) as the field's type, or ConfigError naming ``where``,
        the field, the value and the allowed range."""
        try:
            value = msgspec.convert(self.read(value), self.type, strict=True)
        except msgspec.ValidationError:
            raise self.refused(value, where) from None
        return self.further(value, where)


@functools.cache
def section_type(fields: tuple[Field, ...]) -> type[msgspec.Struct]:
    """A Struct of ``fields`` (one section of a profile, or a policy's own): each with its type, range and
    default; no other names."""
    required = [(f.name, f.type) for f in fields if f.required]
    optional = [(f.name, f.type, f.default) for f in fields if not f.required]
    return msgspec.defstruct("Section", required + optional, forbid_unknown_fields=True, kw_only=True)


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
    # its further check, that the registry knows the name, is emulator.config's (this module imports no policy)
    Field("policy", "name", str,
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
SECTIONS = tuple(dict.fromkeys(f.section for f in FIELDS))
# Sections whose every field has a default: a profile may leave them out.
OPTIONAL_SECTIONS = tuple(s for s in SECTIONS if all(f.default is not _REQUIRED for f in FIELDS if f.section == s))


class Config(SimpleNamespace):
    """A validated profile: ``cfg.ssd.read_latency_ns`` etc., plus derived sizes. Made by ``emulator.config``
    (``from_dict``, ``load_profile``), which also sets what needs the policies."""

    source: str
    _splits_dram: bool  # the policy's capability (emulator.policies), resolved once by from_dict
    _with_overrides: Callable[["Config", Mapping[str, Any]], "Config"]  # emulator.config.with_overrides

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
        return self._with_overrides(self, overrides)
