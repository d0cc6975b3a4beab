"""Runs: consecutive blocks of one capture kept as one array per payload name.

A hot restore costs its copies, and a copy of many small pieces costs more than
one of the same bytes in a few large ones: a 64-dim bf16 head gives 2 KiB per
head per 16-token block, and 2 KiB pieces copy at about half a flat copy's speed
here, 8 KiB and more at its speed (``tools/bench_pieces.py``). So the blocks one
capture cuts are cut as runs (``pack``): one array per payload name over up to
``max_blocks`` blocks, each block's arrays being views of it (``Run`` in
blocks.py). A restore copies each segment of consecutive blocks of one run in
one copy per name (``coalesce``): pieces of n x 2 KiB per head.

Only payloads that are token-axis slices of 4-axis arrays copied by host bytes
take runs (plain K/V: ``Codec.cuts_runs``); the caller decides which layers. On
a model with window or recurrent layers the run holds its plain K/V layers only:
each block keeps its own arrays for the others (a window's K/V near restore
points, a state snapshot), and a restore merges a segment only for the layers
its run holds (``coalesce``'s ``layers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import mlx.core as mx
import numpy as np

from ..blocks import Block, Run

CutRange = Callable[[int, int], dict[str, mx.array]]  # tokens [start, end) -> payload


def pack(blocks: Sequence[Block], cut: CutRange, block_size: int, max_blocks: int) -> list[Block]:
    """``blocks`` (new full blocks, root-first), those of each stretch of consecutive
    indices cut as runs of up to ``max_blocks`` (``cut`` of the stretch's tokens,
    not evaluated: the payloads of the layers runs take): each block's arrays of
    those names then views of its run's, its other arrays its own. A stretch of
    one block, or a block lacking one of the run's names, keeps its own arrays."""
    out: list[Block] = []
    for stretch in _stretches(blocks, block_size, max_blocks):
        if len(stretch) < 2:
            out += stretch
            continue
        first = stretch[0].index
        arrays = cut(first * block_size, (first + len(stretch)) * block_size)
        names = arrays.keys()
        if (
            not arrays
            or any(not names <= b.arrays.keys() for b in stretch)
            or any(a.ndim != 4 for a in arrays.values())
        ):
            out += stretch
            continue
        run = Run(arrays, first, len(stretch), block_size)
        for j, b in enumerate(stretch):
            views = run.slices(j)  # in the block's own order of names
            own = {n: views.get(n, a) for n, a in b.arrays.items()}
            out.append(Block.make(b.key, b.parent, b.root, b.index, b.tokens, own, b.tenant, run))
    return out


def _stretches(blocks: Sequence[Block], block_size: int, max_blocks: int) -> Iterator[list[Block]]:
    """Runs of consecutive full blocks, each of at most ``max_blocks``."""
    stretch: list[Block] = []
    for b in blocks:
        full = b.num_tokens == block_size
        joins = full and b.index == stretch[-1].index + 1 if stretch else full
        if stretch and (not joins or len(stretch) == max_blocks):
            yield stretch
            stretch = []
        if full:
            stretch.append(b)
        else:
            yield [b]
    if stretch:
        yield stretch


def run_blocks(blocks: Sequence[Block], run_tokens: int, max_bytes: int) -> int:
    """Blocks per run: ``run_tokens`` worth, and runs of at most ``max_bytes``."""
    if not blocks or not run_tokens:
        return 0
    per_block = max(1, blocks[0].nbytes)
    return min(run_tokens // max(1, blocks[0].num_tokens), max_bytes // per_block)


def host_of(run: Run, name: str) -> np.ndarray:
    """Host bytes (B, heads, tokens, dim bytes) of the run's array ``name`` (evaluated),
    made once: a numpy view of its memory, for reading only."""
    view = run.host.get(name)
    if view is None:
        x = run.arrays[name]
        view = np.asarray(memoryview(x).cast("B")).reshape(*x.shape[:-1], -1)
        run.host[name] = view
    return view


Resident = tuple[Mapping[str, Any], Mapping[str, np.ndarray]]
COVERED: Mapping[str, np.ndarray] = {}  # a block whose bytes an earlier entry's views hold


class RunViews(Mapping[str, np.ndarray]):
    """Host bytes of blocks ``[lo, hi)`` of a run (counted from its first), by name:
    one strided view of the run's memory per name, made when looked up; and
    ``own``: host bytes of a block's arrays outside the run (its other layers')."""

    __slots__ = ("hi", "lo", "own", "run")

    def __init__(self, run: Run, lo: int, hi: int, own: Mapping[str, np.ndarray] | None = None):
        self.run, self.lo, self.hi = run, lo, hi
        self.own = own if own is not None else COVERED

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.run.arrays:
            return self.own[name]
        host = host_of(self.run, name)
        if self.lo == 0 and self.hi == self.run.num_blocks:
            return host  # the whole run (a chain restored whole): no slice to make
        bs = self.run.block_size
        return host[:, :, self.lo * bs : self.hi * bs, :]

    def __contains__(self, name: object) -> bool:
        return name in self.run.arrays or name in self.own

    def __iter__(self) -> Iterator[str]:
        yield from self.run.arrays
        yield from self.own

    def __len__(self) -> int:
        return len(self.run.arrays) + len(self.own)


def coalesce(blocks: Sequence[Resident], layers: AbstractSet[int] = frozenset()) -> list[Resident]:
    """Resident blocks (consecutive, in chain order) with each segment of consecutive
    blocks of one run that holds ``layers`` merged: its first entry's views span the
    segment (the run's names only: for the builders of ``layers``), the others' are
    ``COVERED`` (empty); payloads are kept as they are."""
    out: list[Resident] = []
    head = -1  # index in ``out`` of the current segment's first entry
    for payload, views in blocks:
        last = out[head][1] if head >= 0 else None
        if (
            type(views) is RunViews
            and type(last) is RunViews
            and views.run is last.run
            and views.lo == last.hi
        ):
            out[head] = (out[head][0], RunViews(last.run, last.lo, views.hi))
            out.append((payload, COVERED))
            continue
        runs = type(views) is RunViews and layers <= views.run.layers
        head = len(out) if runs else -1
        out.append((payload, views))
    return out
