"""Remote tier format: a block's keys, its meta value and its self-describing parts.

A block is stored under the namespace ``prefix`` and its name (its chain key;
with ``remote_secret`` a keyed hash of it), in braces: a Redis Cluster hash
tag, so that a block's meta, parts and children listing live on one shard and its
fetch is one pipeline to one server::

    {prefix}:{name hex}:m        meta: plain head, then the body (block key, parent key,
                                 token ids, part digests, tensor specs), checksummed or sealed
    {prefix}:{name hex}:p:{n}    part n: header (magic, name, n, count, digest) + bytes
    {prefix}:{name hex}:l        the block's children (blocks and tails), in token order
                                 (a sorted set: listing.py)
    {prefix}:{name hex}:t        the tenant the block is charged to (UTF-8, sealed with a
                                 secret); none for the default tenant
    {prefix}:ns:{root hex}       the namespace JSON a root key stands for (inspection)
    {prefix}:counters            forged, corrupt and missing-part blocks every host met

Block keys are the package's chain keys (``prefixcache.hashing``, the SSD
tier's too). The payload is the tensors' bytes back to back, cut into parts of
at most ``PART_BYTES`` (a 256-token block of an 8B bf16 model is ~32 MiB;
Redis values stay small enough to move without stalling the server). A part
names its block and number and carries its digest (xxh3-128, or its MAC with
a secret), and the meta lists every part's digest: a part that was evicted,
left over from another version of the block, or torn is detected and becomes
a counted miss, never a wrong restore. The meta's head (root, index, sizes)
stays plain so that inspection and ``gc`` work without the secret. The tenant
is a key of its own (tenant.py), not a field of the meta. Bytes and numpy
only: it runs on background threads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ...blocks import BlockHeader
from ...errors import PayloadError
from ...hashing import TOKEN_BYTES
from ...memory.host import MX_DTYPES, Tensor
from .names import Names
from .seal import DIGEST_BYTES, Forged, digest_of, part_hasher, same_digest

if TYPE_CHECKING:
    from ...blocks import Block

FORMAT = 2
PART_BYTES = 4 << 20
SIGNED = 1  # flag: the value is signed (part) or sealed (meta) with remote_secret
TENANT = 2  # meta flag: the block has a tenant key (tenant.py); other readers ignore it
_META_HEAD = struct.Struct("<4sBB2x16sIIIQ")  # magic, format, flags, root, index, ...
_META_MAGIC = b"PCRM"
_KEYS = struct.Struct("<16s16s")  # block key, parent key: the body's start
_PART_HEAD = struct.Struct("<4sBB2x16sII16s")  # magic, format, flags, name, n, count, digest
_PART_MAGIC = b"PCRP"
PART_HEAD_BYTES = _PART_HEAD.size
Spec = tuple[str, str, tuple[int, ...]]  # name, safetensors dtype, shape


@dataclass(frozen=True, slots=True)
class MetaHead:
    """A meta's plain head: readable without the secret (inspection, gc)."""

    root: bytes
    index: int
    num_tokens: int
    num_parts: int
    nbytes: int
    signed: bool
    tenant: bool = False  # the block has a tenant key


@dataclass(frozen=True, slots=True)
class RemoteMeta(BlockHeader):
    """A block's meta value: its header and how to read its parts."""

    nbytes: int  # payload bytes (all parts' data)
    digests: tuple[bytes, ...]  # each part's digest (xxh3-128, or MAC)
    specs: tuple[Spec, ...]  # the tensors, in payload order
    has_tenant: bool = False  # the block's tenant is in its tenant key (tenant.py)

    @property
    def num_parts(self) -> int:
        return len(self.digests)


def encode_meta(meta: RemoteMeta, names: Names) -> bytes:
    seal = names.seal
    head = _META_HEAD.pack(
        _META_MAGIC,
        FORMAT,
        (SIGNED if seal else 0) | (TENANT if meta.has_tenant else 0),
        meta.root,
        meta.index,
        len(meta.tokens) // TOKEN_BYTES,
        meta.num_parts,
        meta.nbytes,
    )
    specs = json.dumps([[n, d, list(s)] for n, d, s in meta.specs], separators=(",", ":"))
    body = b"".join([_KEYS.pack(meta.key, meta.parent), meta.tokens, *meta.digests, specs.encode()])
    if seal is not None:
        return head + seal.seal(body, head + names.name(meta.key))
    return head + body + xxhash.xxh3_64_digest(head + body)


def block_meta(block: Block, tensors: list[Tensor], digests: list[bytes], names: Names) -> bytes:
    """The meta value of ``block`` whose payload is ``tensors`` in parts of ``digests``."""
    specs = tuple((t.name, t.dtype, t.shape) for t in tensors)
    nbytes = sum(t.data.nbytes for t in tensors)
    meta = RemoteMeta(
        block.key,
        block.parent,
        block.root,
        block.index,
        block.tokens,
        nbytes,
        tuple(digests),
        specs,
        bool(block.tenant),
    )
    return encode_meta(meta, names)


def decode_head(value: bytes) -> MetaHead:
    """A meta value's plain head.

    Raises:
        PayloadError: truncated, or not a meta of this format.
    """
    if len(value) < _META_HEAD.size:
        raise PayloadError("remote meta is truncated")
    magic, fmt, flags, root, index, num_tokens, num_parts, nbytes = _META_HEAD.unpack_from(value)
    if magic != _META_MAGIC or fmt != FORMAT:
        raise PayloadError(f"remote meta of format {fmt} (magic {magic!r}); this is {FORMAT}")
    if num_parts != parts_of(nbytes):
        raise PayloadError(f"remote meta: {num_parts} parts cannot hold {nbytes} bytes")
    signed, tenant = bool(flags & SIGNED), bool(flags & TENANT)
    return MetaHead(root, index, num_tokens, num_parts, nbytes, signed, tenant)


def decode_meta(name: bytes, value: bytes, names: Names, key: bytes | None = None) -> RemoteMeta:
    """Decode the meta value stored under ``name`` (of block ``key``, if known).

    Raises:
        Forged: fails its MAC, or plain where a secret is set.
        PayloadError: truncated, another format or block, or a bad checksum.
    """
    what = f"remote meta of {(key or name).hex()}"
    head = decode_head(value)
    raw_head = value[: _META_HEAD.size]
    if names.seal is not None:
        if not head.signed:
            raise Forged(f"{what} is not signed but remote_secret is set")
        body = names.seal.open(value[_META_HEAD.size :], raw_head + name, what)
    elif head.signed:
        raise PayloadError(f"{what} is sealed with a remote_secret this host does not have")
    elif xxhash.xxh3_64_digest(value[:-8]) != value[-8:]:
        raise PayloadError(f"{what} fails its checksum")
    else:
        body = value[_META_HEAD.size : -8]
    meta = _decode_body(head, body, what)
    if names.name(meta.key) != name or key not in (None, meta.key):
        raise PayloadError(f"{what} holds block {meta.key.hex()}")
    return meta


def _decode_body(head: MetaHead, body: bytes, what: str) -> RemoteMeta:
    at = _KEYS.size + TOKEN_BYTES * head.num_tokens
    ends = at + DIGEST_BYTES * head.num_parts
    if len(body) < ends:
        raise PayloadError(f"{what} is truncated")
    key, parent = _KEYS.unpack_from(body)
    digests = tuple(body[i : i + DIGEST_BYTES] for i in range(at, ends, DIGEST_BYTES))
    try:
        specs = tuple((n, d, tuple(s)) for n, d, s in json.loads(body[ends:]))
        covered = sum(spec_bytes(s) for s in specs)
    except (ValueError, TypeError, PayloadError) as e:
        raise PayloadError(f"{what}: bad tensor specs: {e}") from None
    if covered != head.nbytes:
        raise PayloadError(f"{what}: specs do not cover {head.nbytes} bytes")
    tokens = body[_KEYS.size : at]
    h = head
    return RemoteMeta(key, parent, h.root, h.index, tokens, h.nbytes, digests, specs, h.tenant)


def parts_of(nbytes: int) -> int:
    return -(-nbytes // PART_BYTES)


def encode_parts(
    key: bytes, tensors: list[Tensor], names: Names
) -> tuple[list[bytearray], list[bytes]]:
    """The parts of a payload (one copy of the tensors' bytes) and their digests."""
    views = [t.data for t in tensors if t.data.nbytes]
    total = sum(v.nbytes for v in views)
    num = parts_of(total)
    name, flags = names.name(key), SIGNED if names.seal else 0
    parts, digests = [], []
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
        hasher = part_hasher(names.seal, key, n, num)
        hasher.update(out)
        digest = digest_of(hasher)
        _PART_HEAD.pack_into(buf, 0, _PART_MAGIC, FORMAT, flags, name, n, num, digest)
        parts.append(buf)
        digests.append(digest)
    return parts, digests


def part_digest(meta: RemoteMeta, names: Names, n: int, head: bytes, size: int) -> bytes:
    """The digest part ``n``'s header ``head`` gives for its ``size`` bytes, once
    the header names block ``meta``, part ``n`` and the meta's part count, the
    size is right and the digest is the meta's (the bytes are not hashed here:
    fill.py hashes them as they arrive).

    Raises:
        Forged: a plain part where a secret is set.
        PayloadError: another block's or version's part, or torn.
    """
    what = f"remote part {n} of {meta.key.hex()}"
    if len(head) < _PART_HEAD.size:
        raise PayloadError(f"{what} is truncated")
    magic, fmt, flags, name, got, num, digest = _PART_HEAD.unpack_from(head)
    want = min(PART_BYTES, meta.nbytes - n * PART_BYTES)
    if (magic, fmt, name, got, num) != (
        _PART_MAGIC,
        FORMAT,
        names.name(meta.key),
        n,
        meta.num_parts,
    ) or size != want:
        raise PayloadError(f"{what} does not belong to it")
    if names.seal is not None and not flags & SIGNED:
        raise Forged(f"{what} is not signed but remote_secret is set")
    if not same_digest(digest, meta.digests[n]):
        raise PayloadError(f"{what} is of another version")
    return digest


def check_part(meta: RemoteMeta, names: Names, n: int, value: bytes) -> memoryview:
    """Part ``n``'s bytes, verified against its own header and the meta.

    Raises:
        Forged: its bytes fail their MAC (with a secret).
        PayloadError: another block's or version's part, torn, or a bad checksum.
    """
    data = memoryview(value)[_PART_HEAD.size :]
    digest = part_digest(meta, names, n, value, len(data))
    hasher = part_hasher(names.seal, meta.key, n, meta.num_parts)
    hasher.update(data)
    if not same_digest(digest_of(hasher), digest):
        raise bad_bytes(meta, names, n)
    return data


def bad_bytes(meta: RemoteMeta, names: Names, n: int) -> PayloadError:
    """The error of part ``n`` whose bytes do not match its digest."""
    what = f"remote part {n} of {meta.key.hex()}"
    if names.seal is not None:
        return Forged(f"{what} fails its MAC (changed after it was signed)")
    return PayloadError(f"{what} fails its checksum")


def spec_bytes(spec: Spec) -> int:
    _, dtype, shape = spec
    if dtype not in MX_DTYPES or any(d < 0 for d in shape):
        raise PayloadError(f"bad tensor spec {spec!r}")
    return int(np.prod(shape, dtype=np.int64)) * MX_DTYPES[dtype].size
