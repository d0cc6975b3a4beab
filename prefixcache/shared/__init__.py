"""One physical copy of a shared prefix across concurrent sequences.

``PrefixCache.fetch(tokens, shared=True)`` returns caches whose attention
layers read the prefix's K/V from one read-only buffer per layer, held once
however many sequences use it, and write only their own suffix; the last
sequence to let go of a prefix frees it. Attention is split over prefix and
suffix and merged by log-sum-exp inside mlx-lm's attention function (the
hook); sequences on one prefix decode together as one batch
(:class:`SharedBatchKVCache`). See docs/shared-prefix.md.
"""

from . import codec as _codec  # registers the shared caches' codecs  # noqa: F401
from .batch import SharedBatchKVCache
from .build import release
from .caches import SharedKVCache, SharedQuantizedKVCache
from .hook import SharedAttention, hooked, install, installed, uninstall
from .prefix import LayerPrefix, SharedPrefix
from .registry import SharedRegistry

__all__ = [
    "LayerPrefix",
    "SharedAttention",
    "SharedBatchKVCache",
    "SharedKVCache",
    "SharedPrefix",
    "SharedQuantizedKVCache",
    "SharedRegistry",
    "hooked",
    "install",
    "installed",
    "release",
    "uninstall",
]
