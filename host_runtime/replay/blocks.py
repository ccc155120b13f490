"""Block keys as the replay's readers and its native loop share them: how an object's blocks are keyed, their
record layout for the loop, and the signal that a stream came out of time order."""

import numpy as np

OBJECT_BLOCK_BITS = 24  # key of block j of object o: o << OBJECT_BLOCK_BITS | j
MAX_OBJECT_BLOCKS = 1 << OBJECT_BLOCK_BITS
KEY_DTYPE = np.dtype([("lo", "<u8"), ("hi", "<u8")])  # rp_key: a block key as the Master's 16-byte key
_U64 = 1 << 64


class OutOfOrder(Exception):
    """A stream starts before an event already run (a trace out of time order): feed each phase whole."""


def key_array(keys) -> np.ndarray:
    """Block keys (non-negative ints, at most 128 bits) as rp_key records."""
    out = np.empty(len(keys), KEY_DTYPE)
    try:
        out["lo"] = np.asarray(keys, dtype=np.uint64)
        out["hi"] = 0
    except OverflowError:  # a key past 64 bits
        out["lo"] = [k % _U64 for k in keys]
        out["hi"] = [k >> 64 for k in keys]
    return out
