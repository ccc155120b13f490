"""Byte units: how the tools print sizes and read them back (binary units only)."""

from __future__ import annotations

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def parse_bytes(text: str | int, what: str = "size") -> int:
    """``"64MiB"`` -> 67108864. Binary units only (KV sizes are powers of two), named in errors."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().lower().replace(" ", "")
        number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(number):]
        if unit not in _UNITS or not number:
            raise ValueError(f"{what} = {text!r} is not a byte count; use an integer with an optional unit "
                             f"KiB, MiB, GiB or TiB (e.g. 64MiB)")
        try:
            value = int(float(number) * _UNITS[unit])
        except ValueError:
            raise ValueError(f"{what} = {text!r} is not a byte count (e.g. 64MiB)") from None
        except OverflowError:  # 1e400 is an infinite float
            raise ValueError(f"{what} = {text!r} is not a finite byte count (e.g. 64MiB)") from None
    if value <= 0:
        raise ValueError(f"{what} = {text!r} must be positive")
    return value
