"""Block payloads stored as LMDB values: the layout the SSD tier compares its files with.

The SSD tier keeps each payload in a file of its own and only its index in
LMDB. Here the same safetensors images are LMDB values instead: written with
one synced commit per block, read zero-copy from the map, verified, and copied
into MLX once (the best reader for that layout).
"""

from __future__ import annotations

import json
import struct
import time

import lmdb
import mlx.core as mx
import numpy as np
import xxhash

from prefixcache.blocks import Block
from prefixcache.memory.host import tensors_of
from prefixcache.tiers.ssd.payload import encode_header

_MX = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U32": mx.uint32}


def lmdb_write(blocks: list[Block], path: str) -> float:
    """Seconds to store every block's payload image as the value of its key."""
    env = lmdb.open(path, map_size=1 << 40)
    start = time.perf_counter()
    for block in blocks:
        tensors = tensors_of(block.arrays)
        value = encode_header(tensors, block.key) + b"".join(t.data for t in tensors)
        with env.begin(write=True) as txn:
            txn.put(block.key, value)
    seconds = time.perf_counter() - start
    env.close()
    return seconds


def lmdb_load(path: str, keys: list[bytes], sums: dict[bytes, int]) -> None:
    # Opened per run: pages of a live mapping survive drop_caches.
    env = lmdb.open(path, map_size=1 << 40, readonly=True, lock=False)
    with env.begin(buffers=True) as txn:
        for key in keys:
            arrays_from_buffer(txn.get(key), sums[key])
    env.close()


def arrays_from_buffer(buf, checksum: int) -> dict[str, mx.array]:
    """Verify a safetensors image in memory, copy it into MLX once, view the tensors."""
    if xxhash.xxh3_64_intdigest(buf) != checksum:
        raise ValueError("checksum mismatch")
    (length,) = struct.unpack_from("<Q", buf)
    header = json.loads(bytes(buf[8 : 8 + length]))
    header.pop("__metadata__", None)
    flat = mx.array(np.frombuffer(buf, np.uint8, offset=8 + length))
    out = {
        name: flat[v["data_offsets"][0] : v["data_offsets"][1]].view(_MX[v["dtype"]])
        for name, v in header.items()
    }
    out = {name: arr.reshape(header[name]["shape"]) for name, arr in out.items()}
    mx.eval(out)
    return out
