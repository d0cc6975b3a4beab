"""Block-aligned prefill: fetch the cached prefix, prefill the rest, capture every chunk.

Uses only the facade's public verbs (``fetch``, ``capture``), so a scheduler
with its own prefill loop can do exactly the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache

from .capture import chunk_ends, chunk_step
from .codecs import codec_for
from .config import CacheConfig


class Cache(Protocol):
    """What the prefill loop uses of a PrefixCache: its model, config and public verbs
    (``note_prefill`` hears each chunk's speed: the remote tier's cost gate)."""

    model: Callable[..., mx.array]
    config: CacheConfig

    def fetch(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> tuple[list[Any], int]: ...

    def capture(
        self,
        tokens_so_far: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
    ) -> int: ...

    def store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
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
) -> tuple[list[Any], mx.array]:
    """Fetch the cached prefix, prefill the rest block-aligned, capturing every chunk.

    With recurrent or sliding-window layers a chunk also ends at the block boundary
    below where stored sequences branch off this prompt (``stored_prefix``), and
    the state and windows there are kept: the next prompt branching there resumes.
    After each chunk mlx-lm's KV quantization schedule is applied (as
    ``generate_step`` does), the cache is evaluated and the blocks it completed
    are stored (window K/V while still in the window, recurrent state at the
    chunk's end boundary). Each chunk's speed is reported (``note_prefill``);
    ``session`` and ``persist`` go to every ``capture`` and ``store``. Returns
    (the cache holding all of ``tokens``, the last token's logits (1, vocab)).
    """
    tokens = list(tokens)
    cfg = pc.config
    cache, start = pc.fetch(tokens, extra=extra)
    snapshots = any(codec_for(c).snapshots(c) for c in cache)
    step = chunk_step(prefill_step_size, cfg.block_size, pc.layout.snapshot_interval, snapshots)
    ends = chunk_ends(start, len(tokens), step)
    if snapshots or pc.layout.window_policy is not None:  # keep them where prompts branch
        branch = min(pc.stored_prefix(tokens, extra=extra), len(tokens) - 1)
        branch = branch // cfg.block_size * cfg.block_size
        ends = sorted({*ends, branch}) if branch > start else ends
    else:
        branch = 0
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
        # ``store`` keeps the state at the sequence's end and at the branch point
        keep = pc.store if end in (len(tokens), branch) else pc.capture
        keep(tokens[:end], cache, extra=extra, session=session, persist=persist)
        start = end
    return cache, logits
