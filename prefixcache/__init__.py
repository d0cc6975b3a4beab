"""prefixcache: a tiered, block-aware prefix cache for MLX language models."""

from .codecs import Codec, LayoutMismatchError, UnsupportedCacheError, register_codec
from .config import CacheConfig
from .manager import PrefixCache
from .stats import MissReason, prometheus_text

__all__ = [
    "CacheConfig",
    "Codec",
    "LayoutMismatchError",
    "MissReason",
    "PrefixCache",
    "UnsupportedCacheError",
    "prometheus_text",
    "register_codec",
]
__version__ = "0.1.0"
