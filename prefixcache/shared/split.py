"""Attention of a batch of sequences over shared prefixes and private suffixes.

The keys a model sees for a shared layer (what ``update_and_fetch`` returns)
are laid out as mlx-lm's caches would hold them: per sequence, its prefix
tokens right-aligned in a prefix region of ``prefix_columns`` columns, then its
suffix (left-padded in a batch). The model's mask is over that layout, so it
is cut at ``prefix_columns``: each group's columns go to its prefix part, the
rest to the suffix part. Whatever mask the model passes (None, "causal", an
array) is therefore honoured exactly.

Sequences on one prefix form a :class:`Group`: their queries are stacked into
one matrix per KV head and multiplied with the prefix once (Hydragen); the
suffix part is one batched attention; the parts merge by log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .attention import NEG, Part, Quant, attend, by_kv_head, by_q_head, merge


@dataclass(frozen=True, slots=True)
class Group:
    """Rows of a batch attending to one prefix.

    Attributes:
        rows: the batch rows, or None for every row.
        keys, values: the prefix tokens they see, (1, kv_heads, L, D) (or packed;
            full-precision keys may run past L, see LayerPrefix.attended).
        first: the mask column of the group's first prefix token.
    """

    rows: list[int] | None
    keys: Any
    values: Any
    first: int


def split_attention(
    queries: mx.array,
    groups: Sequence[Group],
    suffix: tuple[Any, Any] | None,
    *,
    prefix_columns: int,
    scale: float,
    mask: Any,
    sinks: mx.array | None,
    quant: Quant | None,
) -> mx.array:
    """Attention of ``queries`` (B, q_heads, N, D) over the groups' prefixes and
    the suffix keys/values (B, kv_heads, S, D) (None: no suffix token yet)."""
    b, q_heads, n, _ = queries.shape
    keys = suffix[0] if suffix is not None else groups[0].keys
    kv_heads = (keys[0] if isinstance(keys, tuple) else keys).shape[1]
    reps = q_heads // kv_heads
    q = by_kv_head(queries, kv_heads)
    array_mask = mask if isinstance(mask, mx.array) else None
    parts = []
    if groups:
        parts.append(_prefix_part(q, groups, array_mask, reps, n, scale, quant))
    if suffix is not None:
        sk, sv = suffix
        length = (sk[0] if isinstance(sk, tuple) else sk).shape[2]
        if mask == "causal":
            m = _as_view(causal_tail(n, length), kv_heads)
        elif array_mask is not None:
            m = _as_view(array_mask[..., prefix_columns:], kv_heads)
        else:
            m = None
        view = (b, kv_heads, reps, n, length)
        parts.append(attend(q, sk, sv, scale, m, view=view, quant=quant))
    if sinks is not None:
        sinks = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, kv_heads, reps, 1), (1, kv_heads, reps, n)
        )
        sinks = sinks.reshape(1, kv_heads, reps * n, 1)
    return by_q_head(merge(parts, sinks, dtype=queries.dtype), q_heads)


def causal_tail(n: int, length: int) -> mx.array:
    """(n, length) bool: query i (the last n of ``length`` keys) sees keys up to its own."""
    return mx.arange(length)[None] <= mx.arange(length - n, length)[:, None]


def _as_view(mask: mx.array, kv_heads: int) -> mx.array:
    """A (..., N, L) mask as (B|1, kv_heads|1, reps|1, N, L), the scores' view."""
    if mask.ndim == 2:
        return mask[None, None, None]
    if mask.ndim == 3:
        mask = mask[:, None]
    b, heads, n, length = mask.shape
    if heads == 1:
        return mask[:, :, None]
    return mask.reshape(b, kv_heads, heads // kv_heads, n, length)


def _prefix_part(
    q: mx.array,
    groups: Sequence[Group],
    mask: mx.array | None,
    reps: int,
    n: int,
    scale: float,
    quant: Quant | None,
) -> Part:
    """Every row's attention over its group's prefix, as one Part of (B, kv_heads, R*N, .)."""
    b, kv_heads, rn, _ = q.shape
    done: list[tuple[list[int] | None, Part]] = []
    for group in groups:
        rows = None if group.rows is None else mx.array(group.rows)
        qg = q if rows is None else q[rows]
        bg = qg.shape[0]
        length = (group.values[0] if isinstance(group.values, tuple) else group.values).shape[2]
        m = None
        if mask is not None:
            mg = mask[..., group.first : group.first + length]
            if rows is not None and mg.ndim == 4 and mg.shape[0] > 1:
                mg = mg[rows]
            m = _as_view(mg, kv_heads).transpose(1, 0, 2, 3, 4)[None]
        # (bg, kv_heads, R*N, D) -> (1, kv_heads, bg*R*N, D): one matrix per KV head
        stacked = qg.transpose(1, 0, 2, 3).reshape(1, kv_heads, bg * rn, -1) if bg > 1 else qg
        view = (1, kv_heads, bg, reps, n, length)
        part = attend(stacked, group.keys, group.values, scale, m, view=view, quant=quant)
        done.append((group.rows, _unstack(part, bg) if bg > 1 else part))
    if len(done) == 1 and done[0][0] is None:
        return done[0][1]
    return _scatter(done, b)


def _unstack(part: Part, bg: int) -> Part:
    """(1, kv_heads, bg*R*N, .) -> (bg, kv_heads, R*N, .)."""

    def back(x: mx.array) -> mx.array:
        _, kv_heads, rows, d = x.shape
        return x.reshape(kv_heads, bg, rows // bg, d).transpose(1, 0, 2, 3)

    return Part(back(part.out), back(part.z), back(part.m))


def _scatter(done: list[tuple[list[int] | None, Part]], b: int) -> Part:
    """One Part over all ``b`` rows from the groups' parts; rows in no group attend
    to no prefix (z = 0, m = NEG)."""
    order = [r for rows, _ in done for r in (rows or [])]
    missing = [r for r in range(b) if r not in set(order)]
    pieces = [part for _, part in done]
    if missing:
        like = pieces[0]
        shape = (len(missing), *like.out.shape[1:])
        pieces.append(
            Part(
                mx.zeros(shape, like.out.dtype),
                mx.zeros((*shape[:-1], 1), mx.float32),
                mx.full((*shape[:-1], 1), NEG, mx.float32),
            )
        )
    inverse = mx.argsort(mx.array(order + missing))

    def gather(field: str) -> mx.array:
        return mx.concatenate([getattr(p, field) for p in pieces], axis=0)[inverse]

    return Part(gather("out"), gather("z"), gather("m"))
