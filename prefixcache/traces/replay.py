"""Replay a trace through a real model and a real prompt cache, timing the first token.

Each request's prompt is made from its hash ids (``reader.request_tokens``:
a seeded token string per id, blocks scaled to ``block_tokens``). Per
request, as a scheduler runs it: fetch the longest cached prefix, prefill the
rest, take the first token (TTFT: fetch + prefill + the first token's
logits), then store the prompt's cache.

Decode is skipped. In Mooncake's traces a next turn's prompt holds the
previous turn's output, but only inside blocks with new hash ids (the
previous prompt's short last block, refilled with the reply and the new
message, gets a new id), so under the trace's semantics no later prompt
matches an output token: storing the output would take bytes the trace never
reuses, and ``simulate`` does not store it either.

Two systems hold the same bytes: :class:`LibrarySystem` (``PrefixCache``:
the hot tier, an SSD tier behind it if given) and :class:`MlxLruSystem`
(mlx-lm's ``LRUPromptCache``: whole prompts in a token trie, the cache
mlx-lm's server keeps, bounded by its own byte count).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import DEFAULT_EVICTION, CacheConfig
from .reader import TraceRequest, request_tokens
from .shapes import ModelShape
from .simulator import SimResult

MLX_KEY = ("replay", None, None)  # LRUPromptCache's model key (path, adapter, draft)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay: the hot budget in bytes, the SSD tier (None: none) and its budget,
    tokens per trace block, the hot tier's eviction, the token seed, the prefill chunk."""

    hot_bytes: int
    ssd_dir: str | None = None
    ssd_bytes: int = 64 << 30
    block_tokens: int = 16
    eviction: str = DEFAULT_EVICTION
    seed: int = 0
    prefill_step: int = 512


class LibrarySystem:
    """``PrefixCache`` at the replay's budgets; its hits by tier from its stats."""

    name = "prefixcache"

    def __init__(self, model: nn.Module, config: ReplayConfig, model_id: str):
        from ..cache.prefix_cache import PrefixCache

        tiers = {"hot_cache_only": True}
        if config.ssd_dir is not None:
            tiers = {"ssd_dir": config.ssd_dir, "ssd_max_bytes": config.ssd_bytes}
        cache_config = CacheConfig(
            block_size=config.block_tokens,
            hot_max_bytes=config.hot_bytes,
            eviction=config.eviction,  # type: ignore[arg-type]
            **tiers,  # type: ignore[arg-type]
        )
        self.cache = PrefixCache(model, cache_config, model_id=model_id)

    def fetch(self, tokens: list[int]) -> tuple[list[Any], int]:
        return self.cache.fetch(tokens)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        self.cache.store(tokens, cache)

    def held_bytes(self) -> dict[str, int]:
        held = {"hot": self.cache.hot.nbytes}
        ssd = self.cache.stats().get("ssd")
        if ssd:
            held["ssd"] = ssd["nbytes"]
        return held

    def block_hits(self) -> dict[str, int]:
        stats = self.cache.stats()
        return {t: stats[f"{t}_block_hits"] for t in ("hot", "ssd", "remote")}

    def ssd_bytes_written(self) -> int:
        self.cache.flush()
        return self.cache.stats()["ssd_bytes_written"]

    def close(self) -> None:
        self.cache.close()


class MlxLruSystem:
    """mlx-lm's ``LRUPromptCache`` bounded by bytes (its own count: ``cache.nbytes`` of
    the whole buffers), as mlx-lm's server uses it: a full hit is trimmed by one token
    so that the model has a token to prefill."""

    name = "mlx-lm"

    def __init__(self, model: nn.Module, max_bytes: int):
        from mlx_lm.models.cache import LRUPromptCache

        self.model = model
        self.lru = LRUPromptCache(max_size=1 << 62, max_bytes=max_bytes)

    def fetch(self, tokens: list[int]) -> tuple[list[Any], int]:
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        cache, rest = self.lru.fetch_nearest_cache(MLX_KEY, tokens)
        if cache is None:
            return make_prompt_cache(self.model), 0
        if not rest:
            trim_prompt_cache(cache, 1)
            return cache, len(tokens) - 1
        return cache, len(tokens) - len(rest)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        self.lru.insert_cache(MLX_KEY, tokens, cache)

    def held_bytes(self) -> dict[str, int]:
        return {"hot": self.lru.nbytes}

    def block_hits(self) -> dict[str, int]:
        return {}

    def ssd_bytes_written(self) -> int:
        return 0

    def close(self) -> None:
        self.lru.trim_to(n_sequences=0)


System = LibrarySystem | MlxLruSystem


@dataclass(slots=True)
class Replayed:
    """A replay's counts (``SimResult``: the keys ``simulate`` reports), and per
    request the tokens it found cached and its TTFT in seconds."""

    system: str
    counts: SimResult
    ttfts: list[float]
    num_cached: list[int] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"system": self.system, **self.counts.as_json()}
        q = np.percentile(self.ttfts, [50, 90, 99]) if self.ttfts else [0.0] * 3
        return doc | {"ttft_p50": float(q[0]), "ttft_p90": float(q[1]), "ttft_p99": float(q[2])}


def replay(
    requests: Sequence[TraceRequest],
    model: nn.Module,
    system: System,
    config: ReplayConfig,
    shape: ModelShape,
) -> Replayed:
    """Every request of ``requests`` through ``system`` in order (closes it at the end)."""
    vocab = model.args.vocab_size
    out = Replayed(system.name, SimResult(), [])
    counts, half = out.counts, len(requests) // 2
    began = time.perf_counter()
    try:
        for i, request in enumerate(requests):
            tokens = request_tokens(
                request, block_tokens=config.block_tokens, vocab_size=vocab, seed=config.seed
            )
            counts.requests += 1
            if not tokens:
                out.num_cached.append(0)
                continue
            start = time.perf_counter()
            cache, num_cached = system.fetch(tokens)
            first_token(model, tokens[num_cached:], cache, config.prefill_step)
            out.ttfts.append(time.perf_counter() - start)
            out.num_cached.append(num_cached)
            system.store(tokens, cache)
            _count(counts, len(tokens), num_cached, measured=i >= half)
            counts.prefill_flops_saved += shape.prefill_flops(0, num_cached)
            for tier, nbytes in system.held_bytes().items():
                counts.peak_bytes[tier] = max(counts.peak_bytes[tier], nbytes)
        _by_tier(counts, system.block_hits())
        counts.ssd_bytes_written = system.ssd_bytes_written()
    finally:
        system.close()
    if requests:
        counts.trace_seconds = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    counts.seconds = time.perf_counter() - began
    return out


def first_token(model: nn.Module, tokens: list[int], cache: list[Any], step: int) -> int:
    """Prefill ``tokens`` into ``cache`` in chunks of ``step``; the greedy next token."""
    logits = None
    for start in range(0, len(tokens), step):
        logits = model(mx.array([tokens[start : start + step]]), cache=cache)[:, -1, :]
        mx.eval(logits)
    return int(mx.argmax(logits, axis=-1).item())


def _count(counts: SimResult, num_tokens: int, num_cached: int, *, measured: bool) -> None:
    counts.prompt_tokens += num_tokens
    counts.cached_tokens += num_cached
    if measured:
        counts.last_half_prompt += num_tokens
        counts.last_half_cached += num_cached


def _by_tier(counts: SimResult, block_hits: dict[str, int]) -> None:
    """Cached tokens per tier, in proportion to the blocks each tier served (a
    system without tiers serves all from RAM: ``hot``)."""
    total = sum(block_hits.values())
    if not total:
        counts.hit_tokens["hot"] = counts.cached_tokens
        return
    for tier, n in block_hits.items():
        counts.hit_tokens[tier] = round(counts.cached_tokens * n / total)
