"""The unshared layout of a shared layer's keys, and masks by position over it.

``update_and_fetch`` of a shared cache returns the keys as an unshared cache
would hold them: per row, the prefix tokens it sees (right-aligned in a
prefix region as wide as the longest, zeros before), then its suffix (left
padding first, in a batch). The arrays are built lazily: the attention hook
never evaluates them (it cuts the model's mask at the prefix region
instead), while a model that bypasses the hook gets the right keys.

A window layer's prefix starts past position 0 and a batch pads, so masks are
built from each key's position: a query at position q sees a key at position
k iff k <= q (and q - k < window); a padding column gets a position no query
reaches.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from .prefix import LayerPrefix

PAD = 2**30  # the position of a padding column: after every query


def position_mask(qpos: mx.array, kpos: mx.array, window: int | None) -> mx.array:
    """(B, N, K) bool from query positions (B, N) and key positions (B, K)."""
    q, k = qpos[:, :, None], kpos[:, None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (q - k < window)
    return mask


def batch_positions(
    starts: list[int], ends: list[int], suffix: BatchKVCache, n: int
) -> tuple[mx.array, mx.array]:
    """(query positions (B, n), key positions (B, K)) of a batch about to take ``n``
    tokens: row i sees its prefix tokens ``[starts[i], ends[i])`` right-aligned in
    ``max(ends - starts)`` columns, then its suffix (left padding first)."""
    starts_, ends_ = np.array(starts, np.int64), np.array(ends, np.int64)
    visible = ends_ - starts_
    width = int(visible.max()) if len(visible) else 0
    idx = suffix._idx  # suffix columns filled so far, as BatchKVCache.make_mask reads it
    left = np.array(suffix.left_padding.tolist(), np.int64)
    cols = np.arange(width)[None]
    pad = (width - visible)[:, None]
    prefix = np.where(cols >= pad, starts_[:, None] + cols - pad, PAD)
    cols = np.arange(idx + n)[None]
    rest = np.where(cols >= left[:, None], ends_[:, None] + cols - left[:, None], PAD)
    queries = (ends_ + idx - left)[:, None] + np.arange(n)[None]
    keys = np.concatenate([prefix, rest], axis=1)
    return mx.array(queries.astype(np.int32)), mx.array(keys.astype(np.int32))


def joined(prefix: LayerPrefix | None, end: int, keys: Any, values: Any) -> tuple[Any, Any]:
    """One sequence's keys and values: the prefix's visible tokens, then the suffix's."""
    if prefix is None or end == prefix.start:
        return keys, values
    pk, pv = prefix.visible(end)
    return _cat(pk, keys), _cat(pv, values)


def padded(
    rows: list[tuple[LayerPrefix | None, int, Any]], keys: mx.array, values: mx.array
) -> tuple[mx.array, mx.array]:
    """A batch's keys and values: each row's prefix right-aligned in the prefix
    region, then the suffix's (B, kv_heads, S, D) ``keys`` / ``values``."""
    visible = [0 if p is None else end - p.start for p, end, _ in rows]
    width = max(visible)
    if not width:
        return keys, values
    out = []
    for x, which in ((keys, 0), (values, 1)):
        parts = []
        for (prefix, end, _), n in zip(rows, visible, strict=True):
            zeros = mx.zeros((1, x.shape[1], width - n, x.shape[3]), x.dtype)
            parts.append(zeros if not n else _cat(zeros, prefix.visible(end)[which]))
        out.append(mx.concatenate([mx.concatenate(parts, axis=0), x], axis=2))
    return out[0], out[1]


def window_mask(start: int, end: int, offset: int, n: int, window: int) -> mx.array:
    """(n, K) mask of one sequence's next ``n`` queries (from ``offset``) over its
    prefix positions ``[start, end)`` then its suffix positions ``[end, offset + n)``."""
    keys = mx.concatenate([mx.arange(start, end), mx.arange(end, offset + n)])
    return position_mask(mx.arange(offset, offset + n)[None], keys[None], window)[0]


def _cat(a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b, strict=True))
    return mx.concatenate([a, b], axis=2)
