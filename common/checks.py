"""One family of checks for arguments, RPC messages, CLI values and config: each error names the field, the value
given and the allowed range, in one wording.

A layer makes one ``Checks`` with the exception it raises (the device's and the services' ``ChmError(EINVAL)``,
config's ``ConfigError``, plain ``ValueError``), and checks through it::

    check = Checks(lambda message: ChmError(errno.EINVAL, message))
    lease_s = check.number("lease_s", value, 0.0, MAX_TIMEOUT_S, low_open=True)

Structured input (a profile's TOML table, a preset, an RPC message) is declared once as a ``msgspec.Struct``
whose fields carry their ranges (``Annotated[int, Meta(ge=1, le=8)]``); ``check.convert(data, Type)`` builds
it, and rewords msgspec's errors, which name the path and the constraint but not the value, to the rule above.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlong = 160  # an integer is quoted whole (a 2**512 key is 155 digits): a cut number misleads


def shown(value: Any) -> str:
    """A value as an error quotes it: its repr, cut short."""
    return _short.repr(value)


def outside(field: str, value: Any, allowed: str) -> str:
    """The one wording: ``lease_s -1 is outside the allowed range: a number in (0, 86400]``."""
    return f"{field} {shown(value)} is outside the allowed range: {allowed}"


def number(x: float) -> str:
    """A bound as an error shows it: an int as written, a float without a trailing .0 (86400, 0.9, 1e+12)."""
    return f"{x:g}" if isinstance(x, float) else str(x)


def interval(low: float, high: float, low_open: bool = False, high_open: bool = False) -> str:
    return f"{'(' if low_open else '['}{number(low)}, {number(high)}{')' if high_open else ']'}"


def _is_int(value: Any) -> bool:
    # bool is an int to Python but never a count; numpy's integers register as numbers.Integral
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Checks:
    """The checks of one layer, raising ``error(message)``."""

    def __init__(self, error: Callable[[str], Exception] = ValueError):
        self.error = error

    def fail(self, field: str, value: Any, allowed: str) -> Exception:
        return self.error(outside(field, value, allowed))

    def int(self, field: str, value: Any, low: int, high: int) -> int:
        """An integer in [low, high] (not a bool, not a float)."""
        if not _is_int(value) or not low <= value <= high:
            raise self.fail(field, value, f"an integer in {interval(low, high)}")
        return int(value)

    def number(self, field: str, value: Any, low: float = -math.inf, high: float = math.inf, *,
               low_open: bool = False, high_open: bool = False) -> float:
        """A finite-or-bounded real in the interval (NaN never passes)."""
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok:
            v = float(value)
            ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if not ok:
            raise self.fail(field, value, f"a number in {interval(low, high, low_open, high_open)}")
        return float(value)

    def one_of(self, field: str, value: Any, choices: Sequence) -> Any:
        if value not in choices:
            raise self.fail(field, value, "one of " + ", ".join(map(str, choices)))
        return value

    def text(self, field: str, value: Any, min_len: int = 0, max_len: int = 1 << 20) -> str:
        if not isinstance(value, str) or not min_len <= len(value) <= max_len:
            raise self.fail(field, value, f"a str of {min_len} to {max_len} characters")
        return value

    def blob(self, field: str, value: Any, length: int) -> bytes:
        """Exactly ``length`` bytes (bytes, bytearray or memoryview; returned as bytes)."""
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        if not isinstance(value, bytes) or len(value) != length:
            got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
            raise self.error(f"{field} must be {length} bytes, got {got}")
        return value

    def items(self, field: str, value: Any, min_items: int, max_items: int) -> list:
        if not isinstance(value, (list, tuple)) or not min_items <= len(value) <= max_items:
            got = f"{len(value)} items" if isinstance(value, (list, tuple)) else shown(value)
            raise self.error(f"{field} must be a list of {min_items} to {max_items} items, got {got}")
        return list(value)

    def convert(self, data: Any, type_: type[T], where: str = "", *, strict: bool = True) -> T:
        """``msgspec.convert(data, type_)`` with every validation error in the one wording (``where`` prefixes the
        field path: ``"[dram] "``, ``"put_start: "``)."""
        try:
            return msgspec.convert(data, type_, strict=strict)
        except msgspec.ValidationError as exc:
            raise self.error(where + explain(exc, data, type_)) from None


def explain(exc: msgspec.ValidationError, data: Any, type_: Any) -> str:
    """msgspec's error (``Expected `int` >= 1 - at `$.ways```) as ``ways 0 is outside the allowed range: an
    integer in [1, 8]``: the path's value looked up in ``data``, the range read from ``type_``'s declaration."""
    message = str(exc)
    path = ""
    if " - at `$" in message:
        message, path = message.rsplit(" - at `$", 1)
        path = path.rstrip("`")
    steps = _parse_path(path)
    field = ".".join(str(s) if isinstance(s, str) else f"[{s}]" for s in steps).replace(".[", "[")
    if message.startswith("Object missing required field `"):
        name = message.split("`")[1]
        return f"{field + '.' if field else ''}{name} is missing ({_allowed(_field_type(type_, steps + [name]))})"
    if message.startswith("Object contains unknown field `"):
        name = message.split("`")[1]
        known = _field_names(_field_type(type_, steps))
        return (f"{field + '.' if field else ''}{name} is not a known field"
                + (f"; known: {', '.join(known)}" if known else ""))
    found, value = _lookup(data, steps)
    if not found or not field:
        return f"{field + ': ' if field else ''}{message}"
    return outside(field, value, _allowed(_field_type(type_, steps)) or message)


def _parse_path(path: str) -> list:
    steps: list = []
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        if part.startswith("[") and part.endswith("]"):
            inner = part[1:-1]
            steps.append(int(inner) if inner.lstrip("-").isdigit() else inner.strip("'\"`"))
        else:
            steps.append(part)
    return steps


def _lookup(data: Any, steps: list) -> tuple[bool, Any]:
    for step in steps:
        try:
            if isinstance(data, Mapping):
                data = data[step]
            elif isinstance(step, int) and isinstance(data, (list, tuple)):
                data = data[step]
            else:
                data = getattr(data, step)
        except (KeyError, IndexError, AttributeError, TypeError):
            return False, None
    return True, data


def _info(type_: Any):
    try:
        return msgspec.inspect.type_info(type_)
    except (TypeError, ValueError):
        return None


def _field_type(type_: Any, steps: list):
    info = _info(type_)
    for step in steps:
        while isinstance(info, msgspec.inspect.UnionType):  # Optional[X]: the non-None arm
            arms = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            info = arms[0] if len(arms) == 1 else None
        if isinstance(info, (msgspec.inspect.StructType, msgspec.inspect.TypedDictType,
                             msgspec.inspect.DataclassType)) and isinstance(step, str):
            info = next((f.type for f in info.fields if f.encode_name == step or f.name == step), None)
        elif isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.TupleType, msgspec.inspect.SetType,
                               msgspec.inspect.FrozenSetType, msgspec.inspect.VarTupleType)):
            info = info.item_type
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        else:
            return None
    return info


def _field_names(info) -> list[str]:
    return [f.encode_name for f in getattr(info, "fields", ())]


def _allowed(info) -> str:
    """What a declared field accepts, in the one wording's terms."""
    ins = msgspec.inspect
    if info is None:
        return ""
    if isinstance(info, ins.UnionType):
        return " or ".join(filter(None, (_allowed(t) for t in info.types)))
    if isinstance(info, ins.NoneType):
        return "none"
    if isinstance(info, ins.BoolType):
        return "true or false"
    if isinstance(info, (ins.IntType, ins.FloatType)):
        kind = "an integer" if isinstance(info, ins.IntType) else "a number"
        low = info.ge if info.ge is not None else info.gt
        high = info.le if info.le is not None else info.lt
        if low is None and high is None:
            return kind
        if high is None:
            return f"{kind} {'>' if info.ge is None else '>='} {number(low)}"
        if low is None:
            return f"{kind} {'<' if info.le is None else '<='} {number(high)}"
        return f"{kind} in {interval(low, high, info.ge is None, info.le is None)}"
    if isinstance(info, ins.StrType):
        if info.min_length is None and info.max_length is None:
            return "a string"
        return f"a string of {info.min_length or 0} to {info.max_length if info.max_length is not None else 'any'} " \
               f"characters"
    if isinstance(info, ins.LiteralType):
        return "one of " + ", ".join(map(str, info.values))
    if isinstance(info, ins.EnumType):
        return "one of " + ", ".join(str(m.value) for m in info.cls)
    if isinstance(info, (ins.ListType, ins.VarTupleType, ins.SetType, ins.FrozenSetType)):
        sizes = ""
        if info.min_length is not None or info.max_length is not None:
            sizes = f" of {info.min_length or 0} to {info.max_length if info.max_length is not None else 'any'}"
        return f"a list{sizes} of {_allowed(info.item_type) or 'items'}"
    if isinstance(info, (ins.StructType, ins.TypedDictType, ins.DataclassType, ins.DictType)):
        return "a table"
    if isinstance(info, (ins.BytesType, ins.ByteArrayType)):
        return "bytes"
    return type(info).__name__.removesuffix("Type").lower()
