"""Layer caches over a shared prefix: the prefix read-only, the suffix private.

:class:`SharedKVCache` is one sequence's attention layer (what
``fetch(tokens, shared=True)`` returns in place of a KVCache or a
sliding-window RotatingKVCache); :class:`SharedQuantizedKVCache` replaces a
QuantizedKVCache; :class:`SharedBatchKVCache` is several sequences decoding
together (``merge``, as mlx-lm's BatchGenerator calls it), each group of
sequences on one prefix attending to it with one matmul.

The suffix is an mlx-lm cache of its own (KVCache, QuantizedKVCache,
BatchKVCache), so it grows, pads, filters and extracts as mlx-lm's do.
``update_and_fetch`` returns, lazily, the keys an unshared cache would hold
(prefix then suffix): the attention hook never evaluates them, and a model
that bypasses the hook still computes the right attention from them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    create_attention_mask,
)

from .dense import batch_positions, joined, padded, position_mask, window_mask
from .hook import SharedAttention
from .prefix import LayerKind, LayerPrefix, Lease
from .split import Group, split_attention


class SharedKVCache(SharedAttention):
    """One sequence's attention layer: positions ``[0, end)`` in a shared prefix
    (a window layer: its last window), then a private suffix.

    Args:
        kind: the layer's kind (window, packing, signature of the cache it replaces).
        prefix: the shared prefix K/V, or None (a sequence with no shared prefix).
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
        if prefix is None and end:
            raise ValueError(f"end={end} without a prefix")
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
        return SharedBatchKVCache.merge(caches)


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


class SharedBatchKVCache(SharedAttention):
    """Several sequences' attention layer: per row a shared prefix (or none) and a
    row of one BatchKVCache suffix (left-padded, as mlx-lm's batches are)."""

    def __init__(self, kind: LayerKind, rows: list[tuple[Any, int, Any]], suffix: BatchKVCache):
        super().__init__()
        self.kind, self.rows, self.suffix = kind, rows, suffix  # rows: (prefix, end, lease)

    @classmethod
    def merge(cls, caches: list[Any]) -> SharedBatchKVCache:
        """One batch of single caches (plain KVCaches join as rows without a prefix)."""
        kinds = {c.kind for c in caches if isinstance(c, SharedKVCache)}
        if len(kinds) != 1 or any(not isinstance(c, SharedKVCache | KVCache) for c in caches):
            raise ValueError(
                f"cannot batch layers of kinds {kinds} with {[type(c) for c in caches]}"
            )
        rows = [
            (c.prefix, c.end, c.lease) if isinstance(c, SharedKVCache) else (None, 0, None)
            for c in caches
        ]
        suffixes = [c.suffix if isinstance(c, SharedKVCache) else c for c in caches]
        return cls(kinds.pop(), rows, BatchKVCache.merge(suffixes))

    @property
    def offset(self) -> mx.array:
        return mx.array([end for _, end, _ in self.rows]) + self.suffix.offset

    def _visible(self) -> list[int]:
        return [0 if p is None else end - p.start for p, end, _ in self.rows]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        # lazy: computed only if the hook is bypassed (dense.py)
        sk, sv = padded(self.rows, *self.suffix.update_and_fetch(keys, values))
        self._fetched = sk
        return sk, sv

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        starts = [0 if p is None else p.start for p, _, _ in self.rows]
        ends = [end for _, end, _ in self.rows]
        qpos, kpos = batch_positions(starts, ends, self.suffix, N)
        return position_mask(qpos, kpos, window_size or self.kind.window)[:, None]

    def _attend(self, queries: mx.array, scale: float, mask: Any, sinks: Any) -> mx.array:
        visible = self._visible()
        width = max(visible)
        by_prefix: dict[tuple[int, int], list[int]] = {}
        for i, (p, end, _) in enumerate(self.rows):
            if p is not None and end > p.start:
                by_prefix.setdefault((id(p), end), []).append(i)
        groups = []
        for rows in by_prefix.values():
            p, end, _ = self.rows[rows[0]]
            every = len(rows) == len(self.rows)
            groups.append(
                Group(None if every else rows, *p.attended(end), width - visible[rows[0]])
            )
        suffix = self.suffix.keys_and_values() if self.suffix.keys is not None else None
        return split_attention(
            queries,
            groups,
            suffix,
            prefix_columns=width,
            scale=scale,
            mask=mask,
            sinks=sinks,
            quant=None,
        )

    def prepare(self, **kwargs: Any) -> None:
        self.suffix.prepare(**kwargs)

    def finalize(self) -> None:
        self.suffix.finalize()

    def filter(self, batch_indices: Any) -> None:
        indices = [
            int(i)
            for i in (
                batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
            )
        ]
        self.suffix.filter(batch_indices)
        self.rows = [self.rows[i] for i in indices]

    def extend(self, other: SharedBatchKVCache) -> None:
        self.suffix.extend(other.suffix)
        self.rows = self.rows + other.rows

    def extract(self, idx: int) -> SharedKVCache:
        prefix, end, lease = self.rows[idx]
        suffix = self.suffix.extract(idx) if self.suffix.keys is not None else KVCache()
        return SharedKVCache(self.kind, prefix, end, lease, suffix)

    def trim(self, n: int) -> int:
        return self.suffix.trim(n)

    def size(self) -> int:
        return self.suffix.size()

    @property
    def state(self) -> Any:
        return self.suffix.state if self.suffix.keys is not None else []

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes

    def release(self) -> None:
        """Let go of every row's prefix now (the cache is unusable after)."""
        self.rows = [(None, 0, None)] * len(self.rows)
