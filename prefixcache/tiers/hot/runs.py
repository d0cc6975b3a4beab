"""The hot tier's runs charged by buffer: a run's memory until its last block goes.

A run's blocks (blocks.py ``Run``) are views of its arrays, so evicting one of
them frees nothing while another is held. The tier is charged what it holds:
a run's whole ``nbytes`` from the put of its first block held, until the last
one leaves (members never put, or gone, count as the run's dead bytes). Eviction
goes on while the tier is over its budget, so it frees a run by taking its
blocks from the chain's end (leaves first: a run is consecutive blocks). A run
held by a few blocks only (a branch point, a pinned block, a prefix another
chain continues: live bytes at most half the run) is compacted: its surviving
blocks get their own copies (one evaluation) in their LRU places, and the run's
memory goes. So dead bytes stay under half of each run held.

A block may own arrays outside its run (a model's window or recurrent layers):
those are charged as a block of no run's are, on top of the run's buffer.
Policies, tenants and pins see each block's own bytes, as without runs; the
tier's ``nbytes`` (and so its budget and ``room``) counts the dead bytes too.
Not thread-safe by itself: the tier's caller holds the lock.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import mlx.core as mx

from ...blocks import Block, Run
from .reader import HostViews


class HotRuns:
    """Runs with a block in the hot tier and which of their blocks it holds."""

    def __init__(self, blocks: MutableMapping[bytes, Block], views: HostViews):
        self._blocks, self._views = blocks, views  # the tier's key -> block, and host views
        self._held: dict[Run, dict[bytes, None]] = {}
        self._of: dict[bytes, Run] = {}  # a held block's key -> its run (by key: a block
        # put in its place, as a test's swap, leaves with the run's bytes all the same)
        self.num_compacted = 0

    def charge(self, block: Block) -> int:
        """Bytes ``block`` adds to the tier as it is put: its arrays outside its run,
        and its run's whole buffer for the first of it held; a block of no run its own."""
        run = block.run
        if run is None:
            return block.nbytes
        own = block.nbytes - run.block_nbytes
        self._of[block.key] = run
        held = self._held.get(run)
        if held is None:
            self._held[run] = {block.key: None}
            return own + run.nbytes
        held[block.key] = None
        return own

    def release(self, block: Block) -> int:
        """Bytes the tier frees as ``block`` leaves it (popped already): its arrays
        outside its run (all of them for a block of no run), and its run's buffer once
        none of the run is held, or the dead bytes of a run compacted."""
        run = self._of.pop(block.key, None)
        if run is None:
            return block.nbytes
        own = block.nbytes - run.block_nbytes  # its window K/V or state snapshot, if any
        held = self._held[run]
        del held[block.key]
        if not held:
            del self._held[run]
            return own + run.nbytes
        live = len(held) * run.block_nbytes
        if 2 * live > run.nbytes:
            return own
        self._compact(run, list(held))
        return own + run.nbytes - live

    def _compact(self, run: Run, keys: list[bytes]) -> None:
        """Give the held blocks ``keys`` of ``run`` their own memory (same keys, LRU places)."""
        del self._held[run]
        for k in keys:
            del self._of[k]
        old = [self._blocks[k] for k in keys]
        names = run.arrays
        arrays = [{n: _own(a) if n in names else a for n, a in b.arrays.items()} for b in old]
        mx.eval(arrays)
        for b, own in zip(old, arrays, strict=True):
            self._blocks[b.key] = Block(
                b.key, b.parent, b.root, b.index, b.tokens, own, b.nbytes, b.tenant
            )
            self._views.forget(b.key)
        self.num_compacted += 1

    def dead_bytes(self) -> int:
        """Bytes of the runs held that their blocks held no longer (part of ``nbytes``)."""
        dead = 0
        for run, held in self._held.items():
            dead += run.nbytes - len(held) * run.block_nbytes
        return dead

    def stats(self) -> dict[str, int]:
        """``num_runs`` held, ``run_bytes`` (their buffers), ``run_dead_bytes``,
        ``num_runs_compacted``."""
        return {
            "num_runs": len(self._held),
            "run_bytes": sum(run.nbytes for run in self._held),
            "run_dead_bytes": self.dead_bytes(),
            "num_runs_compacted": self.num_compacted,
        }


def _own(x: mx.array) -> mx.array:
    """A copy of an evaluated view in memory of its own (``mx.contiguous`` returns a
    row-contiguous view itself: a block of a one-head run is one)."""
    return mx.array(x) if memoryview(x).c_contiguous else mx.contiguous(x)
