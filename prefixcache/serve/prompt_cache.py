"""mlx-lm server adapter: its prompt-cache interface backed by PrefixCache.

mlx-lm's server keeps a RAM-only, whole-prompt ``LRUPromptCache``.
``TieredPromptCache`` answers the same calls from blocks shared between
conversations, hot in RAM and, unless hot-only, on SSD across restarts.

mlx-lm calls it on its generation thread, where an exception ends the loop and fails every
request in flight. So no failure of the cache's storage gets there: a request the cache
cannot serve is a miss, an insert it cannot keep is dropped; each is counted and logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.nn as nn

from ..cache.prefix_cache import PrefixCache
from ..config import CacheConfig
from ..errors import UnsupportedCacheError
from ..tiers import quiet
from .batch import batch_ready
from .deferred import DEFERRED_TYPES, Deferred, DeferredInserts
from .explain import Explained
from .fit import ModelKey, check_mlx_lm_version, held_tokens
from .images import chain_tokens, fetch_whole_images
from .lifecycle import STORAGE_ERRORS as _STORAGE_ERRORS
from .lifecycle import ModelCache
from .request_options import Requests

log = logging.getLogger(__name__)


class TieredPromptCache:
    """mlx-lm's server prompt cache, backed by one PrefixCache per model key.

    Only the current model key's PrefixCache is open: mlx-lm's server holds one
    model at a time and an open PrefixCache keeps its model alive, so a switch
    closes the previous one (its dirty hot blocks go to SSD first). Blocks are
    namespaced by the model's weights and cache layout, so a restart (or the
    same weights under another path) finds them again.

    Args:
        model_for: model key -> the loaded model (a ``ModelPair`` when the key has a draft model).
        config: PrefixCache settings; defaults to ``CacheConfig.from_env()``.
        shared: fetch with ``shared=True``: concurrent requests on one prefix
            hold its K/V once and decode against it together (a miss gets
            empty caches of the same types, so mlx-lm's batches merge them).

    Raises:
        MlxLmVersionError: the installed mlx-lm is not supported.
    """

    def __init__(
        self,
        model_for: Callable[[ModelKey], nn.Module],
        config: CacheConfig | None = None,
        *,
        shared: bool = False,
    ):
        check_mlx_lm_version()
        self.shared = shared
        self.config = config if config is not None else CacheConfig.from_env()
        self._lock = threading.RLock()
        self.model_cache = ModelCache(model_for, self.config)
        self._last: tuple[ModelKey, list[int], int] | None = None  # the last fetch
        self.num_rejected = 0  # inserts refused (unsupported cache, layout or length)
        self.requests = Requests()  # per-request options (request_options.py)
        self.num_unattributed = 0  # inserts several tenants' requests could own: not stored
        self._deferred = DeferredInserts()  # inserts before a first token (mlx_deferred.py)
        self.explained = Explained(enabled=self.config.explain_header)  # serve's header
        self.batch_busy = False  # requests were in flight when this one was taken (batch.py)

    @property
    def cache(self) -> PrefixCache | None:
        """The open model's PrefixCache, or None."""
        return self.model_cache.cache

    # -- mlx-lm's prompt-cache interface (LRUPromptCache's names) ----------------

    def fetch_nearest_cache(
        self, model: ModelKey, tokens: Sequence[int]
    ) -> tuple[list[Any] | None, list[int]]:
        """(cache holding the longest cached prefix or None, tokens still to prefill).

        ``model`` is mlx-lm's model key (model path, adapter path, draft path).
        """
        tokens = list(tokens)
        with self._lock:
            self._last = None
            self._store_deferred(tokens if model == self.model_cache.key else None)
            cache = self.model_cache.open(model)
            if cache is None or not tokens:
                return None, tokens
            try:
                # only what was restored: the server reports it as cached_tokens
                extra = self.requests.for_fetch(tokens).extra
                room = 0 if self.batch_busy else None  # busy: no room for the rest
                restored, num_cached = fetch_whole_images(cache, tokens, extra, self.shared, room)
            except _STORAGE_ERRORS as err:
                self.model_cache.storage_error("fetch", err)
                return (cache.shared_prefixes.blank_caches() if self.shared else None), tokens
            self._last = (model, tokens, num_cached)
            self.explained.put(tokens, cache, chain_tokens(tokens), extra)
        if num_cached == 0 and not self.shared:
            return None, tokens
        return (restored if self.shared else batch_ready(restored)), tokens[num_cached:]

    def checkpoints(self, model: ModelKey, tokens: Sequence[int], num_cached: int = 0) -> list[int]:
        """Where the server's prefill of ``tokens`` should stop so the cache keeps state
        there (``PrefixCache.checkpoints``; empty when the layout needs none)."""
        tokens = list(tokens)
        text = chain_tokens(tokens)
        with self._lock:
            self._store_deferred(tokens if model == self.model_cache.key else None)
            cache = self.model_cache.open(model)
            if cache is None or not text:
                return []
            try:
                extra = self.requests.for_fetch(tokens).extra
                return cache.checkpoints(text, num_cached, extra=extra)
            except _STORAGE_ERRORS as err:
                self.model_cache.storage_error("checkpoints", err)
                return []

    def prefetch(
        self, model: ModelKey, tokens: Sequence[int], extra: Mapping[str, str] | None = None
    ) -> int:
        """Start promoting the lower-tier blocks of ``tokens``' restore into hot
        (``PrefixCache.prefetch``), for the model whose cache is open only: a
        request for another model never switches it from the HTTP thread."""
        text = chain_tokens(list(tokens))
        with self._lock:
            cache = self.model_cache.cache
            if cache is None or model != self.model_cache.key or self.shared or not text:
                return 0
            try:
                return cache.prefetch(text, extra=extra)
            except _STORAGE_ERRORS as err:
                self.model_cache.storage_error("prefetch", err)
                return 0

    def last_fetch(self) -> tuple[ModelKey, list[int], int] | None:
        """(model key, tokens, tokens restored) of the last ``fetch_nearest_cache``."""
        with self._lock:
            return self._last

    def insert_cache(
        self,
        model: ModelKey,
        tokens: Sequence[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """Keep every new full block of ``prompt_cache`` (which holds ``tokens``).

        ``cache_type`` (system / user / assistant) is accepted for the
        interface: blocks are shared, and eviction already drops leaves (the
        conversation tails) before the prefixes they extend. A "system" or
        "user" insert comes before the request's first token: it is stored at
        the adapter's next call from the generation thread (mlx_deferred.py).
        """
        with self._lock:
            tokens = list(tokens)
            options = self.requests.for_insert(tokens)  # the final insert closes the request
            if options is None:
                self.num_unattributed += 1
                return
            item = Deferred(model, tokens, list(prompt_cache), cache_type, options)
            if model == self.model_cache.key and cache_type in DEFERRED_TYPES:
                if not self._deferred.add(item):  # too many or too large to wait
                    self._store(item)
                return
            # the request ended and the next one's fetch follows: its writes wait
            quiet.open_window(self.config.background_quiet_ms / 1000)
            self._store_deferred()  # first: they hold a prefix of a request's last insert
            self._store(item)

    def _store_deferred(self, tokens: list[int] | None = None) -> None:
        """Store the deferred inserts (``DeferredInserts.take``: all, or those a
        fetch of ``tokens`` could use); those of a model no longer open are dropped."""
        for item in self._deferred.take(tokens, self.config.block_size):
            if item.model == self.model_cache.key:
                self._store(item)

    def _store(self, item: Deferred) -> None:
        cache = self.model_cache.open(item.model)
        text = chain_tokens(item.tokens)
        if cache is None or not text:
            return
        opts = item.options
        try:
            held = held_tokens(text, item.cache)
            keep = {n: getattr(opts, n) for n in ("extra", "session", "persist", "tenant")}
            # mlx-lm is done with the cache; a shared fetch never reads kept sequences
            cache.store(held, item.cache, hand_over=not self.shared, **keep)
            if opts.pin_tokens and len(held) >= opts.pin_tokens:
                cache.pin(held[: opts.pin_tokens], extra=opts.extra)
        except (ValueError, UnsupportedCacheError) as err:  # includes LayoutMismatchError
            # Raising here would kill mlx-lm's generation thread: refuse the insert instead.
            self.num_rejected += 1
            level = logging.WARNING if self.num_rejected == 1 else logging.DEBUG
            log.log(level, "prefixcache: %s cache not stored: %s", item.cache_type, err)
        except _STORAGE_ERRORS as err:
            self.model_cache.storage_error("insert", err)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Evict hot blocks down to ``n_bytes`` (dirty ones spill to SSD).

        Blocks are shared between sequences, so there is no per-sequence unit to
        drop: ``n_sequences=0`` empties the hot tier, other counts keep it. The
        blocks of the request last fetched go first where its insert at the end puts
        them back into hot (``PrefixCache.trim_hot``'s ``first``): mlx-lm trims right
        after admitting it, so it is in flight and its cache holds them too.
        """
        limit = None if n_bytes is None else max(0, n_bytes)
        if n_sequences is not None and n_sequences <= 0:
            limit = 0
        with self._lock:
            if limit is not None and self.model_cache.cache is not None and self.nbytes > limit:
                first = extra = None
                if (
                    self._last is not None
                    and self._last[0] == self.model_cache.key
                    and not self.shared
                ):
                    first = chain_tokens(self._last[1])
                    extra = self.requests.for_fetch(self._last[1]).extra
                try:
                    self.model_cache.cache.trim_hot(limit, first=first, extra=extra)
                except _STORAGE_ERRORS as err:  # spilling evicted blocks
                    self.model_cache.storage_error("trim", err)

    def __len__(self) -> int:
        """Hot blocks held (the unit of this cache; sequences share them)."""
        with self._lock:
            return len(self.model_cache.cache.hot) if self.model_cache.cache is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM by the hot tier."""
        with self._lock:
            return self.model_cache.cache.hot.nbytes if self.model_cache.cache is not None else 0

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Per tier: ``n_sequences`` (blocks held) and ``n_bytes``, as mlx-lm logs them."""
        with self._lock:
            cache = self.model_cache.cache
            out = {"hot": {"n_sequences": len(self), "n_bytes": self.nbytes}}
            if cache is not None and cache.ssd is not None:
                try:
                    ssd = cache.ssd.stats()
                except _STORAGE_ERRORS as err:  # mlx-lm logs these on its generation thread
                    self.model_cache.storage_error("stats", err)
                    return out
                out["ssd"] = {"n_sequences": ssd["num_blocks"], "n_bytes": ssd["nbytes"]}
            return out

    # -- ours --------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """The open PrefixCache's stats plus the adapter's counters."""
        with self._lock:
            out = self.model_cache.cache.stats() if self.model_cache.cache is not None else {}
            return {
                **out,
                "model_key": self.model_cache.key,
                "num_rejected": self.num_rejected,
                "num_storage_errors": self.model_cache.num_storage_errors,
                "num_unattributed": self.num_unattributed,
                "hot_only": int(self.model_cache.hot_only),
            }

    def end_session(self, session: str) -> int:
        """``PrefixCache.end_session`` on the open model's cache: how many blocks went.

        Raises:
            ValueError: unknown ``session`` (or no model's cache is open).
        """
        with self._lock:
            if self.model_cache.cache is None:
                raise ValueError(f"unknown session {session!r}: no request was served yet")
            return self.model_cache.cache.end_session(session)

    def close(self) -> None:
        """Store the deferred inserts, flush and close the open PrefixCache; logs its
        counters."""
        with self._lock:
            self._store_deferred()
            self.model_cache.close()

    def __enter__(self) -> TieredPromptCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
