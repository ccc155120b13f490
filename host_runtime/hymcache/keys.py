"""Block keys: chained digests of a token prefix, salted with the model.

A block of ``tokens_per_block`` tokens is keyed by everything before it:

    d_-1 = fingerprint.salt()                       (SHA-256 of the model fingerprint)
    d_i  = SHA-256(d_{i-1} || token ids of block i, each 4 bytes little-endian)

as SGLang's HiCache keys its pages. The salt is there because vLLM's block
hashes leave the model out: two models (or two KV dtypes, layouts or block
sizes) never share a key. The Master keys blocks by the digest truncated to
``KEY_BYTES`` (16): a collision among 2^64 stored blocks is needed before two
prefixes alias, and a wrong block would still fail its checksum.

Mooncake traces give one ``hash_id`` per 512 tokens and no token ids, so a
hash id stands for ``512 // chunk_size`` blocks, chained the same way:
``d = SHA-256(d_prev || hash_id as 8 bytes LE || sub-block index as 4 bytes LE)``.
"""

from __future__ import annotations

import errno
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from driver.errors import ChmError

from .messages import KEY_BYTES

DIGEST_BYTES = 32            # SHA-256
MOONCAKE_HASH_TOKENS = 512   # tokens covered by one Mooncake trace hash_id
_SALT_FORMAT = "hymcache-key-v1"  # bump if the key derivation ever changes: old keys must not match


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes two KV blocks of the same tokens interchangeable."""

    model: str             # e.g. "HuggingFaceTB/SmolLM2-135M"
    kv_dtype: str          # the stored KV's dtype, e.g. "float32"
    layout: str            # e.g. "layer,kv,token,head,dim"
    tokens_per_block: int  # chunk_size

    def __post_init__(self):
        for field in ("model", "kv_dtype", "layout"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ChmError(errno.EINVAL, f"ModelFingerprint.{field} {value!r} must be a non-empty string")
        tpb = self.tokens_per_block
        if isinstance(tpb, bool) or not isinstance(tpb, int) or not 1 <= tpb <= 1 << 20:
            raise ChmError(errno.EINVAL, f"ModelFingerprint.tokens_per_block {tpb!r} must be an int in [1, {1 << 20}]")

    def salt(self) -> bytes:
        """SHA-256 of a canonical text of the fields (a JSON list: no separator inside a field can alias)."""
        text = json.dumps([_SALT_FORMAT, self.model, self.kv_dtype, self.layout, self.tokens_per_block],
                          ensure_ascii=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()


def _check_block_size(tokens_per_block: int, fingerprint: ModelFingerprint, field: str) -> None:
    if not isinstance(fingerprint, ModelFingerprint):
        raise ChmError(errno.EINVAL, f"fingerprint {fingerprint!r} must be a ModelFingerprint")
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, (int, np.integer)):
        raise ChmError(errno.EINVAL, f"{field} {tokens_per_block!r} must be an int")
    if tokens_per_block != fingerprint.tokens_per_block:
        raise ChmError(errno.EINVAL, f"{field} {tokens_per_block} differs from the fingerprint's tokens_per_block "
                                     f"{fingerprint.tokens_per_block}: keys would not match stored blocks")


def _as_uint(values, bits: int, field: str) -> np.ndarray:
    """``values`` as a 1-D array of unsigned ints of ``bits`` bits, little-endian; ChmError naming the bad one."""
    arr = np.asarray(values)
    if arr.dtype.kind == "f" and isinstance(values, (list, tuple)):  # ints past int64 make numpy guess float
        arr = np.array(values, dtype=object)
    if arr.ndim != 1:
        raise ChmError(errno.EINVAL, f"{field} must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(f"<u{bits // 8}")
    if arr.dtype == object:  # Python ints beyond int64: check one by one
        for i, v in enumerate(arr):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 1 << bits:
                raise ChmError(errno.EINVAL, f"{field}[{i}] = {v!r} must be an int in [0, 2^{bits})")
        return np.array([int(v) for v in arr], dtype=f"<u{bits // 8}")
    if arr.dtype.kind not in "iu":
        raise ChmError(errno.EINVAL, f"{field} must hold ints, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr.astype(np.float64) >= float(1 << bits)))
    if bad.size:
        i = int(bad[0])
        raise ChmError(errno.EINVAL, f"{field}[{i}] = {int(arr[i])} must be in [0, 2^{bits})")
    return arr.astype(f"<u{bits // 8}")


def block_digests(token_ids, tokens_per_block: int, fingerprint: ModelFingerprint) -> list[bytes]:
    """One 32-byte digest per FULL block of ``token_ids`` (a trailing partial block has no key)."""
    _check_block_size(tokens_per_block, fingerprint, "tokens_per_block")
    tokens = _as_uint(token_ids, 32, "token_ids").tobytes()
    block_bytes = 4 * tokens_per_block
    digests, prev = [], fingerprint.salt()
    for start in range(0, len(tokens) - block_bytes + 1, block_bytes):
        prev = hashlib.sha256(prev + tokens[start:start + block_bytes]).digest()
        digests.append(prev)
    return digests


def block_keys(token_ids, tokens_per_block: int, fingerprint: ModelFingerprint) -> list[bytes]:
    """The Master's keys of the full blocks of ``token_ids``: the digests truncated to KEY_BYTES."""
    return [d[:KEY_BYTES] for d in block_digests(token_ids, tokens_per_block, fingerprint)]


def mooncake_keys(hash_ids, chunk_size: int, fingerprint: ModelFingerprint) -> list[bytes]:
    """``512 // chunk_size`` keys per Mooncake hash id, chained in order across the whole list."""
    _check_block_size(chunk_size, fingerprint, "chunk_size")
    if MOONCAKE_HASH_TOKENS % chunk_size:
        raise ChmError(errno.EINVAL, f"chunk_size {chunk_size} must divide {MOONCAKE_HASH_TOKENS} "
                                     f"(the tokens of one Mooncake hash_id)")
    ids = _as_uint(hash_ids, 64, "hash_ids")
    per_id = MOONCAKE_HASH_TOKENS // chunk_size
    keys, prev = [], fingerprint.salt()
    for hash_id in ids.tolist():
        id_bytes = hash_id.to_bytes(8, "little")
        for sub in range(per_id):
            prev = hashlib.sha256(prev + id_bytes + sub.to_bytes(4, "little")).digest()
            keys.append(prev[:KEY_BYTES])
    return keys
