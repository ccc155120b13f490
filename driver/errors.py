"""Device errors, each carrying the errno the wire's status field holds
(negated) and libchm returns. One definition for both sides: the emulator
raises these, ``libchm.Device`` raises these, so host code catches the same
classes whichever device it talks to."""

import errno as _errno

from common.errors import ReportedError


class ChmError(ReportedError):
    """A device error. ``errno`` is the positive errno value (EINVAL, ERANGE, ...)."""

    def __init__(self, err: int, message: str):
        super().__init__(f"[{_errno.errorcode.get(err, err)}] {message}")
        self.errno = err
        self.message = message


class WriteBufferFull(ChmError):
    """The write buffer had no room; retry later (EAGAIN).

    ``written`` is the byte count written before the refusal: 0 for one
    command (admitted whole or not at all); for a write split into commands
    (libchm, larger than its staging buffer) the parts before the refused one
    stay written, and ``written`` says how many bytes they hold. ``new_pages``
    (from the device model) is how many write-buffer pages the write asked for."""

    def __init__(self, message: str, written: int = 0, new_pages: int = 0):
        super().__init__(_errno.EAGAIN, message)
        self.written = written
        self.new_pages = new_pages
