"""From a restored cache to a shared prefix, and from a shared prefix to a sequence's caches.

``share`` turns a cache restored privately (one ``PrefixCache.fetch``) into a
:class:`SharedPrefix`: each shareable layer's K/V are copied into a buffer of
exactly the prefix's length (the restore's buffer has headroom; its copy is
dropped layer by layer, so the peak is the restore plus one layer), the other
layers are kept as templates. ``sequence`` gives one sequence its caches on a
prefix; ``blank`` gives a sequence with no prefix the same cache types.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from ..codecs.rotating import Ring
from ..hashing import TOKEN_BYTES
from .attention import Quant
from .batch import SharedBatchKVCache
from .caches import SharedKVCache, SharedQuantizedKVCache
from .prefix import LayerKind, LayerPrefix, SharedPrefix


def kind_of(cache: Any, signature: tuple[object, ...]) -> LayerKind | None:
    """The shared kind replacing an mlx-lm layer cache holding tokens, or None
    (the layer stays private: recurrent state, chunked attention, CacheList, a
    ring with ``keep`` tokens)."""
    kind = type(cache)
    if kind is KVCache and cache.keys is not None:
        return LayerKind(None, None, signature, cache.keys.shape[1])
    if kind is QuantizedKVCache and cache.keys is not None:
        quant = Quant(cache.group_size, cache.bits)
        return LayerKind(None, quant, signature, cache.keys[0].shape[1])
    if kind is RotatingKVCache and cache.keep == 0 and cache.keys is not None:
        return LayerKind(cache.max_size, None, signature, cache.keys.shape[1])
    return None


def share(
    root: bytes,
    tokens: bytes,
    restored: list[Any],
    num_tokens: int,
    signatures: Sequence[tuple[object, ...]],
) -> SharedPrefix:
    """A shared prefix of the first ``num_tokens`` of ``tokens`` from ``restored``
    (a private cache holding them); the shared layers of ``restored`` are emptied."""
    layers: list[LayerPrefix | None] = []
    private: list[Any | None] = []
    for cache, signature in zip(restored, signatures, strict=True):
        kind = kind_of(cache, signature)
        if kind is None:
            layers.append(None)
            private.append(cache)
            continue
        layer = _layer(cache, kind, num_tokens)
        mx.eval(layer.keys, layer.values)
        cache.keys = cache.values = None  # its buffer goes before the next layer's copy
        layers.append(layer)
        private.append(None)
    return SharedPrefix(root, tokens[: num_tokens * TOKEN_BYTES], layers, private)


def _layer(cache: Any, kind: LayerKind, n: int) -> LayerPrefix:
    if kind.window is not None:
        # what a query at position >= n can see: the window - 1 tokens before n
        ring = Ring.of(cache)
        first = max(ring.first, n - (kind.window - 1))
        ranges = ring.segments(first, n)
        keys, values = _gather(cache.keys, ranges), _owned(_gather(cache.values, ranges))
        return LayerPrefix(kind, _transposed(keys), values, first)
    if kind.quant is not None:
        keys = tuple(_exact(x, n) for x in cache.keys)
        values = tuple(_exact(x, n) for x in cache.values)
        return LayerPrefix(kind, keys, values, 0)
    return LayerPrefix(kind, _transposed(cache.keys[..., :n, :]), _exact(cache.values, n), 0)


def _exact(x: mx.array, n: int) -> mx.array:
    """``x[..., :n, :]`` in a buffer of its own (``x`` itself when it is that long)."""
    return x if x.shape[2] == n else _owned(x[..., :n, :])


def _owned(x: mx.array) -> mx.array:
    return mx.array(x)


def _transposed(keys: mx.array) -> mx.array:
    """A copy of ``keys`` (B, heads, L, D) held as (B, heads, D, L) in memory.

    The scores ``q @ keys^T`` then read a row-contiguous matrix: 2-2.5x faster
    than through the transposed view of a (L, D) buffer on the CPU here (it is
    what every query of every sequence on the prefix multiplies with).
    """
    return mx.contiguous(keys.swapaxes(-1, -2)).swapaxes(-1, -2)


def _gather(x: mx.array, ranges: list[tuple[int, int]]) -> mx.array:
    """Buffer ranges of a ring, in order, as one new array."""
    return mx.concatenate([x[..., a:b, :] for a, b in ranges], axis=2)


def sequence(prefix: SharedPrefix, end: int, gap: tuple[list[Any], int] | None = None) -> list[Any]:
    """One sequence's caches on ``prefix``, seeing its positions up to ``end``.

    Args:
        prefix: the shared prefix.
        end: positions of the prefix the sequence holds (its length if a window
            or recurrent layer needs its end state).
        gap: (a private restore holding more tokens, their number): the tokens
            past ``end`` are copied into each sequence suffix and the private
            layers are taken from it (full-attention prefixes only).
    """
    lease = prefix.lease()
    out = []
    for i, (layer, template) in enumerate(zip(prefix.layers, prefix.private, strict=True)):
        if layer is None:
            out.append(gap[0][i] if gap is not None else copy.deepcopy(template))
            continue
        cls = SharedQuantizedKVCache if layer.kind.quant else SharedKVCache
        suffix = _gap_suffix(gap[0][i], end, gap[1]) if gap is not None else None
        out.append(cls(layer.kind, layer, end, lease, suffix))
    return out


def _gap_suffix(cache: Any, start: int, stop: int) -> Any:
    """A suffix cache holding tokens ``[start, stop)`` of a restored KV cache."""
    if isinstance(cache, QuantizedKVCache):
        suffix = QuantizedKVCache(cache.group_size, cache.bits)
        suffix.keys = tuple(_owned(x[..., start:stop, :]) for x in cache.keys)
        suffix.values = tuple(_owned(x[..., start:stop, :]) for x in cache.values)
    else:
        suffix = KVCache()
        suffix.keys = _owned(cache.keys[..., start:stop, :])
        suffix.values = _owned(cache.values[..., start:stop, :])
    suffix.offset = stop - start
    return suffix


def blank(kinds: Sequence[LayerKind | None], fresh: list[Any]) -> list[Any]:
    """Caches of a sequence with no shared prefix: shared types (so sequences
    batch together) for the shared layers, ``fresh`` mlx-lm caches for the rest."""
    out = []
    for kind, cache in zip(kinds, fresh, strict=True):
        if kind is None:
            out.append(cache)
        else:
            cls = SharedQuantizedKVCache if kind.quant else SharedKVCache
            out.append(cls(kind, None, 0, None))
    return out


def release(cache: Sequence[Any]) -> None:
    """Let go of the shared prefix of a cache list now rather than when it is
    dropped; the last sequence to let go frees the prefix. The caches are
    unusable after."""
    for layer in cache:
        if isinstance(layer, SharedKVCache | SharedBatchKVCache):
            layer.release()
