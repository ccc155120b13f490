"""Page transfers between DRAM frames and the media.

Each transfer is charged to its SSD's timing model (when it is modelled to finish) and, when
``emulation.data`` is on, really performed by the ``SsdBackend`` (io_uring, O_DIRECT): the caller gets
a token to wait on. Where a page lives on the media is ``ssd.locate``'s striping.
"""

from __future__ import annotations

from .config import Config
from .ssd import SsdBackend, locate
from .timing import TimingModel


class MediaIO:
    """Starts page transfers and waits for them; counts the bytes moved (``ssd_read_bytes``,
    ``ssd_write_bytes`` in ``stats``)."""

    def __init__(self, cfg: Config, timing: TimingModel, stats: dict, backend: SsdBackend | None, dram_addr: int):
        """``backend`` None: data is off, transfers are modelled only. ``dram_addr``: the DRAM region's address."""
        self.cfg, self.page, self.ssds, self.stats = cfg, cfg.device.page_size_bytes, timing.ssds, stats
        self.backend = backend
        self._dram_addr = dram_addr

    def read(self, frame: int, page: int, now: float) -> tuple[float, int | None]:
        """Start reading ``page`` into ``frame`` at ``now``: (its modelled finish, the real read's token or None)."""
        size = self.page
        ssd, offset = locate(self.cfg, page * size)
        done = self.ssds[ssd].read(now, size)
        self.stats["ssd_read_bytes"] += size
        if self.backend is None:
            return done, None
        return done, self.backend.submit(SsdBackend.READ, ssd, offset, self._dram_addr + frame * size, size)

    def write(self, frame: int, page: int, pages: int, now: float) -> tuple[float, int | None]:
        """Start writing ``pages`` frames from ``frame`` on to the media from ``page`` on (one SSD file, one
        run: see ``contiguous``) at ``now``: (its modelled finish, the real write's token or None)."""
        nbytes = pages * self.page
        ssd, offset = locate(self.cfg, page * self.page)
        done = self.ssds[ssd].write(now, nbytes)
        self.stats["ssd_write_bytes"] += nbytes
        if self.backend is None:
            return done, None
        return done, self.backend.submit(SsdBackend.WRITE, ssd, offset, self._dram_addr + frame * self.page, nbytes)

    def contiguous(self, page: int, next_page: int) -> bool:
        """Does ``next_page`` follow ``page`` in the same SSD file (so one media write can take both)?"""
        a, b = locate(self.cfg, page * self.page), locate(self.cfg, next_page * self.page)
        return a[0] == b[0] and b[1] == a[1] + self.page

    def wait(self, token: int) -> None:
        """Until the transfer behind ``token`` is done; raises its MediaIOError if it failed."""
        self.backend.wait(token)

    def poll(self) -> None:
        """Get queued transfers going, without blocking."""
        if self.backend is not None:
            self.backend.poll()

    def landed(self, token: int) -> bool:
        """Has the transfer behind ``token`` completed (as of the last ``poll``)? ``wait`` then returns at once."""
        return self.backend.is_done(token)

    def fileno(self) -> int | None:
        """A descriptor that polls readable while completions wait to be collected (None: data off)."""
        return None if self.backend is None else self.backend.fileno()

    def held_back_s(self) -> float | None:
        """Seconds until the first completion the test-only read delay holds back is due (None: none is)."""
        return None if self.backend is None else self.backend.held_back_s()

    def sync(self) -> None:
        """Make everything written durable (raises the MediaIOError of an fdatasync that fails)."""
        if self.backend is not None:
            self.backend.sync()

    def close(self, clean: bool) -> None:
        """Sync and release the media; ``clean``: nothing was left unflushed (the media say so)."""
        if self.backend is not None:
            self.backend.close(clean=clean)
