"""Tiers: where blocks live. ``base`` is the contract; ``hot`` is always first.

A new tier is one module implementing :class:`~prefixcache.tiers.base.Tier`
plus one line in :func:`lower_tiers`.
"""

from __future__ import annotations

from ..config import CacheConfig
from ..extras import require
from .base import Tier


def lower_tiers(config: CacheConfig) -> list[Tier]:
    """The tiers below hot, in lookup order (ssd, remote): the only place
    ``hot_cache_only`` and ``remote_url`` are read."""
    tiers: list[Tier] = []
    if not config.hot_cache_only:
        from .ssd import SsdTier  # LMDB and the writer thread only when an SSD tier is used

        tiers.append(SsdTier(config))
    if config.remote_url is not None:
        require("redis", extra="remote", feature=f"remote_url={config.remote_url!r}")
        from .remote import RemoteTier  # the redis client only when a server is configured

        tiers.append(RemoteTier(config))
    return tiers
