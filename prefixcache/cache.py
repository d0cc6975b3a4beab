"""PrefixCache: the facade a scheduler calls around its prefill. Policy lives here."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .capture import cut_blocks
from .config import CacheConfig
from .errors import MissReason
from .hashing import Namespace, chain_keys, token_bytes
from .layout import ModelLayout
from .lookup import Lookup
from .model_id import model_fingerprint
from .periodic import Periodic
from .shared import fetch_shared, shared_stats
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
        shed = self.layout.without_state if self.layout.state_prefixes else None
        self.tiers = Tiers(self.config, self._stats, lower, shed)
        self.lookup = Lookup(self.config, self.layout, self.tiers)
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

    def fetch(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None, shared: bool = False
    ) -> tuple[list[Any], int]:
        """A fresh cache holding the longest cached prefix of ``tokens``.

        Full blocks of the chain, then the part of a stored block or tail the
        prompt shares (see :class:`Match`). Always leaves at least one token to
        prefill. ``shared=True``: one K/V copy for all sequences (prefixcache.shared).

        Returns:
            (cache list for the model, number of tokens it holds)
        """
        if shared:
            return fetch_shared(self, tokens, extra=extra)
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            found = self.lookup.match(data, self._root(extra))
            num_tokens = len(data) // 4
            cache, num_cached, reason = self.lookup.restore(found, num_tokens)
            reason = reason or found.reason
            shared = found.depth * self.config.block_size + found.common
            if reason is None and num_cached < min(shared, num_tokens - 1):
                reason = MissReason.PARTIAL_BLOCK  # a stored block shared more, unusably
            self._stats.fetched(num_tokens, num_cached, reason)
            return cache, num_cached

    def match(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """Tokens ``fetch`` would restore (from the index only; restores nothing)."""
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            found = self.lookup.match(data, self._root(extra))
            return self.lookup.plan(found, found.depth + 1, len(data) // 4)[1]

    def stored_prefix(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> int:
        """Tokens of ``tokens`` some stored sequence shares, restorable or not.

        Where this exceeds ``match`` on a model with recurrent layers, the
        stored sequences branch there without state to resume from: a
        scheduler that calls ``store`` at the block boundary below it
        (as ``prefill`` does) lets the next prompt branching there hit.
        """
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            found = self.lookup.match(data, self._root(extra))
            return found.depth * self.config.block_size + found.common

    def store(
        self, tokens: Sequence[int], cache: Sequence[Any], *, extra: Mapping[str, str] | None = None
    ) -> int:
        """Keep every new full block of ``cache`` (returns how many) and its tail.

        ``cache`` is a finished sequence: every layer's state at its exact end
        is kept (the tail, the tokens after the last full block, as a tail
        block; recurrent state with the block or tail ending there), so the
        next turn of a conversation reuses all of this one, recurrent models
        included.

        Raises:
            UnsupportedCacheError: a layer's cache type has no codec.
            LayoutMismatchError: the cache does not fit this model's layout.
            ValueError: the cache does not hold exactly ``len(tokens)`` tokens.
        """
        return self._store(tokens, cache, extra, at_end=True)

    def capture(
        self,
        tokens_so_far: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
    ) -> int:
        """``store`` for a cache being prefilled: call it after every chunk.

        Window K/V are cut before the window moves on and recurrent state every
        ``snapshot_interval`` blocks (see capture.py); e.g. from
        ``generate_step``'s ``prompt_progress_callback`` (``prefill_step_size``
        a multiple of ``block_size``; skip its last call, ``done == total``,
        made once the first generated token is in the cache). Call ``store``
        once the sequence is complete: it keeps the state at its end.
        """
        return self._store(tokens_so_far, cache, extra, at_end=False)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefill_step_size: int | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> tuple[list[Any], mx.array]:
        """``fetch``, prefill the rest in block-aligned chunks, ``capture`` each.

        ``prefill_step_size`` (a multiple of ``block_size``; chunks end on its
        multiples) defaults to the snapshot interval (``layout.snapshot_interval``) for models with
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
            return self._stats.as_dict() | self.tiers.snapshot() | shared_stats(self)

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

    def _store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        extra: Mapping[str, str] | None,
        *,
        at_end: bool,
    ) -> int:
        data = token_bytes(tokens)
        with self._lock:
            self._check_open()
            self.layout.validate(cache, len(data) // 4)
            root = self._root(extra)
            bs = self.config.block_size
            keys = chain_keys(root, data, bs)
            cut = cut_blocks(
                keys,
                root,
                data,
                cache,
                block_size=bs,
                snapshot_interval=self.layout.snapshot_interval,
                at_end=at_end,
                stored=self.tiers.contains,
                resident=self.hot.get,
                window=self.layout.window_policy,
            )
            self.tiers.keep(cut.new)
            self.tiers.replace(cut.upgraded)
            tail = cut.tail
            if tail is not None:
                self.tiers.keep_tail(tail)
            if self.layout.trimmable_at(1):  # recurrent state: a tail's end state is its own
                for block in [*cut.new[-1:], *([tail] if tail else [])]:
                    self.hot.drop_superseded(block)
            self._stats.num_stores += 1
            return len(cut.new)

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


def _nonempty(tokens: Sequence[int]) -> bytes:
    data = token_bytes(tokens)
    if not data:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    return data
