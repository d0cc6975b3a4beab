"""Several sequences' attention layer over shared prefixes: one batch, as mlx-lm batches.

mlx-lm's BatchGenerator merges the caches of the sequences it decodes together
with the first cache's ``merge`` and calls ``prepare``, ``finalize``,
``filter``, ``extend`` and ``extract`` on the result, as on its own
BatchKVCache. :class:`SharedBatchKVCache` keeps per row (sequence) its shared
prefix (or none) and holds the suffixes in one BatchKVCache (left-padded), so
merging copies the suffixes only. Rows on one prefix form a group that
attends to it with one matmul per KV head (``split_attention``). A
sliding-window layer drops the suffix columns no row's next query can see, a
step at a time.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .dense import batch_positions, padded, position_mask
from .hook import SharedAttention
from .prefix import LayerKind, LayerPrefix, Lease
from .split import Group, split_attention

Row = tuple[LayerPrefix | None, int, Lease | None]  # (prefix, suffix start position, lease)
_NONE: Row = (None, 0, None)


class SharedBatchKVCache(SharedAttention):
    """Several sequences' attention layer: per row a shared prefix (or none) and a
    row of one BatchKVCache suffix (left-padded, as mlx-lm's batches are)."""

    def __init__(self, kind: LayerKind, rows: list[Row], suffix: BatchKVCache, single: type):
        super().__init__()
        self.kind, self.rows, self.suffix = kind, rows, suffix
        self.single = single  # the class of the caches merged (``extract`` gives one)

    @classmethod
    def merge(cls, caches: list[Any], *, single: type) -> SharedBatchKVCache:
        """One batch of ``single`` caches (plain KVCaches join as rows without a prefix)."""
        shared = [c for c in caches if isinstance(c, single)]
        kinds = {c.kind for c in shared}
        if len(kinds) != 1 or len(shared) + sum(type(c) is KVCache for c in caches) < len(caches):
            raise ValueError(
                f"cannot batch layers of kinds {kinds} with {[type(c) for c in caches]}"
            )
        rows = [(c.prefix, c.end, c.lease) if isinstance(c, single) else _NONE for c in caches]
        suffixes = [c.suffix if isinstance(c, single) else c for c in caches]
        return cls(kinds.pop(), rows, BatchKVCache.merge(suffixes), single)

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
        # a row without a prefix sees none: its suffix starts at ``end``
        starts = [end if p is None else p.start for p, end, _ in self.rows]
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
        out = split_attention(
            queries,
            groups,
            suffix,
            prefix_columns=width,
            scale=scale,
            mask=mask,
            sinks=sinks,
            quant=None,
        )
        if self.kind.window is not None:
            self._forget(self.kind.window)
        return out

    def _forget(self, window: int) -> None:
        """Drop the suffix columns no row's next query can see, a step at a time.

        Rows advance together, so the next queries of every row see the last
        ``window - 1`` columns and the new one: the columns before are dead for
        all rows. A row that loses real tokens (not padding) loses its prefix
        too (positions before them are out of the window)."""
        suffix = self.suffix
        dead = suffix._idx - (window - 1)
        # not while a right-padded prompt chunk is in (finalize moves the padding)
        if suffix.keys is None or dead < suffix.step or suffix._right_padding is not None:
            return
        left = suffix.left_padding.tolist()
        lost = [max(0, dead - pad) for pad in left]  # real tokens each row drops
        suffix.keys = mx.contiguous(suffix.keys[..., dead : suffix._idx, :])
        suffix.values = mx.contiguous(suffix.values[..., dead : suffix._idx, :])
        suffix._idx -= dead
        suffix.left_padding = mx.array([max(0, pad - dead) for pad in left])
        suffix.offset = suffix.offset - mx.array(lost)
        self.rows = [
            (None if n else p, end + n, lease)
            for (p, end, lease), n in zip(self.rows, lost, strict=True)
        ]

    def prepare(self, **kwargs: Any) -> None:
        self.suffix.prepare(**kwargs)

    def finalize(self) -> None:
        self.suffix.finalize()

    def filter(self, batch_indices: Any) -> None:
        kept = batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
        self.suffix.filter(batch_indices)
        self.rows = [self.rows[i] for i in kept]

    def extend(self, other: SharedBatchKVCache) -> None:
        self.suffix.extend(other.suffix)
        self.rows = self.rows + other.rows

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as a single cache (its prefix still shared, its suffix copied)."""
        prefix, end, lease = self.rows[idx]
        suffix = self.suffix.extract(idx) if self.suffix.keys is not None else KVCache()
        return self.single(self.kind, prefix, end, lease, suffix)

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
        self.rows = [_NONE] * len(self.rows)
