"""Prefill on the checkpoint protocol: fetch the cached prefix, prefill the rest,
capture at every checkpoint, store the finished cache.

Uses only the facade's public verbs (``fetch``, ``checkpoints``, ``capture``,
``store``), so a scheduler with its own prefill loop can do exactly the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache

from ..config import CacheConfig
from .capture import chunk_ends, chunk_step


class Cache(Protocol):
    """What the prefill loop uses of a PrefixCache: its model, config and public verbs
    (``note_prefill`` hears each chunk's speed: the remote tier's cost gate)."""

    model: Callable[..., mx.array]
    config: CacheConfig

    def fetch(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> tuple[list[Any], int]: ...

    def checkpoints(
        self,
        tokens: Sequence[int],
        num_cached: int = 0,
        *,
        extra: Mapping[str, str] | None = None,
    ) -> list[int]: ...

    def capture(
        self,
        tokens_so_far: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
        tenant: str | None = None,
    ) -> int: ...

    def store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
        tenant: str | None = None,
    ) -> int: ...

    def note_prefill(self, num_tokens: int, seconds: float) -> None: ...


def prefill(
    pc: Cache,
    tokens: Sequence[int],
    *,
    prefill_step_size: int | None = None,
    extra: Mapping[str, str] | None = None,
    session: str | None = None,
    persist: bool = True,
    tenant: str | None = None,
) -> tuple[list[Any], mx.array]:
    """Fetch the cached prefix, prefill the rest, capture at every checkpoint, store.

    The checkpoint protocol (``PrefixCache.checkpoints``) with mlx-lm's own
    chunking: chunks end on multiples of the step and at every checkpoint,
    where the cache is captured (the state there is kept); the finished cache
    is stored. After each chunk mlx-lm's KV quantization schedule is applied
    (as ``generate_step`` does), the cache is evaluated and the chunk's speed
    reported (``note_prefill``). ``session``, ``persist`` and ``tenant`` go to every
    ``capture`` and ``store``.

    Returns:
        (the cache holding all of ``tokens``, the last token's logits (1, vocab))
    """
    tokens = list(tokens)
    cfg = pc.config
    cache, start = pc.fetch(tokens, extra=extra)
    checkpoints = set(pc.checkpoints(tokens, start, extra=extra))
    step = chunk_step(prefill_step_size, cfg.block_size)
    ends = sorted(checkpoints.union(chunk_ends(start, len(tokens), step)))
    ids = mx.array(tokens, dtype=mx.int32)
    logits = None
    for end in ends:
        began = time.perf_counter()
        out = pc.model(ids[None, start:end], cache=cache)
        maybe_quantize_kv_cache(cache, cfg.quantized_kv_start, cfg.kv_group_size, cfg.kv_bits)
        if end == len(tokens):
            logits = mx.array(out[:, -1, :])  # a copy: the chunk's logits are let go
        # only the cache (and the last logits) are computed, as in generate_step
        mx.eval(logits, [c.state for c in cache])
        del out
        pc.note_prefill(end - start, time.perf_counter() - began)
        keep = {"extra": extra, "session": session, "persist": persist, "tenant": tenant}
        if end == len(tokens):
            pc.store(tokens, cache, **keep)
        elif end in checkpoints:
            pc.capture(tokens[:end], cache, **keep)
        start = end
    return cache, logits
