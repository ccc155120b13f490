"""Device errors, each carrying the errno the wire's status field holds
(negated) and libchm returns. One definition for both sides: the emulator
raises these, ``libchm.Device`` raises these, so host code catches the same
classes whichever device it talks to."""

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
