"""Attention split over key parts, merged by log-sum-exp (Hydragen, cascade attention).

softmax(q K^T) V over keys K = [K_a | K_b] equals the two partial attentions
merged by their normalizers: with m = max of the scores of a part, e =
exp(scores - m), z = sum(e) and o = e V (unnormalized),

    out = (o_a exp(m_a - M) + o_b exp(m_b - M)) / (z_a exp(m_a - M) + z_b exp(m_b - M))

for M = max(m_a, m_b). A shared prefix is one part, read once for every
sequence (and every query) attending to it; each sequence's private suffix is
another. ``mx.fast.scaled_dot_product_attention`` returns no normalizer, so a
part is computed with matmuls (``mx.quantized_matmul`` for packed K/V) and the
normalizer kept in float32. The result equals mlx-lm's attention up to the
order of the floating-point reductions.

Shapes: queries come grouped by KV head, (Bk, kv_heads, M, D) with M = the
query heads of one KV head times the queries (GQA), so one matmul per KV head
covers them all; keys are (Bk, kv_heads, L, D) (packed: a (data, scales,
biases) tuple). Masks follow mlx-lm: None, a bool array (True attends) or an
additive float array.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

NEG = mx.finfo(mx.float32).min  # a masked score: exp() of it is 0, never NaN


@dataclass(frozen=True, slots=True)
class Quant:
    """Packing of quantized K/V (mlx-lm's QuantizedKVCache)."""

    group_size: int
    bits: int


@dataclass(frozen=True, slots=True)
class Part:
    """One part's unnormalized attention: o = e V, z = sum(e), m = the max score.

    ``out`` is (Bk, kv_heads, M, Dv) in the values' dtype; ``z`` and ``m`` are
    (Bk, kv_heads, M, 1) float32.
    """

    out: mx.array
    z: mx.array
    m: mx.array


def attend(
    queries: mx.array,
    keys: mx.array | tuple[mx.array, ...],
    values: mx.array | tuple[mx.array, ...],
    scale: float,
    mask: mx.array | None = None,
    *,
    view: tuple[int, ...] | None = None,
    quant: Quant | None = None,
) -> Part:
    """The attention of ``queries`` over one part of the keys.

    Args:
        queries: (Bk, kv_heads, M, D), grouped by KV head.
        keys, values: (Bk or 1, kv_heads, L, D) arrays, or packed tuples (``quant``);
            full-precision keys may be longer than the values (the rest is ignored).
        scale: the softmax scale.
        mask: None, or an array broadcastable to the scores reshaped to ``view``.
        view: the shape the (Bk, kv_heads, M, L) scores take for the mask
            (e.g. M split into query heads and queries); None: as they are.
        quant: the packing of ``keys`` and ``values``, or None.
    """
    queries = queries * mx.array(scale, queries.dtype)
    if quant is None:
        scores = queries @ keys.swapaxes(-1, -2)
        if scores.shape[-1] != values.shape[2]:  # keys past the values' are not attended
            scores = scores[..., : values.shape[2]]
    else:
        scores = mx.quantized_matmul(
            queries, *keys, transpose=True, group_size=quant.group_size, bits=quant.bits
        )
    scores = _masked(scores.astype(mx.float32), mask, view)
    m = mx.max(scores, axis=-1, keepdims=True)
    e = mx.exp(scores - m)
    z = mx.sum(e, axis=-1, keepdims=True)
    if quant is None:
        out = e.astype(values.dtype) @ values
    else:
        out = mx.quantized_matmul(
            e.astype(values[1].dtype),
            *values,
            transpose=False,
            group_size=quant.group_size,
            bits=quant.bits,
        )
    return Part(out, z, m)


def _masked(scores: mx.array, mask: mx.array | None, view: tuple[int, ...] | None) -> mx.array:
    """``scores`` with ``mask`` applied in the ``view`` shape (bool: NEG where False)."""
    if mask is None:
        return scores
    viewed = scores.reshape(view) if view is not None else scores
    if mask.dtype == mx.bool_:
        viewed = mx.where(mask, viewed, NEG)
    else:
        viewed = viewed + mask.astype(mx.float32)
    return viewed.reshape(scores.shape)


def merge(parts: list[Part], sinks: mx.array | None = None, dtype: mx.Dtype | None = None):
    """The attention over the union of the parts' keys, from their partial results.

    Args:
        parts: partial attentions over disjoint key sets, of one shape.
        sinks: attention sinks (a logit per query row that attends to nothing),
            broadcastable to the parts' ``m``; None for none.
        dtype: the output dtype (default: the first part's).

    Returns:
        (Bk, kv_heads, M, Dv) attention output.
    """
    top = parts[0].m
    for part in parts[1:]:
        top = mx.maximum(top, part.m)
    if sinks is not None:
        top = mx.maximum(top, sinks)
    num = den = None
    for part in parts:
        w = mx.exp(part.m - top)
        num = part.out.astype(mx.float32) * w if num is None else num + part.out * w
        den = part.z * w if den is None else den + part.z * w
    if sinks is not None:
        den = den + mx.exp(sinks - top)
    return (num / den).astype(dtype or parts[0].out.dtype)


def by_kv_head(queries: mx.array, kv_heads: int) -> mx.array:
    """(B, q_heads, N, D) -> (B, kv_heads, q_heads // kv_heads * N, D); no copy.

    mlx-lm pairs query head h with KV head h // (q_heads // kv_heads).
    """
    b, heads, n, d = queries.shape
    return queries.reshape(b, kv_heads, heads // kv_heads * n, d)


def by_q_head(out: mx.array, q_heads: int) -> mx.array:
    """Inverse of :func:`by_kv_head` for the output: (B, q_heads, N, Dv)."""
    b, kv_heads, rn, d = out.shape
    return out.reshape(b, q_heads, rn * kv_heads // q_heads, d)
