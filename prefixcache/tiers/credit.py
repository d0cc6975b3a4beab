"""Cost-aware eviction credits for the hot tier (GreedyDual-Size).

A block's credit is set at each use to the floor plus what it saves per byte
(its recompute FLOPs, costs.py, over its bytes); the victim among the
candidates the hot tier offers (its least recently used leaves) is the one of
least credit, and the floor rises to that credit. A deep block of a long
history outlives a shallow one of the same age, as the Marconi paper's FLOP
efficiency + recency asks, and a block nobody uses again ages out: the floor
passes it (tools/bench_eviction.py measures it against LRU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..blocks import Block

CostHook = Callable[[Block], float]  # FLOPs to recompute the block (costs.py)


class Credits:
    """GreedyDual-Size credits of the blocks a hot tier holds."""

    def __init__(self, cost: CostHook):
        self.cost = cost
        self.floor = 0.0
        self._worth: dict[bytes, float] = {}  # recompute FLOPs per byte
        self._credit: dict[bytes, float] = {}

    def added(self, block: Block, *, first_to_go: bool = False) -> None:
        """``block`` entered the tier; ``first_to_go``: at the floor (an LRU's cold end)."""
        worth = self._worth[block.key] = self.cost(block) / max(1, block.nbytes)
        self._credit[block.key] = self.floor + (0.0 if first_to_go else worth)

    def used(self, key: bytes) -> None:
        worth = self._worth.get(key)
        if worth is not None:
            self._credit[key] = self.floor + worth

    def removed(self, key: bytes) -> None:
        self._worth.pop(key, None)
        self._credit.pop(key, None)

    def victim(self, candidates: Sequence[bytes]) -> bytes:
        """The candidate of least credit (the first, least recent, on a tie)."""
        key = min(candidates, key=self._credit.__getitem__)
        self.floor = max(self.floor, self._credit[key])
        return key
