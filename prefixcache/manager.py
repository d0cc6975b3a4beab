"""PrefixCache: the facade a scheduler calls around its prefill. Policy lives here."""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Container, Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from .blocks import Block
from .capture import prefill, store_blocks
from .codecs import Codec, LayoutMismatchError, codec_for, round_up
from .config import CacheConfig
from .hashing import Namespace, chain_keys, token_bytes
from .hot import HotTier
from .model_id import model_fingerprint
from .restore import Shortfall, Walk, plan, rebuild, walk
from .stats import MissReason, Stats

log = logging.getLogger(__name__)
_EVICTED_MEMORY = 65536  # keys remembered to tell "evicted" from "never stored"


class PrefixCache:
    """A tiered, block-aware prefix cache for one model.

    Args:
        model: the mlx-lm model whose caches are stored.
        config: settings; defaults to ``CacheConfig.from_env()``.
        model_id: identity of the weights (e.g. "org/name@revision"); when
            omitted, a fingerprint of the weights is used.
    """

    def __init__(
        self, model: nn.Module, config: CacheConfig | None = None, *, model_id: str | None = None
    ):
        self.model = model
        self.config = config if config is not None else CacheConfig.from_env()
        self._lock = threading.RLock()
        self._stats = Stats()
        probe = _probe_cache(model)
        self._template = make_prompt_cache(model)  # read-only: classes and settings
        self.codecs: list[Codec] = [codec_for(c) for c in probe]
        self.layout = tuple(codec.layout(c) for codec, c in zip(self.codecs, probe, strict=True))
        cfg = self.config
        kv_quant = (cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start) if cfg.kv_bits else None
        self.namespace = Namespace(model_id or model_fingerprint(model), self.layout, kv_quant)
        self._roots: dict[tuple[tuple[str, str], ...], bytes] = {}
        self._evicted: deque[bytes] = deque(maxlen=_EVICTED_MEMORY)
        self._evicted_set: set[bytes] = set()
        self.hot = HotTier(cfg.hot_max_bytes, on_evict=self._on_hot_evict)
        self.ssd = _build_ssd(cfg)
        self._closed = False

    # -- public API -------------------------------------------------------

    def fetch(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> tuple[list[Any], int]:
        """A fresh cache holding the longest cached prefix of ``tokens``.

        Always leaves at least one token to prefill.

        Returns:
            (cache list for the model, number of tokens it holds)
        """
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            root = self._root(extra)
            keys = chain_keys(root, data, self.config.block_size)
            found = self._walk(keys, root, data)
            self._stats.num_fetches += 1
            self._stats.prompt_tokens += len(data) // 4
            cache, num_cached, reason = self._restore(keys, found.depth, len(data) // 4)
            self._record(num_cached, found, reason, len(data) // 4)
            return cache, num_cached

    def match(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """Tokens ``fetch`` would restore (from the index only; restores nothing)."""
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            root = self._root(extra)
            keys = chain_keys(root, data, self.config.block_size)
            depth = self._walk(keys, root, data).depth
            return self._plan(keys, depth, len(data) // 4)[1]

    def store(
        self, tokens: Sequence[int], cache: Sequence[Any], *, extra: Mapping[str, str] | None = None
    ) -> int:
        """Keep every new full block of ``cache``; returns how many were new.

        Raises:
            UnsupportedCacheError: a layer's cache type has no codec.
            LayoutMismatchError: the cache does not fit this model's layout.
            ValueError: the cache does not hold exactly ``len(tokens)`` tokens.
        """
        data = token_bytes(tokens)
        with self._lock:
            self._check_open()
            self._validate(cache, len(data) // 4)
            num_new = store_blocks(self, data, cache, self._root(extra))
            self._stats.num_stores += 1
            return num_new

    def capture(
        self,
        tokens_so_far: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
    ) -> int:
        """``store`` for a cache being prefilled: call it after every chunk.

        Window K/V are cut before the window moves on and recurrent state at
        the boundary the cache stands on (see capture.py); e.g. from
        ``generate_step``'s ``prompt_progress_callback`` (``prefill_step_size``
        a multiple of ``block_size``; skip its last call, ``done == total``,
        made once the first generated token is in the cache).
        """
        return self.store(tokens_so_far, cache, extra=extra)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefill_step_size: int | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> tuple[list[Any], mx.array]:
        """``fetch``, prefill the rest in block-aligned chunks, ``capture`` each.

        ``prefill_step_size`` (a multiple of ``block_size``; chunks end on its
        multiples) defaults to ``snapshot_interval`` blocks for models with
        recurrent layers, else ~2048 tokens. Returns (cache, last logits).
        """
        return prefill(self, tokens, prefill_step_size=prefill_step_size, extra=extra)

    def stats(self) -> dict[str, object]:
        with self._lock:
            out = self._stats.as_dict()
            out["hot"] = {
                "num_blocks": len(self.hot),
                "nbytes": self.hot.nbytes,
                "max_bytes": self.hot.max_bytes,
                "num_evictions": self.hot.num_evictions,
            }
            if self.ssd is not None:
                out["ssd"] = self.ssd.stats()
            return out

    def flush(self) -> None:
        """Persist every dirty hot block to the SSD tier and wait for the writer."""
        with self._lock:
            if self.ssd is None:
                return
            for block in self.hot.take_dirty():
                self._spill(block)
            self.ssd.flush()

    def trim_hot(self, max_bytes: int) -> int:
        """Evict LRU hot blocks (leaves first) until at most ``max_bytes`` are held.

        Dirty blocks spill to the SSD tier as on any eviction. Returns how many
        blocks left the hot tier.
        """
        with self._lock:
            return self.hot.evict_to(max(0, max_bytes))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                if self.ssd is not None:
                    self.ssd.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PrefixCache is closed")

    def _root(self, extra: Mapping[str, str] | None) -> bytes:
        items = tuple(sorted(extra.items())) if extra else ()
        root = self._roots.get(items)
        if root is None:
            root = self.namespace.with_extra(extra).root_key()
            self._roots[items] = root
        return root

    def _lookup(self, key: bytes):
        block = self.hot.get(key)
        if block is not None:
            return block
        return self.ssd.get_meta(key) if self.ssd is not None else None

    def _missing_reason(self, key: bytes) -> MissReason:
        return MissReason.EVICTED if key in self._evicted_set else MissReason.NO_PREFIX

    def _walk(self, keys: list[bytes], root: bytes, data: bytes) -> Walk:
        bs = self.config.block_size
        return walk(keys, root, data, bs, self._lookup, self._missing_reason)

    def _usable(self, depth: int, num_tokens: int) -> tuple[int, int]:
        """(blocks to restore, tokens cached): at least one token is left to prefill."""
        bs = self.config.block_size
        if depth * bs < num_tokens:
            return depth, depth * bs
        if all(
            codec.trimmable_at(c, num_tokens - 1)
            for codec, c in zip(self.codecs, self._template, strict=True)
        ):
            return depth, num_tokens - 1
        return depth - 1, (depth - 1) * bs

    def _plan(
        self, keys: list[bytes], depth: int, num_tokens: int
    ) -> tuple[int, int, MissReason | None]:
        """(blocks, tokens, reason) restorable given which payloads blocks hold."""

        def names(index: int) -> Container[str] | None:
            block = self.hot.get(keys[index])
            return None if block is None else block.arrays  # SSD: checked on load

        return plan(
            depth,
            usable=lambda d: self._usable(d, num_tokens),
            fresh=self._fresh,
            payload=names,
            block_size=self.config.block_size,
        )

    def _fresh(self, num_tokens: int) -> list[Any]:
        """Empty caches for the model, quantized where mlx-lm would have quantized."""
        cfg = self.config
        fresh = make_prompt_cache(self.model)
        if cfg.kv_bits is not None and num_tokens >= cfg.quantized_kv_start:
            for i, c in enumerate(fresh):
                if type(c) is KVCache:
                    fresh[i] = QuantizedKVCache(group_size=cfg.kv_group_size, bits=cfg.kv_bits)
        return fresh

    def _restore(
        self, keys: list[bytes], depth: int, num_tokens: int
    ) -> tuple[list[Any], int, MissReason | None]:
        bs = self.config.block_size
        reason = None
        while depth > 0:
            num_blocks, num_cached, why = self._plan(keys, depth, num_tokens)
            reason = reason or why
            if num_blocks <= 0:
                break
            fresh = self._fresh(num_cached)
            capacity = round_up(num_tokens + self.config.restore_headroom)
            loaded: dict[int, Block] = {}
            try:
                cache = rebuild(
                    fresh,
                    [codec_for(c) for c in fresh],
                    num_blocks=num_blocks,
                    num_tokens=num_cached,
                    capacity=capacity,
                    block_size=bs,
                    load=functools.partial(self._load, keys, loaded),
                )
            except Shortfall as short:
                depth, reason = short.index, reason or short.reason
                continue
            self._after_hit(keys[:num_blocks], loaded)
            return cache, num_cached, reason
        return make_prompt_cache(self.model), 0, reason

    def _load(
        self, keys: list[bytes], loaded: dict[int, Block], index: int
    ) -> tuple[dict[str, mx.array], bool]:
        key = keys[index]
        block = self.hot.get(key)
        if block is not None:
            self._stats.hot_block_hits += 1
            return block.arrays, True
        block = self.ssd.load(key) if self.ssd is not None else None
        if block is None:
            raise Shortfall(
                index, MissReason.CORRUPT if self.ssd is not None else MissReason.EVICTED
            )
        self._stats.ssd_block_hits += 1
        loaded[index] = block
        return block.arrays, False

    def _after_hit(self, chain: list[bytes], loaded: dict[int, Block]) -> None:
        if self.config.promote:
            for index in sorted(loaded):
                block = loaded[index]
                if self.hot.nbytes + block.nbytes <= self.hot.max_bytes and self.hot.put(block):
                    self._stats.num_promotions += 1
        self.hot.touch(chain)
        if self.ssd is not None:
            self.ssd.touch([k for k in chain if k not in self.hot])

    def _record(
        self, num_cached: int, found: Walk, reason: MissReason | None, num_tokens: int
    ) -> None:
        stats = self._stats
        stats.cached_tokens += num_cached
        if num_cached:
            stats.num_hits += 1
        else:
            stats.num_misses += 1
        reason = reason or found.reason
        if reason is None and num_tokens % self.config.block_size:
            reason = MissReason.PARTIAL_BLOCK
        if reason is not None:
            stats.miss(reason)

    def _validate(self, cache: Sequence[Any], num_tokens: int) -> None:
        if len(cache) != len(self.layout):
            raise LayoutMismatchError(
                f"cache has {len(cache)} layers, the model has {len(self.layout)}"
            )
        cfg = self.config
        for i, (layer, expected) in enumerate(zip(cache, self.layout, strict=True)):
            codec = codec_for(layer)
            length = codec.length(layer)
            if length is not None and length != num_tokens:
                raise ValueError(
                    f"cache layer {i} holds {length} tokens but {num_tokens} tokens were given"
                )
            if num_tokens == 0:
                continue
            if isinstance(layer, QuantizedKVCache) and (layer.bits, layer.group_size) != (
                cfg.kv_bits,
                cfg.kv_group_size,
            ):
                raise LayoutMismatchError(
                    f"layer {i} is quantized with bits={layer.bits} group_size={layer.group_size}; "
                    f"this PrefixCache has kv_bits={cfg.kv_bits} kv_group_size={cfg.kv_group_size}"
                )
            got = codec.layout(layer)
            if got != expected:
                raise LayoutMismatchError(f"layer {i} layout {got} != this model's {expected}")

    def _keep(self, blocks: list[Block]) -> None:
        write_through = self.ssd is not None and self.config.write_policy == "write_through"
        dirty = self.ssd is not None and not write_through
        warm = []
        for block in blocks:
            self._stats.stored_blocks += 1
            self._stats.stored_bytes += block.nbytes
            self._forget_evicted(block.key)
            if write_through:
                self._spill(block)
            cold = block.parent != block.root and block.parent not in self.hot
            if cold and self.ssd is None:  # its parent is gone: no fetch can reach it
                self._on_hot_evict(block, False)
                continue
            if not self.hot.put(block, dirty=dirty, cold=cold) and dirty:
                self._spill(block)  # larger than the whole hot budget
            if not cold:
                warm.append(block.key)
        self.hot.touch(warm)  # ancestors end up more recent than descendants

    def _replace(self, blocks: list[Block]) -> None:
        """Swap stored blocks for fuller versions a later capture cut."""
        on_ssd = [b.key for b in blocks if self.ssd is not None and self.ssd.contains(b.key)]
        if on_ssd:  # those copies lack the new payloads; a queued one must land first
            self.ssd.flush()
            self.ssd.remove(on_ssd)
        for block in blocks:
            self.hot.pop(block.key)
        num_stored, nbytes = self._stats.stored_blocks, self._stats.stored_bytes
        self._keep(blocks)
        self._stats.stored_blocks, self._stats.stored_bytes = num_stored, nbytes
        self._stats.upgraded_blocks += len(blocks)

    def _spill(self, block: Block) -> None:
        if self.ssd.put(block):
            self._stats.num_spills += 1

    def _on_hot_evict(self, block: Block, dirty: bool) -> None:
        if dirty and self.ssd is not None:
            self._spill(block)
        elif self.ssd is None:
            self._stats.num_discarded += 1
            self._remember_evicted(block.key)

    def _remember_evicted(self, key: bytes) -> None:
        if len(self._evicted) == self._evicted.maxlen:
            self._evicted_set.discard(self._evicted[0])
        self._evicted.append(key)
        self._evicted_set.add(key)

    def _forget_evicted(self, key: bytes) -> None:
        self._evicted_set.discard(key)


def _nonempty(tokens: Sequence[int]) -> bytes:
    data = token_bytes(tokens)
    if not data:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    return data


def _probe_cache(model: nn.Module) -> list[Any]:
    """A cache holding one token, to read the layout (classes, dtypes, shapes)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _build_ssd(config: CacheConfig):
    """The SSD tier, or None: the only place ``hot_cache_only`` is read."""
    if config.hot_cache_only:
        return None
    from .ssd import SsdTier

    return SsdTier(
        config.ssd_path,
        max_bytes=config.ssd_max_bytes,
        min_free_bytes=config.ssd_min_free_bytes,
        queue_bytes=config.write_queue_bytes,
        queue_full=config.queue_full,
    )
