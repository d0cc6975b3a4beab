"""Storing a shared cache: ``PrefixCache.store`` cuts it like the cache it replaces.

A shared layer's blocks come from its prefix (positions before ``end``) or its
suffix, cut by the codec of the mlx-lm cache it stands for (same payload
names, same signature), so a stored block never tells how it was computed.
Prefix blocks are usually stored already (the prefix was restored from
them): ``store`` skips those, and cuts only the suffix's new blocks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from ..codecs import Builder, Codec, KVCodec, QuantizedKVCodec, RotatingKVCodec, register_codec
from .caches import SharedKVCache, SharedQuantizedKVCache


class SharedKVCodec(Codec):
    cache_type = SharedKVCache

    def layout(self, cache: SharedKVCache) -> tuple[object, ...]:
        return cache.kind.signature

    def length(self, cache: SharedKVCache) -> int:
        return cache.offset

    def reach(self, cache: SharedKVCache, length: int) -> int:
        # a window layer holds its last window only (the plain ring's first token)
        return length if cache.kind.window is None else cache.end - cache.num_visible

    def cut(
        self, cache: SharedKVCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        if cache.kind.window is not None:
            return RotatingKVCodec().cut(_ring(cache), start, end, length=length)
        plain = QuantizedKVCodec() if cache.kind.quant else KVCodec()
        split = cache.end
        parts = []
        if start < split:  # row-major copies: the prefix keys are held transposed
            cut = plain.cut(_prefix(cache), start, min(end, split), length=length)
            parts.append({name: mx.contiguous(a) for name, a in cut.items()})
        if end > split:
            lo, hi = max(start, split) - split, end - split
            parts.append(plain.cut(cache.suffix, lo, hi, length=length))
        if len(parts) == 1:
            return parts[0]
        return {name: mx.concatenate([p[name] for p in parts], axis=2) for name in parts[0]}

    def builder(self, fresh: Any, num_tokens: int, capacity: int, block_size: int) -> Builder:
        raise TypeError(
            f"{type(fresh).__name__} is never restored into: restores build mlx-lm caches "
            "and fetch(tokens, shared=True) makes shared ones"
        )


class SharedQuantizedKVCodec(SharedKVCodec):
    cache_type = SharedQuantizedKVCache


def _prefix(cache: SharedKVCache) -> Any:
    """The prefix as the mlx-lm cache it came from, holding ``[0, end)`` (read only)."""
    quant = cache.kind.quant
    plain = QuantizedKVCache(quant.group_size, quant.bits) if quant else KVCache()
    plain.keys, plain.values = cache.prefix.keys, cache.prefix.values
    plain.offset = cache.end
    return plain


def _ring(cache: SharedKVCache) -> RotatingKVCache:
    """A window layer as the ring it stands for: its tokens in temporal order
    (lazily joined: only the cut blocks are computed)."""
    keys, values = cache.suffix.keys_and_values() if cache.suffix.offset else (None, None)
    if cache.num_visible:
        pk, pv = cache.prefix.visible(cache.end)
        keys = pk if keys is None else mx.concatenate([pk, keys], axis=2)
        values = pv if values is None else mx.concatenate([pv, values], axis=2)
    ring = RotatingKVCache(max_size=cache.kind.window)
    ring.keys, ring.values, ring.offset = keys, values, cache.offset
    ring._idx = 0 if keys is None else keys.shape[2]
    return ring


for _codec in (SharedKVCodec(), SharedQuantizedKVCodec()):
    register_codec(_codec, replace=True)
