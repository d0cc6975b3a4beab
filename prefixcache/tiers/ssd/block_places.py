"""A run file's tensor rows read straight into their places: the run's region, or each block's.

Runs on a reader thread: numpy views and byte counts, no I/O, no MLX. A tensor
of a run file is (batch, head) rows, each holding the file's blocks one after
another. The blocks of a job that one region holds (the restore buffer's, for
all of them) take one piece of each row (``add_run_rows``). A tensor with no
such region, because its layer uses only some of the job's blocks (a window
layer's K/V in the last run file of a chain: the blocks before the window are
``UNNEEDED``), asks each block's own place (``BlockPlaces``): where every block
has a usable region or is UNNEEDED, each block's piece of a row is read into
its region's row and the others are only hashed, so the tensor needs no
buffer of its own and no second copy. Where a block has no place, the caller
reads the tensor into a loose buffer instead.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...memory.host import UNNEEDED, Place, Placed
from .checked import Steps
from .large import region_rows
from .read_into import Span


def add_run_rows(steps: Steps, rows: list[np.ndarray], row_bytes: int, j: int, k: int, m: int):
    """Each (batch, head) row of a tensor of the file: its blocks ``j`` to ``j + m``
    into ``rows`` (the region's), the others only hashed."""
    piece = row_bytes // k
    before, after = j * piece, (k - j - m) * piece
    if not before and not after:
        steps.add(rows, row_bytes * len(rows))
        return
    for row in rows:
        if before:
            steps.skip(before)
        steps.add([row], m * piece)
        if after:
            steps.skip(after)


class BlockPlaces:
    """The tensors of a job (``m`` blocks from ``position`` of a run file of ``count``
    blocks, the first block ``index`` of the chain) read into each block's own place:
    name -> per block its Placed, or None where it is UNNEEDED."""

    def __init__(self, place: Place | None, index: int, position: int, count: int, m: int):
        self.place, self.index = place, index
        self.position, self.count, self.m = position, count, m
        self.placed: dict[str, list[Placed | None]] = {}

    def take(self, span: Span, dt: mx.Dtype, block_shape: tuple, steps: Steps) -> bool | None:
        """Add the reads of tensor ``span`` into its blocks' places to ``steps``: whether
        any of it is read (False: every block UNNEEDED, only hashed). None, adding
        nothing, where a block has no usable place (the tensor is then read loose)."""
        name, _, _, start, end = span
        if self.place is None:
            return None
        heads = block_shape[0] * block_shape[1]  # rows of the tensor
        size = (end - start) // self.count  # one block's bytes
        regions: list[tuple[np.ndarray, list[np.ndarray]] | None] = []
        for i in range(self.m):
            region = self.place(self.index + i, name, dt, block_shape)
            if region is UNNEEDED:
                regions.append(None)
                continue
            rows = None if region is None or region.nbytes != size else region_rows(region)
            if rows is None or len(rows) != heads:
                return None
            regions.append((region, rows))
        if all(r is None for r in regions):
            steps.skip(end - start)
            return False
        pieces = [r and r[1] for r in regions]
        _add_pieces(steps, pieces, size // heads, self.position, self.count)
        self.placed[name] = [r and Placed(r[0], dt, block_shape) for r in regions]
        return True

    def of(self, name: str, i: int) -> Placed | None:
        """Block ``i``'s tensor ``name`` where it was read into its place, else None."""
        got = self.placed.get(name)
        return None if got is None else got[i]


def _add_pieces(steps: Steps, blocks: list[list[np.ndarray] | None], piece: int, j: int, k: int):
    """Each (batch, head) row of the file's tensor in file order: block ``j + i``'s
    piece into ``blocks[i]``'s row, the pieces of the blocks outside the job and of
    those without rows (UNNEEDED) only hashed: one skip for each stretch of them,
    across the ends of rows."""
    rows = len(next(r for r in blocks if r is not None))
    after = (k - j - len(blocks)) * piece
    skip = 0
    for r in range(rows):
        skip += j * piece
        views: list[np.ndarray] = []
        for block in blocks:
            if block is None:
                if views:
                    steps.add(views, len(views) * piece)
                    views = []
                skip += piece
                continue
            if skip:
                steps.skip(skip)
                skip = 0
            views.append(block[r])
        if views:
            steps.add(views, len(views) * piece)
        skip += after
    if skip:
        steps.skip(skip)
