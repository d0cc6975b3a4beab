"""Remote tier format: key names, a block's meta value and its self-describing parts.

A block is stored under the namespace ``prefix`` as::

    {prefix}:m:{key hex}         meta: chain fields, token ids, tensor specs, part checksums
    {prefix}:p:{key hex}:{n}     part n: header (magic, block key, n, count, xxh3-64) + bytes
    {prefix}:ns:{root hex}       the namespace JSON a root key stands for (inspection)

Block keys are the chain keys of hashing.py (the SSD tier's spec). The payload
is the tensors' bytes back to back, cut into parts of at most ``PART_BYTES``
(a 256-token block of an 8B bf16 model is ~32 MiB; Redis values stay small
enough to move without stalling the server). A part names its block and
number and carries its checksum, and the meta lists every part's checksum: a
part that was evicted, left over from another version of the block, or torn
is detected and becomes a counted miss, never a wrong restore. Everything
here is bytes and numpy: it runs on background threads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ...errors import PayloadError
from ...host import MX_DTYPES, Tensor

if TYPE_CHECKING:
    from ...blocks import Block

FORMAT = 1
PART_BYTES = 4 << 20
_META_HEAD = struct.Struct("<4sB3x16s16s16sIIIQ")  # magic, format, key, parent, root, ...
_META_MAGIC = b"PCRM"
_PART_HEAD = struct.Struct("<4s16sIIQ")  # magic, block key, part, parts, xxh3-64 of the bytes
_PART_MAGIC = b"PCRP"
Spec = tuple[str, str, tuple[int, ...]]  # name, safetensors dtype, shape


def meta_key(prefix: str, key: bytes) -> str:
    return f"{prefix}:m:{key.hex()}"


def part_key(prefix: str, key: bytes, n: int) -> str:
    return f"{prefix}:p:{key.hex()}:{n}"


def namespace_key(prefix: str, root: bytes) -> str:
    return f"{prefix}:ns:{root.hex()}"


@dataclass(frozen=True, slots=True)
class RemoteMeta:
    """A block's meta value: its chain fields (a ChainEntry) and how to read its parts."""

    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes
    nbytes: int  # payload bytes (all parts' data)
    sums: tuple[int, ...]  # xxh3-64 of each part's bytes
    specs: tuple[Spec, ...]  # the tensors, in payload order

    @property
    def num_parts(self) -> int:
        return len(self.sums)


def encode_meta(meta: RemoteMeta) -> bytes:
    head = _META_HEAD.pack(
        _META_MAGIC, FORMAT, meta.key, meta.parent, meta.root,
        meta.index, len(meta.tokens) // 4, len(meta.sums), meta.nbytes,
    )  # fmt: skip
    specs = json.dumps([[n, d, list(s)] for n, d, s in meta.specs], separators=(",", ":"))
    sums = struct.pack(f"<{len(meta.sums)}Q", *meta.sums)
    body = head + meta.tokens + sums + specs.encode()
    return body + xxhash.xxh3_64_digest(body)


def block_meta(block: Block, tensors: list[Tensor], sums: list[int]) -> bytes:
    """The meta value of ``block`` whose payload is ``tensors`` in parts of ``sums``."""
    specs = tuple((t.name, t.dtype, t.shape) for t in tensors)
    nbytes = sum(t.data.nbytes for t in tensors)
    return encode_meta(
        RemoteMeta(block.key, block.parent, block.root, block.index, block.tokens, nbytes,
                   tuple(sums), specs)
    )  # fmt: skip


def decode_meta(key: bytes, value: bytes) -> RemoteMeta:
    """Decode a meta value of block ``key``.

    Raises:
        PayloadError: truncated, another format, another key or a bad checksum.
    """
    if len(value) < _META_HEAD.size + 8 or xxhash.xxh3_64_digest(value[:-8]) != value[-8:]:
        raise PayloadError(f"remote meta of {key.hex()} is truncated or fails its checksum")
    magic, fmt, got, parent, root, index, num_tokens, num_parts, nbytes = _META_HEAD.unpack_from(
        value
    )
    if magic != _META_MAGIC or fmt != FORMAT or got != key:
        raise PayloadError(f"remote meta of {key.hex()}: format {fmt}, key {got.hex()}")
    at = _META_HEAD.size
    tokens = value[at : at + 4 * num_tokens]
    at += 4 * num_tokens
    try:
        sums = struct.unpack_from(f"<{num_parts}Q", value, at)
        at += 8 * num_parts
        specs = tuple((n, d, tuple(s)) for n, d, s in json.loads(value[at:-8]))
    except (ValueError, TypeError, struct.error) as e:
        raise PayloadError(f"remote meta of {key.hex()}: bad tensor specs: {e}") from None
    if sum(spec_bytes(s) for s in specs) != nbytes or num_parts != parts_of(nbytes):
        raise PayloadError(f"remote meta of {key.hex()}: specs do not cover {nbytes} bytes")
    return RemoteMeta(key, parent, root, index, tokens, nbytes, sums, specs)


def parts_of(nbytes: int) -> int:
    return -(-nbytes // PART_BYTES)


def encode_parts(key: bytes, tensors: list[Tensor]) -> tuple[list[bytearray], list[int]]:
    """The parts of a payload (one copy of the tensors' bytes) and their checksums."""
    views = [t.data for t in tensors if t.data.nbytes]
    total = sum(v.nbytes for v in views)
    num = parts_of(total)
    parts, sums = [], []
    v, at = 0, 0  # current view, offset in it
    for n in range(num):
        size = min(PART_BYTES, total - n * PART_BYTES)
        buf = bytearray(_PART_HEAD.size + size)
        out = memoryview(buf)[_PART_HEAD.size :]
        filled = 0
        while filled < size:
            take = min(size - filled, views[v].nbytes - at)
            out[filled : filled + take] = views[v][at : at + take]
            filled, at = filled + take, at + take
            if at == views[v].nbytes:
                v, at = v + 1, 0
        checksum = xxhash.xxh3_64_intdigest(out)
        _PART_HEAD.pack_into(buf, 0, _PART_MAGIC, key, n, num, checksum)
        parts.append(buf)
        sums.append(checksum)
    return parts, sums


PART_HEAD_BYTES = _PART_HEAD.size


def part_checksum(meta: RemoteMeta, n: int, head: bytes, size: int) -> int:
    """The checksum part ``n``'s header ``head`` gives for its ``size`` bytes,
    once the header names block ``meta``, part ``n`` and the meta's part count,
    the size is right and the checksum is the meta's (the bytes are not hashed
    here: fill.py hashes them as they arrive).

    Raises:
        PayloadError: another block's or version's part, or torn.
    """
    if len(head) < _PART_HEAD.size:
        raise PayloadError(f"remote part {n} of {meta.key.hex()} is truncated")
    magic, key, got, num, checksum = _PART_HEAD.unpack_from(head)
    want = min(PART_BYTES, meta.nbytes - n * PART_BYTES)
    if (magic, key, got, num) != (_PART_MAGIC, meta.key, n, meta.num_parts) or size != want:
        raise PayloadError(f"remote part {n} of {meta.key.hex()} does not belong to it")
    if checksum != meta.sums[n]:
        raise PayloadError(f"remote part {n} of {meta.key.hex()} is of another version")
    return checksum


def check_part(meta: RemoteMeta, n: int, value: bytes) -> memoryview:
    """Part ``n``'s bytes, verified against its own header and the meta.

    Raises:
        PayloadError: another block's or version's part, torn, or a bad checksum.
    """
    data = memoryview(value)[_PART_HEAD.size :]
    checksum = part_checksum(meta, n, value, len(data))
    if xxhash.xxh3_64_intdigest(data) != checksum:
        raise PayloadError(f"remote part {n} of {meta.key.hex()} fails its checksum")
    return data


def spec_bytes(spec: Spec) -> int:
    _, dtype, shape = spec
    if dtype not in MX_DTYPES or any(d < 0 for d in shape):
        raise PayloadError(f"bad tensor spec {spec!r}")
    return int(np.prod(shape, dtype=np.int64)) * MX_DTYPES[dtype].size
