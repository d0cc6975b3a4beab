"""Block: one full block of tokens and its cache payload, as the tiers hold it."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import xxhash

from .hashing import TOKEN_BYTES

KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """Where a block sits: the fields every record of a block starts with (the hot
    tier's Block, the SSD index's BlockMeta, the remote tier's meta, a streamed block).

    Attributes:
        key: 16-byte chain key of this block (see hashing.py).
        parent: key of the previous block, or the namespace root key.
        root: namespace root key (which model / layout the block belongs to).
        index: position in the chain; the block holds tokens
            ``[index * block_size, (index + 1) * block_size)`` (a tail: fewer).
        tokens: the block's token ids as little-endian uint32 bytes; compared
            on every hit (collision guard).
    """

    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES


class Run:
    """Consecutive full blocks cut together (by one capture), kept as one array per
    payload name: each (B, heads, n * block_size, dim), block ``first + j`` being
    tokens ``[j * block_size, (j + 1) * block_size)`` of it. Its blocks' arrays are
    views (slices) of these, so the memory lives until the last of them goes (the
    hot tier charges it as one buffer: tiers/hot/runs.py), and a restore copies a
    segment of consecutive blocks in one copy per name (memory/runs.py). A run may
    hold some layers only (the plain K/V ones of a model with window or recurrent
    layers): its blocks own their other layers' arrays.

    Attributes:
        arrays: the run's arrays by flat payload name (``"{layer}.{name}"``).
        layers: the layers whose payloads it holds.
        first: chain index of its first block.
        num_blocks, block_size: its length in blocks, and tokens per block.
        nbytes: bytes of its arrays (the memory it holds).
        block_nbytes: bytes of one block's slice of them.
        host: host bytes of its arrays by name, made on a first restore.
    """

    __slots__ = (
        "arrays",
        "block_nbytes",
        "block_size",
        "first",
        "host",
        "layers",
        "nbytes",
        "num_blocks",
    )

    def __init__(self, arrays: dict[str, mx.array], first: int, num_blocks: int, block_size: int):
        self.arrays, self.first = arrays, first
        self.num_blocks, self.block_size = num_blocks, block_size
        self.nbytes = sum(a.nbytes for a in arrays.values())
        self.block_nbytes = self.nbytes // num_blocks
        self.layers = frozenset(int(name.partition(".")[0]) for name in arrays)
        self.host: dict[str, Any] = {}  # numpy views (memory/runs.py)

    def slices(self, j: int) -> dict[str, mx.array]:
        """Block ``first + j``'s arrays: views of the run's (not yet evaluated)."""
        lo, hi = j * self.block_size, (j + 1) * self.block_size
        return {name: a[:, :, lo:hi, :] for name, a in self.arrays.items()}


@dataclass(frozen=True, slots=True)
class Block(BlockHeader):
    """One cached block: its header and its payload.

    Attributes:
        arrays: flat payload ``"{layer}.{name}" -> mx.array``; each array is
            contiguous and owned by the block, or a view of its ``run``'s arrays
            (never a view of a live cache).
        nbytes: payload bytes of the arrays.
        tenant: the tenant charged for it in every tier (tenant shares), "" for none.
        run: the run the arrays are views of (``Run``), or None: they own their memory.
    """

    arrays: dict[str, mx.array] = field(repr=False)
    nbytes: int = 0
    tenant: str = ""
    run: Run | None = field(default=None, repr=False, compare=False)

    @classmethod
    def make(
        cls,
        key: bytes,
        parent: bytes,
        root: bytes,
        index: int,
        tokens: bytes,
        arrays: dict[str, mx.array],
        tenant: str = "",
        run: Run | None = None,
    ) -> Block:
        nbytes = sum(a.nbytes for a in arrays.values())
        return cls(key, parent, root, index, tokens, arrays, nbytes, tenant, run)

    def to_block(self) -> Block:
        return self


def split_layers(arrays: dict[str, mx.array]) -> dict[int, dict[str, mx.array]]:
    """Group a flat ``"{layer}.{name}"`` payload by layer in one pass."""
    out: dict[int, dict[str, mx.array]] = {}
    for name, arr in arrays.items():
        parts = _PARTS.get(name)
        if parts is None:
            layer, _, rest = name.partition(".")
            parts = (int(layer), rest)
            if len(_PARTS) < _MAX_PARTS:
                _PARTS[name] = parts
        out.setdefault(parts[0], {})[parts[1]] = arr
    return out


# payload name -> (layer, name in the layer): a restore splits every block's names
_PARTS: dict[str, tuple[int, str]] = {}
_MAX_PARTS = 1 << 16


def join_layers(layers: list[dict[str, mx.array]]) -> dict[str, mx.array]:
    """Flatten per-layer payloads into one ``"{layer}.{name}"`` dict."""
    return {f"{i}.{name}": arr for i, layer in enumerate(layers) for name, arr in layer.items()}


@dataclass(frozen=True, slots=True)
class BlockMeta(BlockHeader):
    """What the SSD index keeps about a block: its header and, of its payload,
    only sizes, checksum and times.

    Attributes:
        nbytes: payload bytes of the block's arrays.
        file_bytes: size of the payload file on disk (0 while still queued).
        checksum: xxh3-64 of the payload file's bytes (0 while still queued).
        created: time.time() when the block was indexed (or queued).
        last_used: time.time() of the last load or touch (LRU order).
        tenant: the tenant charged for it (tenant shares); "" for none, and for
            every entry of an index written before tenants were recorded.
    """

    nbytes: int
    file_bytes: int
    checksum: int
    created: float
    last_used: float
    tenant: str = ""

    @classmethod
    def of(
        cls, block: Block, *, file_bytes: int = 0, checksum: int = 0, now: float = 0.0
    ) -> BlockMeta:
        nbytes = block.nbytes or sum(a.nbytes for a in block.arrays.values())
        return cls(
            block.key,
            block.parent,
            block.root,
            block.index,
            block.tokens,
            nbytes,
            file_bytes,
            checksum,
            now,
            now,
            block.tenant,
        )


# Index entry: fixed header, the token ids, the tenant's name (UTF-8; format 2 on),
# then xxh3-64 of everything before it. Format 1 entries (no tenant) still decode.
META_FORMAT = 2
_META_FORMATS = (1, 2)
_META_HEAD = struct.Struct("<BxxxI16s16sQQQddI")


def encode_meta(meta: BlockMeta) -> bytes:
    """Encode a BlockMeta as a compact index value (the key is not included)."""
    head = _META_HEAD.pack(
        META_FORMAT,
        meta.index,
        meta.parent,
        meta.root,
        meta.nbytes,
        meta.file_bytes,
        meta.checksum,
        meta.created,
        meta.last_used,
        len(meta.tokens) // TOKEN_BYTES,
    )
    body = head + meta.tokens + meta.tenant.encode()
    return body + xxhash.xxh3_64_digest(body)


def decode_meta(key: bytes, value: bytes) -> BlockMeta:
    """Decode an index value written by :func:`encode_meta`.

    Raises:
        ValueError: the value is truncated, of another format or fails its checksum.
    """
    value = bytes(value)
    if len(value) < _META_HEAD.size + 8:
        raise ValueError(f"index entry too short ({len(value)} bytes)")
    body, digest = value[:-8], value[-8:]
    if xxhash.xxh3_64_digest(body) != digest:
        raise ValueError("index entry checksum mismatch")
    fmt, index, parent, root, nbytes, file_bytes, checksum, created, last_used, num_tokens = (
        _META_HEAD.unpack_from(body)
    )
    if fmt not in _META_FORMATS:
        raise ValueError(f"index entry format {fmt}, expected one of {_META_FORMATS}")
    end = _META_HEAD.size + TOKEN_BYTES * num_tokens
    tokens, rest = body[_META_HEAD.size : end], body[end:]
    if len(tokens) != TOKEN_BYTES * num_tokens or (rest and fmt == 1):
        raise ValueError(
            f"index entry has {len(body) - _META_HEAD.size} token bytes, "
            f"expected {TOKEN_BYTES * num_tokens}"
        )
    try:
        tenant = rest.decode()
    except UnicodeDecodeError:
        raise ValueError(f"index entry's tenant is not UTF-8: {rest!r}") from None
    return BlockMeta(
        key, parent, root, index, tokens, nbytes, file_bytes, checksum, created, last_used, tenant
    )
