"""Errors of the device, each carrying the errno that libchm returns negated."""

import errno as _errno


class ChmError(Exception):
    """A device error. ``errno`` is the positive errno value (EINVAL, ERANGE, ...)."""

    def __init__(self, err: int, message: str):
        super().__init__(f"[{_errno.errorcode.get(err, err)}] {message}")
        self.errno = err
        self.message = message


class WriteBufferFull(ChmError):
    """The write buffer had no room: nothing was written; retry later (EAGAIN)."""

    def __init__(self, message: str):
        super().__init__(_errno.EAGAIN, message)


class ConfigError(ChmError):
    """A profile or config field is missing, of the wrong type or out of range."""

    def __init__(self, message: str):
        super().__init__(_errno.EINVAL, message)
