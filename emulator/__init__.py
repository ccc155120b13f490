"""The emulated CXL hybrid-memory (CXL-HM) device.

    from emulator import Device, ChmError, WriteBufferFull
    with Device.open(profile="small", media_dir=path, policy="hymcache") as dev:
        dev.write(0, b"hello")
"""

from .config import Config, load_profile, profile_names
from .device import Device
from .errors import ChmError, ConfigError, WriteBufferFull

__all__ = ["Device", "ChmError", "WriteBufferFull", "ConfigError", "Config", "load_profile", "profile_names"]
