"""PrefixCache: the facade a scheduler calls around its prefill. Policy lives here."""

from __future__ import annotations

import threading
from collections.abc import Container, Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .capture import cut_blocks
from .codecs import codec_for, round_up
from .config import CacheConfig
from .errors import MissReason, Shortfall
from .hashing import Namespace, chain_keys, token_bytes
from .layout import ModelLayout
from .model_id import model_fingerprint
from .periodic import Periodic
from .restore import Walk, plan, rebuild, walk
from .stats import Stats, counter_delta
from .tiers import lower_tiers
from .tiers.base import Tier
from .tiers.hot import HotTier
from .tiers.stack import Tiers


class PrefixCache:
    """A tiered, block-aware prefix cache for one model.

    Args:
        model: the mlx-lm model whose caches are stored.
        config: settings; defaults to ``CacheConfig.from_env()``.
        model_id: identity of the weights (e.g. "org/name@revision"); when
            omitted, a fingerprint of the weights is used.
        tiers: the tiers below hot, in lookup order, instead of those the
            config builds (e.g. a tier of another package); they are closed
            with the cache.
    """

    def __init__(
        self,
        model: nn.Module,
        config: CacheConfig | None = None,
        *,
        model_id: str | None = None,
        tiers: Sequence[Tier] | None = None,
    ):
        self.model = model
        self.config = config if config is not None else CacheConfig.from_env()
        self._lock = threading.RLock()
        self._stats = Stats()
        self.layout = ModelLayout(model, self.config)
        self.namespace = Namespace(
            model_id or model_fingerprint(model), self.layout.signature, self.layout.kv_quant
        )
        self._roots: dict[tuple[tuple[str, str], ...], bytes] = {}
        lower = lower_tiers(self.config) if tiers is None else list(tiers)
        self.tiers = Tiers(self.config, self._stats, lower)
        self._saved: dict[str, object] = self._stats.as_dict()  # counters as last saved
        self._closed = False
        seconds = self.config.counters_save_seconds
        self._saver = (  # a killed process loses at most `seconds` of counters
            Periodic(seconds, self._save_counters_now, "prefixcache-counters")
            if seconds > 0 and self.tiers.lower
            else None
        )

    @property
    def hot(self) -> HotTier:
        return self.tiers.hot

    @property
    def ssd(self) -> Any:
        """The SSD tier, or None (``hot_cache_only``)."""
        return self.tiers.named("ssd")

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
            keys, found, owners = self._match(data, extra)
            num_tokens = len(data) // 4
            cache, num_cached, reason = self._restore(keys, owners, found.depth, num_tokens)
            reason = reason or found.reason
            if reason is None and num_tokens % self.config.block_size:
                reason = MissReason.PARTIAL_BLOCK
            self._stats.fetched(num_tokens, num_cached, reason)
            return cache, num_cached

    def match(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """Tokens ``fetch`` would restore (from the index only; restores nothing)."""
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            keys, found, _ = self._match(data, extra)
            return self._plan(keys, found.depth, len(data) // 4)[1]

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
            self.layout.validate(cache, len(data) // 4)
            root = self._root(extra)
            cut = cut_blocks(
                chain_keys(root, data, self.config.block_size),
                root,
                data,
                cache,
                block_size=self.config.block_size,
                snapshot_interval=self.config.snapshot_interval,
                first=0,
                stored=self.tiers.contains,
                resident=self.hot.get,
            )
            self.tiers.keep(cut.new)
            self.tiers.replace(cut.upgraded)
            self._stats.num_stores += 1
            return len(cut.new)

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
        from .prefill import prefill

        return prefill(self, tokens, prefill_step_size=prefill_step_size, extra=extra)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """Report a prefill of ``num_tokens`` that took ``seconds`` (``prefill`` does;
        a scheduler with its own loop may): the remote tier's cost gate weighs
        fetching a prefix against recomputing it at this speed."""
        with self._lock:
            self.tiers.note_prefill(num_tokens, seconds)

    def stats(self) -> dict[str, object]:
        with self._lock:
            return self._stats.as_dict() | self.tiers.snapshot()

    def flush(self) -> None:
        """Persist every dirty hot block to the lower tiers and wait for their writes."""
        with self._lock:
            self.tiers.flush()
            self._save_counters()

    def trim_hot(self, max_bytes: int) -> int:
        """Evict LRU hot blocks (leaves first) until at most ``max_bytes`` are held.

        Dirty blocks spill to the lower tiers as on any eviction. Returns how
        many blocks left the hot tier.
        """
        with self._lock:
            return self.hot.evict_to(max(0, max_bytes))

    def close(self) -> None:
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.stop()  # not under the lock: its last call may be waiting for it
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.tiers.flush()
                self._save_counters()
            finally:
                self.tiers.close()

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
            namespace = self.namespace.with_extra(extra)
            root = self._roots[items] = namespace.root_key()
            # once per root per process: `prefixcache stats` per model
            self.tiers.note_namespace(root, namespace.to_json())
        return root

    def _save_counters_now(self) -> None:
        with self._lock:
            if not self._closed:
                self._save_counters()

    def _save_counters(self) -> None:
        """Add the counters since the last save to the lower tiers' record of this model."""
        now = self._stats.as_dict()
        self.tiers.save_counters(self._root(None), counter_delta(now, self._saved))
        self._saved = now

    def _match(
        self, data: bytes, extra: Mapping[str, str] | None
    ) -> tuple[list[bytes], Walk, list[int]]:
        """(chain keys of ``data``, how far the tiers match it, the tier of each block)."""
        root = self._root(extra)
        keys = chain_keys(root, data, self.config.block_size)
        entries, owners = self.tiers.chain(keys)
        found = walk(entries, root, data, self.config.block_size)
        if found.reason is None and found.depth < len(keys):
            found = Walk(found.depth, self.tiers.missing_reason(keys[found.depth]))
        return keys, found, owners

    def _usable(self, depth: int, num_tokens: int) -> tuple[int, int]:
        """(blocks to restore, tokens cached): at least one token is left to prefill."""
        bs = self.config.block_size
        if depth * bs < num_tokens:
            return depth, depth * bs
        if self.layout.trimmable_at(num_tokens - 1):
            return depth, num_tokens - 1
        return depth - 1, (depth - 1) * bs

    def _plan(
        self, keys: list[bytes], depth: int, num_tokens: int
    ) -> tuple[int, int, MissReason | None]:
        """(blocks, tokens, reason) restorable given which payloads blocks hold."""

        def names(index: int) -> Container[str] | None:
            block = self.hot.get(keys[index])
            return None if block is None else block.arrays  # lower tiers: checked on load

        return plan(
            depth,
            usable=lambda d: self._usable(d, num_tokens),
            fresh=self.layout.fresh,
            payload=names,
            block_size=self.config.block_size,
        )

    def _restore(
        self, keys: list[bytes], owners: list[int], depth: int, num_tokens: int
    ) -> tuple[list[Any], int, MissReason | None]:
        reason = None
        while depth > 0:
            num_blocks, num_cached, why = self._plan(keys, depth, num_tokens)
            reason = reason or why
            if num_blocks <= 0:
                break
            fresh = self.layout.fresh(num_cached)
            loader = self.tiers.chain_load(keys, owners)
            try:
                cache = rebuild(
                    fresh,
                    [codec_for(c) for c in fresh],
                    loader,
                    num_blocks=num_blocks,
                    num_tokens=num_cached,
                    capacity=round_up(num_tokens + self.config.restore_headroom),
                    block_size=self.config.block_size,
                )
            except Shortfall as short:
                depth, reason = short.index, reason or short.reason
                continue
            self.tiers.after_hit(keys[:num_blocks], loader.loaded)
            return cache, num_cached, reason
        return make_prompt_cache(self.model), 0, reason


def _nonempty(tokens: Sequence[int]) -> bytes:
    data = token_bytes(tokens)
    if not data:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    return data
