"""Where a restore's reader threads write each streamed tensor: the ``Place`` of
its builders.

A reader thread (the SSD tier's, the remote tier's) asks ``place`` for the
region of a tensor of one block, or of a run of consecutive blocks; it gets a
region of the builder's restore buffer once that buffer exists, else None (the
tensor then comes as a HostArray); ``UNNEEDED`` when its layer uses none of
those blocks (a window layer's payload before its window: the reader skips it).
No MLX runs here: only dictionary lookups and the builders' numpy views.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..memory.host import UNNEEDED, Place
from .base import Builder


def placer(builders: list[Builder], users: dict[int, list[int]]) -> Place:
    """(chain index, flat payload name, dtype, shape, count) -> where a reader thread
    may write that tensor (of ``count`` blocks), or None. Only for layers that use
    each of the blocks, and only once their builder's buffer exists
    (``destination``); ``UNNEEDED`` for a layer that uses none of them. Runs no MLX."""
    needs: dict[int, set[int]] | None = None  # layer -> the blocks it uses, when first asked
    layers: dict[str, tuple[int, str]] = {}  # payload name -> (layer, its name there)

    def place(
        index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None:
        route = layers.get(name)
        if route is None:
            head, _, rest = name.partition(".")
            route = layers[name] = (int(head), rest) if head.isdigit() else (-1, rest)
        layer, rest = route
        nonlocal needs
        table = needs
        if table is None:  # on a reader thread, not in the restore's start
            table = needs = _blocks_of_layers(users)
        mine = table.get(layer, _NONE)
        if not mine.issuperset(range(index, index + count)):
            unused = layer >= 0 and mine.isdisjoint(range(index, index + count))
            return UNNEEDED if unused else None
        return builders[layer].destination(index, rest, dtype, shape, count)

    return place


_NONE: frozenset[int] = frozenset()


def _blocks_of_layers(users: dict[int, list[int]]) -> dict[int, set[int]]:
    """layer -> the chain indices it uses, in one pass over ``users`` grouped by the
    layers using them (every K/V layer uses the same blocks: one set update per
    group and layer, not one insert per block and layer)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, using in users.items():
        groups.setdefault(tuple(using), []).append(index)
    out: dict[int, set[int]] = {}
    for using, indices in groups.items():
        for layer in using:
            out.setdefault(layer, set()).update(indices)
    return out
