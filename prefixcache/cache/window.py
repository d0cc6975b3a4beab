"""Window policy: which blocks keep their sliding-window and chunked layers' K/V.

A sliding-window layer (RotatingKVCache of ``max_size`` W, ``keep`` K) rebuilt
at L tokens needs its first K tokens and its last W - K before L, nothing
else; a chunked layer (ChunkedKVCache of ``chunk_size`` C, Llama 4) its last
C. So a block's window payload is kept only where a restore can use it: inside
the window of a restore point. Restore points are those of recurrent
snapshots: the exact end of every stored sequence or checkpoint and the
interval's points (points.py). A point P keeps the window of every restore
ending in ``[P - block_size, P]`` (a prompt equal to a stored sequence
is restored one token short; one diverging in the last block, cut back inside
it). Every other block carries no window payload for those layers; a restore
there stops at the deepest point every layer covers (``window_not_covered``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from ..codecs import codec_for
from .points import RestorePoints


@dataclass(frozen=True, slots=True)
class WindowPolicy:
    """Where window payloads are kept, for one layout and config.

    Attributes:
        prefixes: payload-name prefixes of the window layers (``"{layer}."``;
            nested in a CacheList ``"{layer}.{part}."``).
        window: the widest window's tokens after its ``keep`` ones (W - K).
        keep: the most tokens a window layer keeps at the front (K).
        block_size: tokens per block.
        points: the restore points (points.py).
    """

    prefixes: tuple[str, ...]
    window: int
    keep: int
    block_size: int
    points: RestorePoints

    def keeps(self, index: int, point: int) -> bool:
        """Whether block ``index`` keeps its window payload: it holds front tokens,
        or lies in the window of the next restore point or of ``point`` (where
        the cache it is cut from ends: a stored sequence's end, a checkpoint)."""
        bs = self.block_size
        if index * bs < self.keep:
            return True
        boundary = self.points.next(index + 1) * bs  # the first point at or after the block
        return self._within(index, boundary) or self._within(index, point)

    def _within(self, index: int, point: int) -> bool:
        """Whether block ``index`` holds a token some restore ending in
        ``[point - block_size, point]`` needs."""
        bs = self.block_size
        first = point - bs - self.window  # the first token the earliest of them needs
        return index * bs < point and (index + 1) * bs > first

    def strip(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """``arrays`` without the window layers' payloads."""
        return {n: a for n, a in arrays.items() if not n.startswith(self.prefixes)}


def windows(caches: Sequence[Any], prefix: str = "") -> list[tuple[str, int, int]]:
    """The window layers of a cache list: (payload-name prefix, tokens a restore needs
    before its end, tokens it keeps at the front), as each layer's codec says."""
    out: list[tuple[str, int, int]] = []
    for i, cache in enumerate(caches):
        if isinstance(cache, CacheList):
            out += windows(cache.caches, f"{prefix}{i}.")
            continue
        found = codec_for(cache).window(cache)
        if found is not None:
            name, size, keep = found
            out.append((f"{prefix}{i}.{name}", size, keep))
    return out


def window_tokens(caches: Sequence[Any]) -> tuple[int, int]:
    """(the widest window after its front tokens, the most front tokens) of a cache list."""
    found = windows(caches)
    return max((w for _, w, _ in found), default=0), max((k for _, _, k in found), default=0)
