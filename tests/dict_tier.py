"""A test-only lower tier in one file: proof that the tier contract is enough.

Blocks are kept as safetensors bytes in a dict (as a remote store would hold
them): ``put`` serializes, a reader deserializes into fresh MLX arrays.
``PlainDictTier`` implements :class:`prefixcache.tiers.base.Tier` and nothing
else; ``DictTier`` adds ``ListsChildren`` (tails go to it). Each is handed to
``PrefixCache(..., tiers=[DictTier()])``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from prefixcache.blocks import Block
from prefixcache.tiers.base import ListsChildren, Tier, TierReader


@dataclass(frozen=True, slots=True)
class Entry:
    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes
    nbytes: int
    payload: bytes


class PlainDictTier(Tier):
    """The tier contract's required part: blocks by key (tails never come here)."""

    name = "remote"

    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.num_puts = self.num_loads = 0
        self.closed = False

    def entry(self, key: bytes) -> Entry | None:
        return self.entries.get(key)

    def contains(self, key: bytes) -> bool:
        return key in self.entries

    def reader(self, keys: Sequence[bytes]) -> TierReader:
        return _Reader(self, keys)

    def put(self, block: Block) -> bool:
        buf = io.BytesIO()
        mx.save_safetensors(buf, dict(block.arrays))
        b = block
        self.entries[b.key] = Entry(
            b.key, b.parent, b.root, b.index, b.tokens, b.nbytes, buf.getvalue()
        )
        self.num_puts += 1
        return True

    def remove(self, keys: Sequence[bytes]) -> int:
        return sum(self.entries.pop(k, None) is not None for k in keys)

    def close(self) -> None:
        self.closed = True

    def stats(self) -> dict[str, int]:
        return {"num_blocks": len(self.entries), "num_loads": self.num_loads}


class DictTier(ListsChildren, PlainDictTier):
    """And what it holds under a parent: tails come here and are found."""

    def children(self, parent: bytes, near: bytes | None = None) -> list[Entry]:
        return [e for e in self.entries.values() if e.parent == parent]


class _Reader(TierReader):
    def __init__(self, tier: PlainDictTier, keys: Sequence[bytes]):
        self.tier, self.keys = tier, keys

    def load(self, index: int) -> Block | None:
        e = self.tier.entries.get(self.keys[index])
        if e is None:
            return None
        arrays = mx.load(io.BytesIO(e.payload), format="safetensors")
        mx.eval(arrays)
        self.tier.num_loads += 1
        return Block(e.key, e.parent, e.root, e.index, e.tokens, arrays, e.nbytes)
