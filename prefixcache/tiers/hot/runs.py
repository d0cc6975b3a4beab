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
        """Bytes ``block`` adds to the tier as it is put: its run's whole buffer for
        the first of it held, nothing for the others; a block of no run its own."""
        run = block.run
        if run is None:
            return block.nbytes
        self._of[block.key] = run
        held = self._held.get(run)
        if held is None:
            self._held[run] = {block.key: None}
            return run.nbytes
        held[block.key] = None
        return 0

    def release(self, block: Block) -> int:
        """Bytes the tier frees as ``block`` leaves it (popped already): its own, or
        its run's once none of the run is held, or the dead bytes of a run compacted."""
        run = self._of.pop(block.key, None)
        if run is None:
            return block.nbytes
        held = self._held[run]
        del held[block.key]
        if not held:
            del self._held[run]
            return run.nbytes
        live = sum(self._blocks[k].nbytes for k in held)
        if 2 * live > run.nbytes:
            return 0
        self._compact(run, list(held))
        return run.nbytes - live

    def _compact(self, run: Run, keys: list[bytes]) -> None:
        """Give the held blocks ``keys`` of ``run`` their own memory (same keys, LRU places)."""
        del self._held[run]
        for k in keys:
            del self._of[k]
        old = [self._blocks[k] for k in keys]
        arrays = [{n: _own(a) for n, a in b.arrays.items()} for b in old]
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
            dead += run.nbytes - sum(self._blocks[k].nbytes for k in held)
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
