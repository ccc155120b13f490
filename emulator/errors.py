"""Errors of the device. ``ChmError`` and ``WriteBufferFull`` are the driver's
(the errno values are part of the wire); configuration errors are the
emulator's own."""

import errno as _errno

from driver.errors import ChmError, WriteBufferFull

__all__ = ["ChmError", "WriteBufferFull", "ConfigError"]


class ConfigError(ChmError):
    """A profile or config field is missing, of the wrong type or out of range."""

    def __init__(self, message: str):
        super().__init__(_errno.EINVAL, message)
