"""How the device's tools print sizes (``common.units``, re-exported for the emulator's modules)."""

from common.units import format_bytes  # noqa: F401
