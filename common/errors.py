"""The one base class of errors a command reports as a message (``prog: error: MESSAGE``, exit 1)."""


class ReportedError(Exception):
    """Bad input or a failing environment, not a bug: a CLI prints the message, never a traceback.
    ``driver.errors.ChmError`` derives from it, so the layers' own errors need no registration."""
