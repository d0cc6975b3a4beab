"""prefixcache: a tiered, block-aware prefix cache for MLX language models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import LayoutMismatchError, MissReason, UnsupportedCacheError

if TYPE_CHECKING:
    from .cache.explanation import Explanation, Why
    from .cache.prefix_cache import PrefixCache
    from .codecs import Codec, register_codec
    from .config import CacheConfig
    from .prometheus import prometheus_text
    from .stats_types import CacheStats

# Exported names are imported on first use: the inspection CLI (``prefixcache
# stats``...) then starts without importing mlx-lm (~1 s of transformers).
_EXPORTS = {
    "CacheConfig": ".config",
    "CacheStats": ".stats_types",
    "Codec": ".codecs",
    "Explanation": ".cache.explanation",
    "PrefixCache": ".cache.prefix_cache",
    "prometheus_text": ".prometheus",
    "register_codec": ".codecs",
    "Why": ".cache.explanation",
}
__all__ = [
    "CacheConfig",
    "CacheStats",
    "Codec",
    "Explanation",
    "LayoutMismatchError",
    "MissReason",
    "PrefixCache",
    "UnsupportedCacheError",
    "Why",
    "prometheus_text",
    "register_codec",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
