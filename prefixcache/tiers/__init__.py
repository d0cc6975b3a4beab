"""Tiers: where blocks live. ``base`` is the contract; ``hot`` is always first.

A new tier is one module implementing :class:`~prefixcache.tiers.base.Tier`
plus one line in :func:`lower_tiers`.
"""

from __future__ import annotations

from ..config import CacheConfig
from .base import Tier


def lower_tiers(config: CacheConfig) -> list[Tier]:
    """The tiers below hot, in lookup order: the only place ``hot_cache_only`` is read."""
    if config.hot_cache_only:
        return []
    from .ssd import SsdTier  # LMDB and the writer thread only when an SSD tier is used

    return [SsdTier(config)]
