"""Recent sequences: caches handed over at ``store``, kept whole while hot has room.

mlx-lm's batch path copies a fetched cache into its batch at once
(``BatchKVCache.merge``). A restore from blocks first copies them into new
buffers: about 1 ms of a 600-token fetch on bench_serve's model, which
mlx-lm's own cache does not pay (it hands its entry's arrays over). A caller
that hands its cache over (``store(..., hand_over=True)``: mlx-lm's server at
insert) lets the hot tier keep views of the cache's arrays as well; a fetch
with no headroom (``restore_headroom=0``) whose planned blocks are all hot,
and whose restored tokens a kept sequence starts with, gets views of those
arrays instead: no copy, the same bytes as the live run's.

Views, not the caller's array objects: MLX copies a buffer another array
shares before writing into it, so a later write on either side (the caller's
cache, or a fetched one) never shows on the other.

Their bytes count in the hot tier and go first: before any snapshot or
block (``HotTier.evict_to``), when a block they cover leaves hot, and when a
longer sequence starting with theirs is kept. Only for plain KVCache layers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ...hashing import TOKEN_BYTES

MAX_RECENT = 32  # sequences kept: a fetch compares its prompt with each


@dataclass(frozen=True, slots=True)
class Kept:
    """One kept sequence: its root, token bytes, the keys of the blocks it covers,
    per layer views of its keys and values, and the bytes of their buffers."""

    root: bytes
    data: bytes
    keys: frozenset[bytes]
    arrays: tuple[tuple[mx.array, mx.array], ...]
    nbytes: int


def whole_bytes(cache: Sequence[Any]) -> int | None:
    """Bytes of the buffers ``cache``'s views would hold, or None when a layer is
    not a plain KVCache holding tokens."""
    if not all(type(c) is KVCache and c.keys is not None for c in cache):
        return None
    return sum(c.keys.nbytes + c.values.nbytes for c in cache)


def kept_views(cache: Sequence[Any], num_tokens: int) -> tuple[tuple[Any, Any], ...]:
    """Per layer views of the first ``num_tokens`` keys and values (plain KVCaches)."""
    views = tuple((c.keys[..., :num_tokens, :], c.values[..., :num_tokens, :]) for c in cache)
    mx.eval(views)  # views: no copy, and no graph of the caller's kept alive
    return views


def kept_whole(
    root: bytes, data: bytes, keys: Sequence[bytes], cache: Sequence[Any], room: int
) -> Kept | None:
    """``cache``'s arrays kept whole (views), where its layers allow and they fit in
    ``room`` bytes; else None."""
    nbytes = whole_bytes(cache)
    if nbytes is None or nbytes > room:
        return None
    views = kept_views(cache, len(data) // TOKEN_BYTES)
    return Kept(root, data, frozenset(keys), views, nbytes)


class RecentSequences:
    """Kept sequences, most recent last (not thread-safe: the facade's lock)."""

    def __init__(self, max_items: int = MAX_RECENT):
        self.max_items = max_items
        self._items: OrderedDict[int, Kept] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._items)

    def covered(self, root: bytes, data: bytes) -> bool:
        """Whether a kept sequence starts with ``data`` (under ``root``)."""
        return any(s.root == root and s.data.startswith(data) for s in self._items.values())

    def add(self, item: Kept) -> int:
        """Keep ``item``, dropping the ones it starts with; returns the bytes freed."""
        freed = 0
        for n, s in list(self._items.items()):
            if s.root == item.root and item.data.startswith(s.data):
                freed += self._drop(n)
        self._items[self._next] = item
        self._next += 1
        self.nbytes += item.nbytes
        while len(self._items) > self.max_items:
            freed += self.drop_oldest()
        return freed

    def drop_oldest(self) -> int:
        """Drop the least recently used sequence; returns its bytes (0: none held)."""
        return self._drop(next(iter(self._items))) if self._items else 0

    def drop_until(self, excess: int) -> int:
        """Drop sequences, least recently used first, until ``excess`` bytes are freed
        or none is left; returns the bytes freed."""
        freed = 0
        while freed < excess and self._items:
            freed += self.drop_oldest()
        return freed

    def forget(self, key: bytes) -> int:
        """Drop the sequences covering block ``key``; returns the bytes freed."""
        if not self._items:
            return 0
        return sum(self._drop(n) for n, s in list(self._items.items()) if key in s.keys)

    def restore(self, root: bytes, prefix: bytes, fresh: list[Any]) -> list[Any] | None:
        """``fresh`` caches holding views of the most recent kept sequence that starts
        with ``prefix`` (token bytes), or None: none does, or a layer of ``fresh``
        is not a plain KVCache (e.g. quantized from this length on)."""
        if not all(type(c) is KVCache for c in fresh):
            return None
        num_tokens = len(prefix) // TOKEN_BYTES
        for n in reversed(self._items):
            item = self._items[n]
            if item.root == root and item.data.startswith(prefix):
                if len(fresh) != len(item.arrays):
                    return None
                self._items.move_to_end(n)
                self.num_hits += 1
                return _views(item, fresh, num_tokens)
        return None

    def _drop(self, n: int) -> int:
        item = self._items.pop(n)
        self.nbytes -= item.nbytes
        return item.nbytes


def _views(item: Kept, fresh: list[Any], num_tokens: int) -> list[Any]:
    views = []
    for c, (k, v) in zip(fresh, item.arrays, strict=True):
        c.keys, c.values, c.offset = k[..., :num_tokens, :], v[..., :num_tokens, :], num_tokens
        views += [c.keys, c.values]
    mx.eval(views)
    return fresh
