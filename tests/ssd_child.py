"""Blocks for SSD tests, and a child process that writes or verifies an SSD tier.

Every block's arrays are a pure function of its key, so any process can check
a loaded block: values encode the position of each element plus a per-block
offset (as raw bit patterns, so f16/bf16/f32 cover NaN, inf, -0, subnormals).

    python ssd_child.py write DIR SEED COUNT [--wait]   # prints "put i" per block
    python ssd_child.py write DIR SEED COUNT --shares TENANT MAX_BYTES FLOORS
        # each block TENANT's, one-block chains, under ssd_max_bytes and ssd_tenant_floors
    python ssd_child.py verify DIR                       # prints "ok N" or fails
"""

from __future__ import annotations

import dataclasses
import sys

import mlx.core as mx
import numpy as np
import xxhash

from prefixcache.blocks import Block
from prefixcache.config import CacheConfig
from prefixcache.tiers.ssd.tier import SsdTier

ROOT = b"\x00" * 16
# name -> (dtype, its same-size unsigned view, shape (B, kv_heads, T, head_dim))
LAYOUT = {
    "0.keys": (mx.bfloat16, mx.uint16, (1, 2, 16, 8)),
    "0.values": (mx.float16, mx.uint16, (1, 2, 16, 8)),
    "1.keys": (mx.float32, mx.uint32, (1, 2, 16, 8)),
    "1.values": (mx.uint32, mx.uint32, (1, 2, 16, 8)),
}


def block_key(seed: int, index: int) -> bytes:
    return xxhash.xxh3_128_digest(seed.to_bytes(8, "little") + index.to_bytes(8, "little"))


def expected_bits(key: bytes, scale: int = 1) -> dict[str, np.ndarray]:
    """Unsigned bit patterns of each array: position * 7 + a per-block offset."""
    base = int.from_bytes(key[:4], "little")
    out = {}
    for i, (name, (_, udtype, shape)) in enumerate(LAYOUT.items()):
        shape = (*shape[:2], shape[2] * scale, shape[3])
        count = int(np.prod(shape))
        np_udtype = np.uint16 if udtype == mx.uint16 else np.uint32
        pos = np.arange(count, dtype=np.uint64) * 7 + base + i
        out[name] = (pos % (1 << (8 * np.dtype(np_udtype).itemsize))).astype(np_udtype)
        out[name] = out[name].reshape(shape)
    return out


def make_block(seed: int, index: int, *, scale: int = 1, parent: bytes | None = None) -> Block:
    """Block ``index`` of chain ``seed`` (parent: the previous block of the chain)."""
    key = block_key(seed, index)
    if parent is None:
        parent = ROOT if index == 0 else block_key(seed, index - 1)
    arrays = {}
    for name, bits in expected_bits(key, scale).items():
        dtype, udtype, _ = LAYOUT[name]
        arrays[name] = mx.array(bits).view(dtype) if dtype != udtype else mx.array(bits)
    mx.eval(arrays)
    tokens = (np.arange(16, dtype="<u4") + index * 16).tobytes()
    return Block.make(key, parent, ROOT, index, tokens, arrays)


def check_block(block: Block, scale: int = 1) -> None:
    """Assert a loaded block holds exactly the bits it was made with."""
    want = expected_bits(block.key, scale)
    assert list(block.arrays) == list(want)
    for name, bits in want.items():
        dtype, udtype, _ = LAYOUT[name]
        arr = block.arrays[name]
        assert arr.dtype == dtype, (name, arr.dtype)
        got = np.array(arr.view(udtype) if dtype != udtype else arr)
        np.testing.assert_array_equal(got, bits, err_msg=name)
    assert block.tokens == (np.arange(16, dtype="<u4") + block.index * 16).tobytes()


def write(path: str, seed: int, count: int, wait: bool, shares: list[str]) -> None:
    tenant, max_bytes, floors = shares or ("", str(1 << 40), "")
    tier = SsdTier(
        CacheConfig(
            ssd_run_tokens=0,
            ssd_dir=path,
            ssd_max_bytes=int(max_bytes),
            write_queue_bytes=1 << 20,
            queue_full="inline",
            ssd_min_free_bytes=0,
            ssd_tenant_floors=floors,
        )
    )
    if wait:  # start together with a sibling: the parent sends a line when both are ready
        print("ready", flush=True)
        sys.stdin.readline()
    for i in range(count):
        block = make_block(seed, i)
        if shares:  # a chain of one: every block a leaf, evictable
            block = dataclasses.replace(block, parent=ROOT, tenant=tenant)
        tier.put(block)
        if shares and i % 4 == 3:
            tier.flush()
        print(f"put {i}", flush=True)
    tier.close()
    print("done", flush=True)


def verify(path: str) -> None:
    tier = SsdTier(
        CacheConfig(ssd_run_tokens=0, ssd_dir=path, ssd_max_bytes=1 << 40, ssd_min_free_bytes=0)
    )
    num = 0
    for meta in tier.iter_meta():
        block = tier.load(meta.key)
        assert block is not None, meta.key.hex()
        check_block(block)
        num += 1
    assert tier.stats()["num_corrupt"] == 0
    tier.close()
    print(f"ok {num}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        at = sys.argv.index("--shares") + 1 if "--shares" in sys.argv else len(sys.argv)
        shares = sys.argv[at : at + 3]
        write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "--wait" in sys.argv, shares)
    else:
        verify(sys.argv[2])
