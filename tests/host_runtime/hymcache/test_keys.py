"""Block keys: the chained, salted digest of the issue (recomputed here from its definition)."""

import errno
import hashlib
import json

import numpy as np
import pytest

from driver.errors import ChmError
from host_runtime.hymcache.keys import ModelFingerprint, block_digests, block_keys, mooncake_keys
from host_runtime.hymcache.messages import KEY_BYTES

FP = ModelFingerprint("HuggingFaceTB/SmolLM2-135M", "float32", "layer,kv,token,head,dim", 4)


def test_digests_follow_the_definition():
    tokens = [1, 2, 3, 70000, 5, 6, 7, 8, 9]  # two full blocks of 4 and a partial one (no key)
    salt = hashlib.sha256(json.dumps(["hymcache-key-v1", FP.model, FP.kv_dtype, FP.layout, 4],
                                     separators=(",", ":")).encode()).digest()
    assert FP.salt() == salt
    d0 = hashlib.sha256(salt + b"".join(t.to_bytes(4, "little") for t in tokens[0:4])).digest()
    d1 = hashlib.sha256(d0 + b"".join(t.to_bytes(4, "little") for t in tokens[4:8])).digest()
    assert block_digests(tokens, 4, FP) == [d0, d1]
    assert block_keys(tokens, 4, FP) == [d0[:KEY_BYTES], d1[:KEY_BYTES]]
    assert block_keys(np.array(tokens, dtype=np.int64), 4, FP) == block_keys(tokens, 4, FP)  # arrays too


def test_a_key_depends_on_the_whole_prefix():
    base = list(range(16))
    changed = base.copy()
    changed[5] = 999  # in block 1
    a, b = block_keys(base, 4, FP), block_keys(changed, 4, FP)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))
    assert block_keys(base[:8], 4, FP) == a[:2]  # a prefix of the tokens keys a prefix of the blocks
    assert block_keys(base[:3], 4, FP) == []


@pytest.mark.parametrize("field, value", [("model", "other"), ("kv_dtype", "bfloat16"), ("layout", "kv,layer"),
                                          ("tokens_per_block", 8)])
def test_every_fingerprint_field_changes_the_keys(field, value):
    other = ModelFingerprint(**{**FP.__dict__, field: value})
    assert other.salt() != FP.salt()
    tokens = list(range(8))
    assert block_keys(tokens, other.tokens_per_block, other)[0] != block_keys(tokens, 4, FP)[0]


def test_mooncake_keys_chain_sub_blocks_of_each_hash_id():
    fp = ModelFingerprint("m", "float32", "l", 128)
    keys = mooncake_keys([7, 2**64 - 1], 128, fp)
    assert len(keys) == 2 * (512 // 128)
    d = fp.salt()
    expected = []
    for hash_id in (7, 2**64 - 1):
        for sub in range(4):
            d = hashlib.sha256(d + hash_id.to_bytes(8, "little") + sub.to_bytes(4, "little")).digest()
            expected.append(d[:KEY_BYTES])
    assert keys == expected
    assert len(set(keys)) == len(keys)
    assert mooncake_keys([7], 128, fp) == keys[:4]  # the same first hash id: the same first keys


@pytest.mark.parametrize("call, names", [
    (lambda: block_keys([1, -1, 2, 3], 4, FP), "token_ids[1] = -1"),
    (lambda: block_keys([1, 2, 2**32, 3], 4, FP), "token_ids[2] = 4294967296"),
    (lambda: block_keys([1.5, 2, 3, 4], 4, FP), "token_ids[0] = 1.5"),
    (lambda: block_keys(np.array([1.5, 2, 3, 4]), 4, FP), "dtype float64"),
    (lambda: block_keys([[1, 2, 3, 4]], 4, FP), "shape"),
    (lambda: block_keys([1, 2, 3, 4], 8, FP), "tokens_per_block 8 differs"),
    (lambda: mooncake_keys([1], 3, ModelFingerprint("m", "f", "l", 3)), "chunk_size 3 must divide 512"),
    (lambda: mooncake_keys([-1], 4, FP), "hash_ids[0] = -1"),
    (lambda: mooncake_keys([2**64], 4, FP), "hash_ids[0] = 18446744073709551616"),
    (lambda: ModelFingerprint("", "f", "l", 4), "model ''"),
    (lambda: ModelFingerprint("m", "f", "l", 0), "tokens_per_block 0"),
    (lambda: ModelFingerprint("m", "f", "l", True), "tokens_per_block True"),
])
def test_bad_input_names_the_field_and_value(call, names):
    with pytest.raises(ChmError) as err:
        call()
    assert err.value.errno == errno.EINVAL
    assert names in str(err.value)
