"""Codec for CacheList (falcon_h1 and others): one layer made of several caches.

Every sub-cache goes through its own registered codec; its payload names get
the sub-cache's index as a prefix (``"{j}.{name}"``), so a block may hold the
attention part of a layer but not its recurrent snapshot, and each part is
checked and rebuilt on its own terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from ..blocks import join_layers, split_layers
from ..errors import LayoutMismatchError, MissReason
from ..memory.copies import Copies
from .base import Builder, Codec, Has, Payload, Resident
from .registry import codec_for


def subs(cache: CacheList) -> list[tuple[Codec, Any]]:
    return [(codec_for(c), c) for c in cache.caches]


class CacheListCodec(Codec):
    cache_type = CacheList

    def layout(self, cache: CacheList) -> tuple[object, ...]:
        return ("CacheList", *(codec.layout(c) for codec, c in subs(cache)))

    def length(self, cache: CacheList) -> int | None:
        lengths = {codec.length(c) for codec, c in subs(cache)} - {None}
        if len(lengths) > 1:
            raise LayoutMismatchError(f"CacheList parts hold different lengths {sorted(lengths)}")
        return lengths.pop() if lengths else None

    def trimmable_at(self, fresh: CacheList, num_tokens: int) -> bool:
        return all(codec.trimmable_at(c, num_tokens) for codec, c in subs(fresh))

    def reach(self, cache: CacheList, length: int) -> int:
        return min(codec.reach(c, length) for codec, c in subs(cache))

    def cut(
        self, cache: CacheList, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        # the same "{index}.{name}" scheme as a block's layers, one level down
        return join_layers(
            [codec.cut(c, start, end, length=length, snapshot=snapshot) for codec, c in subs(cache)]
        )

    def blocks_needed(self, fresh: CacheList, num_tokens: int, block_size: int) -> Sequence[int]:
        needed = (codec.blocks_needed(c, num_tokens, block_size) for codec, c in subs(fresh))
        return tuple(sorted(set().union(*needed)))

    def missing(
        self, fresh: CacheList, num_tokens: int, block_size: int, payload: Payload
    ) -> tuple[int, MissReason] | None:
        for j, (codec, c) in enumerate(subs(fresh)):

            def part(index: int, j: int = j) -> Has | None:
                has = payload(index)
                return None if has is None else (lambda name: has(f"{j}.{name}"))

            gap = codec.missing(c, num_tokens, block_size, part)
            if gap is not None:
                return gap
        return None

    def builder(self, fresh: CacheList, num_tokens: int, capacity: int, block_size: int) -> Builder:
        return CacheListBuilder(fresh, num_tokens, capacity, block_size)


class CacheListBuilder(Builder):
    """Feeds each part's builder the blocks that part needs."""

    def __init__(self, fresh: CacheList, num_tokens: int, capacity: int, block_size: int):
        self.cache = fresh
        self.parts = [
            (
                codec.builder(c, num_tokens, capacity, block_size),
                codec.blocks_needed(c, num_tokens, block_size),
            )
            for codec, c in subs(fresh)
        ]

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        by_sub = split_layers(arrays)
        for j, (builder, needed) in enumerate(self.parts):
            if index in needed:
                builder.add(index, by_sub.get(j, {}))

    def add_resident(self, indices: Sequence[int], blocks: Sequence[Resident], prefix: str) -> bool:
        """Each part takes the blocks it needs together where it can, else one at a
        time (so a part that took them is not fed twice)."""
        for j, (builder, needed) in enumerate(self.parts):
            mine = [k for k, index in enumerate(indices) if index in needed]
            if not mine:
                continue
            sub = f"{prefix}{j}."
            taken = [indices[k] for k in mine]
            if builder.add_resident(taken, [blocks[k] for k in mine], sub):
                continue
            start = len(sub)
            payloads = [
                {n[start:]: a for n, a in blocks[k][0].items() if n.startswith(sub)} for k in mine
            ]
            builder.add_each(taken, payloads)
        return True

    def allocate(self) -> list[mx.array]:
        return [a for builder, _ in self.parts for a in builder.allocate()]

    def queue_copies(self, copies: Copies) -> None:
        for builder, _ in self.parts:
            builder.queue_copies(copies)

    def buffers(self) -> list[mx.array]:
        return [b for builder, _ in self.parts for b in builder.buffers()]

    def finish(self) -> CacheList:
        self.cache.caches = tuple(builder.finish() for builder, _ in self.parts)
        return self.cache
