"""Hash spec v1: golden vectors lock it; properties show prefix sharing and divergence."""

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.hashing import Namespace, chain_keys, tail_key, token_bytes

LAYOUT = (("KVCache", "float32", 2, 16, 16),) * 2
NS = Namespace("org/model", LAYOUT)

# Golden vectors of spec v1. If one of these changes, every SSD tier on disk
# becomes unreadable: bump FORMAT_VERSION instead of editing them.
GOLDEN_ROOT = "978e3227610d0ba39297b75c6502ba47"
GOLDEN_ROOT_QUANT_ADAPTER = "1141f23546bddf346cb4ff85b2b03b99"
GOLDEN_CHAIN = ["43d89fab67d2b30f72425c26ffcabbb8", "be986b6ec5223fd92da5904e3139f0ca"]
GOLDEN_TAIL = "7393e1f377d66798c37e6565266e1cd8"  # a v1 addition: tail keys
GOLDEN_ZERO_ROOT = ["4e7b4f6b8cadfb2a1b1a20c2457494c4", "bad84e898fec8dace6ba4906880b0aa0"]


def test_golden_root_keys():
    assert NS.to_json() == (
        '{"extra":{},"format":1,"kv_quant":null,"layout":[["KVCache","float32",2,16,16],'
        '["KVCache","float32",2,16,16]],"model":"org/model"}'
    )
    assert NS.root_key().hex() == GOLDEN_ROOT
    quant = Namespace("org/model", (("KVCache", "bfloat16", 8, 128, 128),), (4, 64, 0))
    assert quant.with_extra({"adapter": "a1"}).root_key().hex() == GOLDEN_ROOT_QUANT_ADAPTER


def test_golden_chain_keys():
    keys = chain_keys(NS.root_key(), token_bytes(list(range(8))), 4)
    assert [k.hex() for k in keys] == GOLDEN_CHAIN
    # The spec written out by hand: parent (16 bytes) + tokens as <u4.
    zero = chain_keys(bytes(16), token_bytes(list(range(1, 10))), 4)
    first = xxhash.xxh3_128(bytes(16) + struct.pack("<4I", 1, 2, 3, 4)).digest()
    second = xxhash.xxh3_128(first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert zero == [first, second]
    assert [k.hex() for k in zero] == GOLDEN_ZERO_ROOT


def test_golden_tail_key():
    tail = tail_key(bytes(16), token_bytes([1, 2, 3]))
    by_hand = b"prefixcache/v1/tail\0" + bytes(16) + struct.pack("<3I", 1, 2, 3)
    assert tail == xxhash.xxh3_128(by_hand).digest()
    assert tail.hex() == GOLDEN_TAIL
    # never a block key: a block of the same tokens under the same parent differs
    assert tail != chain_keys(bytes(16), token_bytes([1, 2, 3]), 3)[0]


def test_only_full_blocks_are_keyed():
    root = NS.root_key()
    assert chain_keys(root, token_bytes([1, 2, 3]), 4) == []
    assert len(chain_keys(root, token_bytes(list(range(11))), 4)) == 2


@pytest.mark.parametrize(
    "other",
    [
        Namespace("org/other", LAYOUT),
        Namespace("org/model", (("KVCache", "bfloat16", 2, 16, 16),) * 2),
        Namespace("org/model", LAYOUT, (8, 64, 0)),
        Namespace("org/model", LAYOUT, (8, 64, 512)),
        NS.with_extra({"adapter": "x"}),
        NS.with_extra({"salt": "user-1"}),
    ],
)
def test_namespace_parts_change_the_root(other):
    assert other.root_key() != NS.root_key()


def test_token_validation():
    assert token_bytes(np.array([1, 2], dtype=np.int64)) == struct.pack("<2I", 1, 2)
    assert token_bytes([2**32 - 1]) == b"\xff\xff\xff\xff"
    with pytest.raises(ValueError, match="-1"):
        token_bytes([1, -1])
    with pytest.raises(ValueError, match=str(2**32)):
        token_bytes([2**32])
    with pytest.raises(TypeError, match=r"1\.5"):
        token_bytes([1, 1.5])
    with pytest.raises(TypeError, match="'a'"):
        token_bytes([1, "a"])
    with pytest.raises(ValueError, match="flat"):
        token_bytes([[1, 2]])
    with pytest.raises(TypeError, match="str to str"):
        NS.with_extra({"salt": 3})


tokens = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40)


@given(prefix=tokens, a=tokens, b=tokens, block=st.integers(1, 8))
def test_shared_prefix_equal_keys_divergence_differs(prefix, a, b, block):
    root = NS.root_key()
    ka = chain_keys(root, token_bytes(prefix + a), block)
    kb = chain_keys(root, token_bytes(prefix + b), block)
    shared = len(prefix) // block
    assert ka[:shared] == kb[:shared]
    # From the first block whose tokens differ, every key differs.
    ta, tb = prefix + a, prefix + b
    for i in range(min(len(ka), len(kb))):
        if ta[: (i + 1) * block] != tb[: (i + 1) * block]:
            assert all(x != y for x, y in zip(ka[i:], kb[i:], strict=False))
            break
        assert ka[i] == kb[i]
