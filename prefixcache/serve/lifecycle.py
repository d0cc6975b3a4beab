"""The server's PrefixCache over its life: opened per model key, hot-only while its
SSD directory cannot be used (and tried again), closed with one summary line.

A storage failure is counted, logged once and served as a miss: never raised
into mlx-lm's generation thread. Not thread-safe: its owner's lock is held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import lmdb
import mlx.nn as nn

from ..cache.prefix_cache import PrefixCache
from ..config import CacheConfig
from ..errors import SsdFormatError, UnsupportedCacheError
from .fit import ModelKey, model_id_of

log = logging.getLogger(__name__)

# What the disk or the index may raise; never passed on to mlx-lm's generation thread.
STORAGE_ERRORS = (OSError, lmdb.Error, SsdFormatError)


class ModelCache:
    """The current model's PrefixCache: opened, degraded to hot-only, retried, closed.

    Args:
        model_for: model key -> the loaded model.
        config: the PrefixCache settings.

    Attributes:
        cache: the open PrefixCache, or None (none opened yet, or the model's
            caches are unsupported).
        key: the model key it is open for.
        num_storage_errors: storage failures turned into misses or dropped inserts.
    """

    def __init__(self, model_for: Callable[[ModelKey], Any], config: CacheConfig) -> None:
        self.config = config
        self.cache: PrefixCache | None = None
        self.key: ModelKey | None = None
        self.num_storage_errors = 0
        self._model_for = model_for
        self._opened = False
        self._hot_only_since: float | None = None  # the SSD tier could not be opened

    @property
    def hot_only(self) -> bool:
        """Serving hot-only because the SSD directory could not be opened."""
        return self._hot_only_since is not None

    def open(self, model_key: ModelKey) -> PrefixCache | None:
        """The PrefixCache for ``model_key``, opening it (and closing another) if needed."""
        if self._opened and model_key == self.key:
            if self._hot_only_since is not None and self._retry_due():
                self._reopen_with_ssd()
            return self.cache
        self.close()
        self.key, self._opened = model_key, True
        try:
            model = self._model_for(model_key)
            self.cache = self._new_cache(model_key, model, self.config)
        except UnsupportedCacheError as err:
            log.warning("prefixcache: %s is served without a prompt cache: %s", model_key, err)
            return None
        log.info("prefixcache: cache for %s open (%s)", model_key, self.cache.namespace.model_id)
        return self.cache

    def _new_cache(self, model_key: ModelKey, model: nn.Module, config: CacheConfig):
        """A PrefixCache; hot-only (one log line) if its SSD directory cannot be used."""
        model_id = model_id_of(model_key, model)
        try:
            cache = PrefixCache(model, config, model_id=model_id)
        except STORAGE_ERRORS as err:
            if config.hot_cache_only:
                raise
            self.num_storage_errors += 1
            self._hot_only_since = time.monotonic()
            log.error(
                "prefixcache: SSD tier %s unusable (%s): serving %s hot-only, retrying in %gs",
                config.ssd_path,
                err,
                model_key,
                config.ssd_retry_seconds,
            )
            return PrefixCache(model, config.replace(hot_cache_only=True), model_id=model_id)
        self._hot_only_since = None
        return cache

    def _retry_due(self) -> bool:
        since = self._hot_only_since
        return since is not None and time.monotonic() - since >= self.config.ssd_retry_seconds

    def _reopen_with_ssd(self) -> None:
        """Swap the hot-only cache for one with the SSD tier, if it opens now (the
        hot blocks are dropped: they were never written anywhere)."""
        old = self.cache
        assert old is not None
        try:
            cache = PrefixCache(old.model, self.config, model_id=old.namespace.model_id)
        except STORAGE_ERRORS as err:
            self._hot_only_since = time.monotonic()
            log.debug("prefixcache: SSD tier still unusable: %s", err)
            return
        old.close()
        self.cache, self._hot_only_since = cache, None
        log.warning("prefixcache: SSD tier %s usable again for %s", self.config.ssd_path, self.key)

    def storage_error(self, what: str, err: BaseException) -> None:
        """A storage failure during ``what``: counted, logged once, served as a miss."""
        self.num_storage_errors += 1
        level = logging.ERROR if self.num_storage_errors == 1 else logging.DEBUG
        log.log(
            level,
            "prefixcache: %s failed (%s: %s); served without the cache",
            what,
            type(err).__name__,
            err,
        )

    def close(self) -> None:
        """Flush and close the open cache; one line says what was persisted and what was
        lost. The next ``open`` opens one again."""
        cache, self.cache = self.cache, None
        self._opened = False
        if cache is None:
            return
        try:
            cache.flush()
        except STORAGE_ERRORS as err:
            self.storage_error("flush", err)
        stats = cache.stats()
        try:
            cache.close()
        except STORAGE_ERRORS as err:
            self.storage_error("close", err)
        summary = " ".join(f"{k}={stats[k]}" for k in _SUMMARY)
        log.info("prefixcache: closed cache for %s: %s %s", self.key, summary, _fate(stats))
        self.key = None


def _fate(stats: dict[str, object]) -> str:
    """What reached the SSD tier this session and what did not (blocks)."""
    ssd = stats.get("ssd")
    if not isinstance(ssd, dict):
        return f"persisted_blocks=0 lost_blocks={stats['hot']['num_blocks']} (hot-only)"
    text = f"persisted_blocks={ssd['num_writes']} lost_blocks={ssd['num_dropped_writes']}"
    if not ssd["enabled"]:
        text += f" ssd_failures={ssd['num_failures']} (SSD writes off at close)"
    return text


_SUMMARY = (
    "num_fetches",
    "num_hits",
    "prompt_tokens",
    "cached_tokens",
    "hot_block_hits",
    "ssd_block_hits",
    "stored_blocks",
    "num_spills",
    "prefetched_blocks",
    "prefetch_hits",
)
