"""``sieve``: a transparent cache evicting by SIEVE (libCacheSim's Sieve)."""

from __future__ import annotations

from ..frame_table import NativeOrder
from . import register


class SieveOrder(NativeOrder):
    """SIEVE as libCacheSim's ``Sieve``: a queue with new pages at the head, a visited bit per page (set by a
    hit), and a hand that moves from the tail towards the head (wrapping to the tail), clearing visited
    bits, and evicts the first page not visited; the next eviction starts where the hand stopped.
    Pinned pages are passed over and keep their bit. Runs in the native core (``CHM_POLICY_SIEVE``,
    emulator/native/policy_sieve.c)."""

    native_name = "sieve"


register("sieve", SieveOrder)
