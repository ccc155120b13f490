"""``clock``: a transparent cache evicting by CLOCK, second chance (libCacheSim's Clock)."""

from __future__ import annotations

from ..frame_table import NativeOrder
from . import param, register


class ClockOrder(NativeOrder):
    """CLOCK as libCacheSim's ``Clock`` (``init_freq=0``): a queue, new pages at the head with counter 0; a
    hit adds 1 up to ``2**n_bit_counter - 1``. The hand looks at the tail: a page with a nonzero counter
    loses 1 and goes to the head, the first page at 0 is the victim. Pinned pages are passed over like
    a hand passes a page it may not take: they go to the head with their counter unchanged. Runs in the
    native core (``CHM_POLICY_CLOCK``, emulator/native/policy_clock.c)."""

    native_name = "clock"
    config_fields = (param("n_bit_counter", int, 1, 8, default=1,
                           doc="bits of each page's reference counter (libCacheSim's n-bit-counter)"),)

    def native_params(self):
        return {"n_bit_counter": self.params.n_bit_counter}

    @property
    def max_freq(self) -> int:
        return self.info().max_freq


register("clock", ClockOrder)
