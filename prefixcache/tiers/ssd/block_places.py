"""A run file's tensor rows read straight into their places: the run's region, or each block's.

Runs on a reader thread: numpy views and byte counts, no I/O, no MLX. A tensor
of a run file is (batch, head) rows, each holding the file's blocks one after
another. The blocks of a job that one region holds (the restore buffer's, for
all of them) take one piece of each row (``add_rows``). A tensor with no such
region, because its layer uses only some of the job's blocks (a window layer's
K/V in the last run file of a chain: the blocks before the window are
``UNNEEDED``), asks each block's own place (``BlockPlaces``): where every block
has one or is UNNEEDED (from the first placed one on, the blocks left are
asked for one region: a window's blocks lie one after another), each row's
pieces are read into those regions and the rest only hashed, read through the
scratch in the same ``preadv``: no buffer of the tensor's own, no second copy,
no more reads than for the whole tensor. Where a block has no place, the
caller reads the tensor into a loose buffer instead.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...memory.host import UNNEEDED, Place, Placed
from .checked import Steps
from .large import region_rows
from .read_into import Span

Part = tuple[int, int, np.ndarray, list[np.ndarray]]  # first block, blocks, region, its rows


def add_rows(steps: Steps, parts: list[Part], piece: int, j: int, k: int, m: int) -> None:
    """Each (batch, head) row of a tensor of a run file of ``k`` blocks, in file order:
    each part's blocks (of the job's ``m`` from block ``j`` of the file) into its
    rows, every other piece (``piece`` bytes a block) only hashed."""
    if len(parts) == 1 and parts[0][1] == m == k:  # the whole tensor: one view a row
        rows = parts[0][3]
        steps.add(rows, k * piece * len(rows))
        return
    gap = 0  # bytes only hashed since the last piece read
    for r in range(len(parts[0][3])):
        gap += j * piece
        at = 0  # the job's block after the last part's
        for first, count, _, rows in parts:
            gap += (first - at) * piece
            if gap:
                steps.through(gap)
                gap = 0
            steps.add([rows[r]], count * piece)
            at = first + count
        gap += (k - j - at) * piece  # the job's blocks after the last part, the file's
    if gap:
        steps.through(gap)


class BlockPlaces:
    """The tensors of a job (``m`` blocks from ``position`` of a run file of ``count``
    blocks, the first block ``index`` of the chain) read into their blocks' own
    places: name -> per block its Placed, or None where it is UNNEEDED."""

    def __init__(self, place: Place | None, index: int, position: int, count: int, m: int):
        self.place, self.index = place, index
        self.position, self.count, self.m = position, count, m
        self.placed: dict[str, list[Placed | None]] = {}

    def take(self, span: Span, dt: mx.Dtype, block_shape: tuple, steps: Steps) -> bool | None:
        """Add the reads of tensor ``span`` into its blocks' places to ``steps``: whether
        any of it is read (False: every block UNNEEDED, only hashed). None, adding
        nothing, where a block has no usable place (the tensor is then read loose)."""
        name, _, _, start, end = span
        size = (end - start) // self.count  # one block's bytes
        parts = None if self.place is None else self._parts(name, dt, block_shape, size)
        if parts is None:
            return None
        if not parts:
            steps.skip(end - start)
            return False
        heads = block_shape[0] * block_shape[1]
        add_rows(steps, parts, size // heads, self.position, self.count, self.m)
        self.placed[name] = _placed(parts, self.m, dt, block_shape)
        return True

    def _parts(self, name: str, dt: mx.Dtype, shape: tuple, size: int) -> list[Part] | None:
        """The regions the blocks' pieces go into, asking each block's own place in
        turn: from the first one placed, the region of all the blocks left where its
        place gives one (a window layer uses every block after its first), else that
        block's own. None where a block has no place or one not rows of its size."""
        assert self.place is not None
        heads = shape[0] * shape[1]
        parts: list[Part] = []
        for i in range(self.m):
            got = self.place(self.index + i, name, dt, shape)
            if got is UNNEEDED:
                continue
            rest = self.m - i
            if got is not None and rest > 1:
                region = self.place(self.index + i, name, dt, shape, rest)
                if (rows := _rows(region, rest * size, heads)) is not None:
                    parts.append((i, rest, region, rows))
                    break
            if (rows := _rows(got, size, heads)) is None:
                return None
            parts.append((i, 1, got, rows))
        return parts

    def has(self, i: int) -> bool:
        """Whether block ``i`` of the job has a tensor read into its own place (a window
        layer's K/V in the last blocks of a chain's last run file; its blocks before
        the window have none, and are handed over as the run's others are)."""
        return any(got[i] is not None for got in self.placed.values())

    def of(self, name: str, i: int) -> Placed | None:
        """Block ``i``'s tensor ``name`` where it was read into its place, else None."""
        got = self.placed.get(name)
        return None if got is None else got[i]


def _rows(region: np.ndarray | None, nbytes: int, heads: int) -> list[np.ndarray] | None:
    """A region's rows where it holds ``nbytes`` in ``heads`` contiguous rows, else None."""
    if region is None or region.nbytes != nbytes:
        return None
    rows = region_rows(region)
    return rows if rows is not None and len(rows) == heads else None


def _placed(parts: list[Part], m: int, dt: mx.Dtype, shape: tuple) -> list[Placed | None]:
    """Per block of the job, its Placed (its token range of its part's region), or None."""
    out: list[Placed | None] = [None] * m
    n = shape[2]
    for first, count, region, _ in parts:
        for i in range(count):
            tokens = (i * n, (i + 1) * n) if count > 1 else None
            out[first + i] = Placed(region, dt, shape, tokens)
    return out
