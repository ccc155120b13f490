"""``s3fifo``: a transparent cache evicting by S3-FIFO (libCacheSim's S3FIFO)."""

from __future__ import annotations

from ..frame_table import NativeOrder
from . import param, register

MIN_SMALL_FRAMES = 2  # libCacheSim admits no object as large as the small queue: with 1 frame nothing enters


class S3FifoOrder(NativeOrder):
    """S3-FIFO as libCacheSim's ``S3FIFO`` (its current version): a small FIFO queue
    (``small_size_ratio`` of the frames), a main queue (the rest) and a ghost FIFO of page numbers
    (``ghost_size_ratio``). A new page enters the small queue, or the main queue if it is in the ghost
    (or, before the first eviction, if the small queue is full). Each hit adds 1 to its counter. Evicting
    from the small queue (when the main queue is within its share): a page hit at least
    ``move_to_main_threshold`` times moves to the main queue, the first that was not is the victim and
    its number goes to the ghost. Evicting from the main queue: a page with a nonzero counter goes back
    to the head with ``min(counter, 3) - 1``, the first at 0 is the victim.

    Pinned pages are passed over: they go to the head of the queue they are in, counter unchanged. When
    every page left in the chosen queue is pinned, the victim comes from the other queue. Runs in the
    native core (``CHM_POLICY_S3FIFO``, emulator/native/policy_s3fifo.c), which derives the queue sizes
    (``small_capacity``, ``main_capacity``, ``ghost_capacity``: libCacheSim's integer parts)."""

    native_name = "s3fifo"
    config_fields = (
        param("small_size_ratio", float, 0.001, 0.9, default=0.1, doc="share of the frames in the small FIFO queue"),
        param("ghost_size_ratio", float, 0.0, 8.0, default=0.9,
              doc="ghost FIFO length (page numbers evicted from the small queue), as a share of the frames"),
        param("move_to_main_threshold", int, 1, 64, default=2,
              doc="hits in the small queue that move a page to the main queue instead of evicting it"),
    )

    def native_params(self):
        p = self.params
        return {"small_size_ratio": p.small_size_ratio, "ghost_size_ratio": p.ghost_size_ratio,
                "move_to_main_threshold": p.move_to_main_threshold}

    @classmethod
    def capacity_problem(cls, capacity, params):
        small = cls(capacity, params).small_capacity
        if small < MIN_SMALL_FRAMES or small >= capacity:
            return (f"policy.s3fifo.small_size_ratio = {params.small_size_ratio:g} gives a small queue of {small} "
                    f"of the {capacity} frames; S3-FIFO needs at least {MIN_SMALL_FRAMES} there (libCacheSim admits "
                    f"no page into a 1-page small queue) and at least 1 in the main queue")
        return None

    @property
    def small_capacity(self) -> int:
        return self.info().small_capacity

    @property
    def main_capacity(self) -> int:
        return self.info().main_capacity

    @property
    def ghost_capacity(self) -> int:
        return self.info().ghost_capacity

    @property
    def threshold(self) -> int:
        return self.info().threshold


register("s3fifo", S3FifoOrder)
