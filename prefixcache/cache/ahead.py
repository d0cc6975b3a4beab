"""Restore buffers made before a lower tier streams its blocks.

A reader thread runs ahead of the restore (a run of small payload files is
read and placed at once), so a tensor finds its place only if its layer's
buffer already exists. Before the stream starts, every layer's buffers are
allocated (unwritten, in one evaluation) and opened, each sized from the
header of the first streamed block that layer needs: the K/V layers' from
the chain's first block, a window layer's from the first block of its window,
a recurrent layer's from the block whose state it restores. The headers are
not verified yet: only a tensor of the block's own token count sizes a buffer
of the restore's capacity, and a builder that sizes buffers as the tensors
themselves (``Builder.whole_tensors``) takes any (its file holds the bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import mlx.core as mx

from ..blocks import split_layers
from ..codecs import Builder
from ..hashing import TOKEN_BYTES
from ..memory.host import Placed
from ..memory.restore_buffers import batched
from .lookup import Plan

Specs = Callable[[int], "Mapping[str, Placed] | None"]  # a block's header, if known ahead


def reserve_ahead(
    builders: Sequence[Builder],
    users: Mapping[int, list[int]],
    order: list[int],
    plan: Plan,
    specs: Specs,
) -> None:
    """Allocate (one evaluation) and open every layer's buffers from the header
    (``specs``) of the first streamed block of ``order`` it needs (``users``:
    chain index -> the layers using it); a layer whose header is unknown gets its
    buffers from its first block as it arrives."""
    first = _first_streamed(len(builders), users, order, plan)
    with batched(mx.cpu) as batch:  # every buffer at once, then open for the readers
        lazy = []
        for index, layers in first.items():
            header = specs(index)
            if header is None:
                continue
            tokens = len(plan.entries[index].tokens) // TOKEN_BYTES
            sized = split_layers({n: s for n, s in header.items() if _sizes(s, tokens)})
            whole = split_layers(header)
            for i in layers:
                part = whole if builders[i].whole_tensors else sized
                lazy.append(builders[i].reserve(index, part.get(i, {})))
    mx.eval(lazy, batch.arrays)
    for layers in first.values():  # a builder that reserved nothing opens nothing
        for i in layers:
            builders[i].buffers()


def _sizes(spec: Placed, tokens: int) -> bool:
    """Whether a header's tensor may size a buffer of the restore's capacity: one
    of the block's own token count (the token axis is axis 2)."""
    return len(spec.shape) == 4 and spec.shape[2] == tokens


def _first_streamed(
    num_layers: int, users: Mapping[int, list[int]], order: list[int], plan: Plan
) -> dict[int, list[int]]:
    """The first block of ``order`` not held in memory that each layer needs ->
    those layers."""
    first: dict[int, list[int]] = {}
    todo = set(range(num_layers))
    for index in order:
        if not todo:
            break
        if plan.tiers[index].resident:
            continue
        mine = todo.intersection(users[index])
        if mine:
            first[index] = sorted(mine)
            todo -= mine
    return first
