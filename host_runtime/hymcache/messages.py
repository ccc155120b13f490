"""What the HyMCache processes say to each other: one definition of every
message field. msgspec Structs encoded as MessagePack arrays (``array_like``):
typed on both ends, compact on the wire, and fast to encode and decode (see
docs/hymcache.md for why msgspec). Block bytes never go in a Struct: they travel as
separate zero-copy ZeroMQ frames (``rpc.py``).
"""

from __future__ import annotations

import msgspec

KEY_BYTES = 16  # the Master's key: a chained SHA-256 digest truncated to 16 bytes (keys.py)
MAX_REQUEST_ID = 256  # characters of a request id


class DeviceInfo(msgspec.Struct, array_like=True, frozen=True):
    """One device of a storage node, as its KV Manager registers it with the Master."""

    device: int          # index of the device within its node
    node_path: str       # its chm serve node (/dev/shm/NAME): a worker on the same machine opens it with libchm
    capacity_bytes: int
    epoch: int           # chm_info.device_epoch: blocks stored under another epoch are stale


class WriteLoc(msgspec.Struct, array_like=True, frozen=True):
    """Where to write one block (Master.put_start): append-only, never over a live block."""

    key: bytes
    node: int
    device: int
    offset: int          # byte address on the device
    length: int
    version: int         # bumped each time the key is stored anew


class BlockLoc(msgspec.Struct, array_like=True, frozen=True):
    """A stored block (Master.lookup): where it is and how to check it."""

    key: bytes
    node: int
    device: int
    offset: int
    length: int
    checksum: int        # xxh3_64 of the block's bytes, given at put_end
    version: int
    lease: bytes = b""   # a lookup for a request: the Master's read lease, a capability (auth.lease_token)


class ReadToken(msgspec.Struct, array_like=True, frozen=True):
    """A block staged in device DRAM by its node's KV Manager; valid until given back (Manager.release)."""

    request_id: str
    key: bytes
    node: int
    device: int
    offset: int
    length: int
    checksum: int
    handle: int          # the Manager's prefetch handle (opaque to the worker)


def to(kind, value):
    """A decoded message (lists, as MessagePack gives them) as the Struct ``kind`` (or list[kind], ...)."""
    return msgspec.convert(value, kind)
