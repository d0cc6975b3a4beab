"""One sequence's layer caches over a shared prefix: the prefix read-only, the suffix private.

:class:`SharedKVCache` is what ``fetch(tokens, shared=True)`` returns in place
of a KVCache or a sliding-window RotatingKVCache; :class:`SharedQuantizedKVCache`
replaces a QuantizedKVCache. ``merge`` (as mlx-lm's BatchGenerator calls it)
makes several of them one :class:`SharedBatchKVCache`.

The suffix is an mlx-lm cache of its own (KVCache, QuantizedKVCache), so it
grows and trims as mlx-lm's do. ``update_and_fetch`` returns, lazily, the keys
an unshared cache would hold (prefix then suffix): the attention hook never
evaluates them, and a model that bypasses the hook still computes the right
attention from them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    create_attention_mask,
)

from .batch import SharedBatchKVCache
from .dense import joined, window_mask
from .hook import SharedAttention
from .prefix import LayerKind, LayerPrefix, Lease
from .split import Group, split_attention


class SharedKVCache(SharedAttention):
    """One sequence's attention layer: positions ``[0, end)`` in a shared prefix
    (a window layer: its last window), then a private suffix.

    Args:
        kind: the layer's kind (window, packing, signature of the cache it replaces).
        prefix: the shared prefix K/V, or None (a sequence with no shared prefix,
            or a window layer past it).
        end: the position the suffix starts at (<= ``prefix.end``).
        lease: the sequence's hold on the prefix (None without prefix).
        suffix: the private suffix cache (default: a new, empty one).
    """

    def __init__(
        self,
        kind: LayerKind,
        prefix: LayerPrefix | None,
        end: int,
        lease: Lease | None,
        suffix: Any = None,
    ):
        super().__init__()
        self.kind, self.prefix, self.end, self.lease = kind, prefix, end, lease
        if suffix is None:
            q = kind.quant
            suffix = QuantizedKVCache(q.group_size, q.bits) if q else KVCache()
        self.suffix = suffix

    @property
    def offset(self) -> int:
        return self.end + self.suffix.offset

    def size(self) -> int:
        return self.offset

    @property
    def num_visible(self) -> int:
        """Prefix tokens the keys hold (a window layer's last window)."""
        return 0 if self.prefix is None else self.end - self.prefix.start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        # lazy: computed only if the hook is bypassed (dense.py)
        sk, sv = joined(self.prefix, self.end, *self.suffix.update_and_fetch(keys, values))
        self._fetched = sk
        return sk, sv

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        window = window_size or self.kind.window
        if window is None:  # every key from position 0: mlx-lm's own mask
            return create_attention_mask(N, self.offset, return_array, None)
        return window_mask(self.end - self.num_visible, self.end, self.offset, N, window)

    def _attend(self, queries: mx.array, scale: float, mask: Any, sinks: Any) -> mx.array:
        visible = self.num_visible
        groups = [Group(None, *self.prefix.attended(self.end), 0)] if visible else []
        suffix = self.suffix.keys_and_values() if self.suffix.offset else None
        out = split_attention(
            queries,
            groups,
            suffix,
            prefix_columns=visible,
            scale=scale,
            mask=mask,
            sinks=sinks,
            quant=self.kind.quant,
        )
        if self.kind.window is not None:
            self._forget(self.kind.window)
        return out

    def _forget(self, window: int) -> None:
        """Drop the suffix tokens no later query can see, a step at a time, as a
        ring would (after the attention, so every layer's layout moves together)."""
        dead = self.offset - (window - 1) - self.end  # the next query sees none of these
        if dead < self.suffix.step:
            return
        keys, values = self.suffix.keys_and_values()
        kept = KVCache()
        kept.update_and_fetch(keys[..., dead:, :], values[..., dead:, :])
        # the prefix (all before ``end``) is out of the window too
        self.prefix, self.end, self.suffix = None, self.end + dead, kept

    def is_trimmable(self) -> bool:
        # a window layer holds the prefix's last window only: positions from 0 while short
        return self.kind.window is None or self.offset < self.kind.window

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        cut = self.suffix.trim(min(n, self.suffix.offset))
        self.end -= n - cut  # into the prefix: fewer of its tokens are seen
        return n

    @property
    def state(self) -> Any:
        return self.suffix.state if self.suffix.offset else []

    @property
    def nbytes(self) -> int:
        """Private bytes (the suffix); the shared prefix is counted once, by fetch's stats."""
        return self.suffix.nbytes if self.suffix.offset else 0

    def release(self) -> None:
        """Let go of the prefix now (the cache is unusable after)."""
        q = self.kind.quant
        self.prefix, self.lease, self.end = None, None, 0
        self.suffix = QuantizedKVCache(q.group_size, q.bits) if q else KVCache()

    @classmethod
    def merge(cls, caches: list[Any]) -> SharedBatchKVCache:
        return SharedBatchKVCache.merge(caches, single=cls)


class SharedQuantizedKVCache(SharedKVCache):
    """A SharedKVCache of packed K/V (mlx-lm's QuantizedKVCache split)."""

    @property
    def bits(self) -> int:
        return self.kind.quant.bits

    @property
    def group_size(self) -> int:
        return self.kind.quant.group_size

    @classmethod
    def merge(cls, caches: list[Any]) -> SharedBatchKVCache:
        raise ValueError("quantized K/V cannot be batched (mlx-lm has no batch QuantizedKVCache)")
