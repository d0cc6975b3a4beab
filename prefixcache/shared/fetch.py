"""``PrefixCache.fetch(tokens, shared=True)``: one physical copy of a prefix for many sequences.

The first sequence on a prefix restores it once (the ordinary private fetch)
and its K/V become a shared prefix; later sequences on it get caches that
attend to that one copy, with nothing restored or copied. Which one is used:

- a live shared prefix covering at least what the tiers would restore: used
  as is (a full-attention prefix may be used in part: a view of it);
- else the tiers' restore: past a live full-attention prefix only its extra
  tokens are kept (copied into the sequence's suffix), the live prefix is
  shared for the rest; otherwise the restore becomes a new shared prefix.

Falls back to the private fetch, counted by reason, when the model's attention
cannot be hooked (probe.py), has no layer to share, or its K/V are due to be
quantized by mlx-lm later (``kv_bits`` with ``quantized_kv_start`` beyond the
cached tokens: a shared cache is not re-quantized in place).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import make_prompt_cache

from ..hashing import token_bytes
from .batch import SharedBatchKVCache
from .build import blank, sequence, share
from .caches import SharedKVCache
from .probe import SharedLayout, probe
from .registry import SharedRegistry, registry_of

if TYPE_CHECKING:
    from ..cache.prefix_cache import PrefixCache

KV_QUANT = "kv_quant_pending"


def fetch_shared(
    pc: PrefixCache, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
) -> tuple[list[Any], int]:
    """(caches for the model on a shared prefix of ``tokens``, tokens they hold).

    Same contract as ``PrefixCache.fetch``: at least one token is left to
    prefill; a miss gives caches holding nothing.
    """
    data = token_bytes(tokens)
    if not data:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    registry = registry_of(pc)
    with registry.lock:
        reason = _layout(pc, registry).reason
        if reason is not None:
            registry.fell_back(reason)
            return pc.fetch(tokens, extra=extra)
        return _fetch(pc, registry, data, tokens, extra)


def _fetch(
    pc: PrefixCache,
    registry: SharedRegistry,
    data: bytes,
    tokens: Sequence[int],
    extra: Mapping[str, str] | None,
) -> tuple[list[Any], int]:
    root = pc.namespace.with_extra(extra).root_key()
    live, usable = registry.best(root, data)
    if not _quant_ok(pc, usable):
        live, usable = None, 0
    if live is not None and usable >= pc.match(tokens, extra=extra):
        registry.count(reused=usable)
        return sequence(live, usable), usable
    restored, num_cached = pc.fetch(tokens, extra=extra)
    if live is not None and usable >= num_cached:  # the restore fell short of the index
        registry.count(reused=usable)
        return sequence(live, usable), usable
    if not _quant_ok(pc, num_cached):
        registry.fell_back(KV_QUANT)
        return restored, num_cached
    if num_cached == 0:
        registry.count()
        return blank(registry.layout.at(None), restored), 0
    if live is not None and live.trimmable:
        registry.count(gap=True, reused=usable)
        return sequence(live, usable, gap=(restored, num_cached)), num_cached
    prefix = share(root, data, restored, num_cached, pc.layout.signature)
    registry.add(prefix)
    registry.count()
    return sequence(prefix, num_cached), num_cached


def _quant_ok(pc: PrefixCache, num_tokens: int) -> bool:
    """Whether a shared cache holding ``num_tokens`` matches mlx-lm's K/V packing
    from now on (mlx-lm quantizes a KVCache in place once it reaches the start)."""
    cfg = pc.config
    return cfg.kv_bits is None or 0 < num_tokens >= cfg.quantized_kv_start


def blank_caches(pc: PrefixCache) -> list[Any]:
    """Empty caches for a sequence with no cached prefix, of the types
    ``fetch(tokens, shared=True)`` gives (they batch together with shared ones)."""
    registry = registry_of(pc)
    with registry.lock:
        layout = _layout(pc, registry)
        fresh = make_prompt_cache(pc.model)
        if layout.reason is not None or not _quant_ok(pc, 0):
            return fresh
        return blank(layout.at(None), fresh)


def _layout(pc: PrefixCache, registry: SharedRegistry) -> SharedLayout:
    """The model's shared layout, probed once (under the registry's lock)."""
    if registry.layout is None:
        registry.layout = probe(pc.model, pc.layout.signature)
    return registry.layout


def shared_stats(pc: PrefixCache) -> dict[str, object]:
    """``{"shared": counters and live prefixes}`` once ``pc`` fetched shared, else {}."""
    registry = registry_of(pc, create=False)
    return {} if registry is None else {"shared": registry.stats()}


def release(cache: Sequence[Any]) -> None:
    """Let go of the shared prefix of a cache list now rather than when it is
    dropped; the last sequence to let go frees the prefix. The caches are
    unusable after."""
    for layer in cache:
        if isinstance(layer, SharedKVCache | SharedBatchKVCache):
            layer.release()
