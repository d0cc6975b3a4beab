"""The hot tier's reader and the host views it restores from.

Hot blocks need no reading: a restore copies their bytes straight out of the
tier's arrays, through host views made once per block (``HostViews``) instead
of a view per array per restore.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...blocks import Block
from ...errors import MissReason
from ...memory.host import host_bytes
from ...memory.runs import RunViews, host_of
from ..base import TierReader


class HostViews:
    """Host bytes of held blocks' 4-axis arrays, made on a block's first restore
    and kept until the tier lets the block go (``forget``). A block of a run gets
    its slice of the run's (``RunViews``: a restore merges consecutive ones), and
    views of its own arrays outside the run."""

    def __init__(self) -> None:
        self._made: dict[bytes, tuple[Block, Mapping[str, np.ndarray]]] = {}

    def of(self, block: Block) -> Mapping[str, np.ndarray]:
        made = self._made.get(block.key)
        if made is None or made[0] is not block:  # new, or the block was replaced
            run = block.run
            if run is not None:
                j = block.index - run.first
                for name in run.arrays if not run.host else ():  # once per run
                    host_of(run, name)
                own = {
                    n: host_bytes(a)
                    for n, a in block.arrays.items()
                    if a.ndim == 4 and n not in run.arrays
                }  # its layers outside the run (a window's K/V)
                views: Mapping[str, np.ndarray] = RunViews(run, j, j + 1, own)
            else:
                views = {n: host_bytes(a) for n, a in block.arrays.items() if a.ndim == 4}
            made = self._made[block.key] = (block, views)
        return made[1]

    def forget(self, key: bytes) -> None:
        self._made.pop(key, None)


class HotReader(TierReader):
    """The blocks of one restore that the hot tier holds (``blocks``: its key ->
    block mapping, read under the cache's lock)."""

    def __init__(self, blocks: Mapping[bytes, Block], views: HostViews, keys: Sequence[bytes]):
        self.blocks, self.views, self.keys = blocks, views, keys

    def load(self, index: int) -> Block | None:
        return self.blocks.get(self.keys[index])

    def miss(self, index: int) -> MissReason:
        return MissReason.EVICTED  # another thread's eviction since the lookup

    def host_views(self, index: int) -> Mapping[str, np.ndarray] | None:
        block = self.blocks.get(self.keys[index])
        return None if block is None else self.views.of(block)
