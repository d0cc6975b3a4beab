"""Recompute cost: what a later request pays to prefill a block again, in FLOPs.

A token costs its weights' FLOPs (about twice the parameter count) plus, in
every attention layer, FLOPs per token it attends to: a block deep in a long
history costs more to recompute than the same bytes of a short system prompt
(a sliding window or a chunk caps the context at its size; recurrent layers
cost the same at any depth). The hot tier's cost-aware eviction weighs this
per byte against recency (the Marconi paper's FLOP efficiency + recency).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)


@dataclass(frozen=True, slots=True)
class RecomputeCost:
    """FLOPs to prefill tokens again.

    Attributes:
        per_token: FLOPs of a token through the weights (2 x parameters).
        attention: per attention layer, (FLOPs per context token, the most
            context it attends to: a window or chunk; None for all).
    """

    per_token: float
    attention: tuple[tuple[float, int | None], ...]

    @classmethod
    def of(cls, model: nn.Module, probe: Sequence[Any]) -> RecomputeCost:
        """The cost model of ``model`` from its parameters and a probe cache."""
        params = sum(v.size for _, v in tree_flatten(model.parameters()))
        groups = _query_groups(model)
        return cls(2.0 * params, tuple(_attention(probe, groups)))

    def flops(self, start: int, num_tokens: int) -> float:
        """FLOPs to prefill tokens ``[start, start + num_tokens)`` after the ones before."""
        total = self.per_token * num_tokens
        for per_context, cap in self.attention:
            total += per_context * _context(start, num_tokens, cap)
        return total


def _context(start: int, n: int, cap: int | None) -> float:
    """Tokens attended to, summed over positions ``[start, start + n)``: each attends to
    those before it, at most ``cap``."""
    if cap is None or start + n <= cap:
        return n * (start + (n - 1) / 2)
    if start >= cap:
        return float(n * cap)
    below = cap - start  # positions before the window is full
    return below * (start + (below - 1) / 2) + (n - below) * cap


def _attention(caches: Sequence[Any], groups: int) -> list[tuple[float, int | None]]:
    out: list[tuple[float, int | None]] = []
    for cache in caches:
        if isinstance(cache, CacheList):
            out += _attention(cache.caches, groups)
            continue
        keys = cache.keys if isinstance(cache, KVCache | RotatingKVCache | ChunkedKVCache) else None
        if isinstance(cache, QuantizedKVCache) or keys is None:
            continue  # recurrent state: its cost does not grow with depth
        heads, k_dim, v_dim = keys.shape[1], keys.shape[3], cache.values.shape[3]
        # QK^T and attention x V: 2 FLOPs per multiply-add, per query head
        per_context = 2.0 * heads * groups * (k_dim + v_dim)
        cap = None
        if isinstance(cache, RotatingKVCache):
            cap = cache.max_size
        elif isinstance(cache, ChunkedKVCache):
            cap = cache.chunk_size
        out.append((per_context, cap))
    return out


def _query_groups(model: nn.Module) -> int:
    """Query heads per KV head, from the model's arguments when they say (else 1)."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for source in (args, text):
        if isinstance(source, dict):
            q, kv = source.get("num_attention_heads"), source.get("num_key_value_heads")
        else:
            q = getattr(source, "num_attention_heads", None)
            kv = getattr(source, "num_key_value_heads", None)
        if isinstance(q, int) and isinstance(kv, int) and kv > 0:
            return max(1, q // kv)
    return 1
