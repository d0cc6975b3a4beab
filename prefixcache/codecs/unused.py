"""Codec for a layer the model never writes (nemotron-nas's no-op attention blocks).

``make_prompt_cache`` gives such a layer a KVCache that stays empty whatever the
prompt: it is stored as nothing and restored empty. ``ModelLayout`` finds these
layers in its one-token probe and gives them an :class:`UnusedKVCache` (a
KVCache that says so) in the caches it rebuilds, so a restore needs no block
for them; the plain empty KVCache of a cache handed to ``store`` has the same
layout and is cut to nothing by the KV codec.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .base import Builder, Codec

UNUSED = ("KVCache", "unused")  # the layout of an empty KVCache after a forward


class UnusedKVCache(KVCache):
    """A KVCache of a layer no forward writes."""


class UnusedCodec(Codec):
    cache_type = UnusedKVCache

    def layout(self, cache: UnusedKVCache) -> tuple[object, ...]:
        return UNUSED

    def length(self, cache: UnusedKVCache) -> None:
        return None

    def cut(
        self, cache: UnusedKVCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        return {}

    def blocks_needed(
        self, fresh: UnusedKVCache, num_tokens: int, block_size: int
    ) -> Sequence[int]:
        return ()

    def builder(
        self, fresh: UnusedKVCache, num_tokens: int, capacity: int, block_size: int
    ) -> Builder:
        return UnusedBuilder(fresh)


class UnusedBuilder(Builder):
    def __init__(self, fresh: UnusedKVCache):
        self.cache = fresh

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        return None

    def buffers(self) -> list[mx.array]:
        return []

    def finish(self) -> UnusedKVCache:
        return self.cache
