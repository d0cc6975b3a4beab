"""Cost-aware eviction credits for the hot tier (GreedyDual-Size on a byte clock).

A block's credit is set at each use to a clock, the bytes stored in the tier so
far, plus an extra life for what it saves: 1/16 of the bytes held for each
100% its recompute FLOPs per byte (costs.py) exceed the least seen. The victim
among the candidates the hot tier offers (its least recently used leaves) is
the one of least credit. Without the extra life this is LRU; with it, a deep
block of a long history outlives shallow ones of the same age, as the Marconi
paper's FLOP efficiency + recency asks, and a block nobody uses again ages out
as the clock passes it. The clock moves with every store, whatever evicts:
GreedyDual-Size's floor, raised only by this policy's own victims, stood still
where most evictions are a request's own chain trimmed in flight (trim_hot's
``first``), and depth then outweighed recency (tools/bench_eviction.py and
bench_serve.py measure it against LRU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...blocks import Block

CostHook = Callable[[Block], float]  # FLOPs to recompute the block (costs.py)

EXTRA_LIFE = 1 / 16  # of the bytes held, per 100% of worth above the least


class Credits:
    """Credits of the blocks a hot tier holds; ``held``: the bytes it holds now."""

    def __init__(self, cost: CostHook, held: Callable[[], int]):
        self.cost = cost
        self.held = held
        self.clock = 0  # bytes stored so far
        self.least = 0.0  # least worth seen (0: none yet)
        self._worth: dict[bytes, float] = {}  # recompute FLOPs per byte
        self._credit: dict[bytes, float] = {}

    def added(self, block: Block, *, first_to_go: bool = False) -> None:
        """``block`` entered the tier; ``first_to_go``: below every credit (an LRU's cold end)."""
        worth = self._worth[block.key] = self.cost(block) / max(1, block.nbytes)
        if worth > 0 and (self.least == 0 or worth < self.least):
            self.least = worth
        self.clock += block.nbytes
        self._credit[block.key] = -1.0 if first_to_go else self._now(worth)

    def used(self, key: bytes) -> None:
        worth = self._worth.get(key)
        if worth is not None:
            self._credit[key] = self._now(worth)

    def removed(self, key: bytes) -> None:
        self._worth.pop(key, None)
        self._credit.pop(key, None)

    def victim(self, candidates: Sequence[bytes]) -> bytes:
        """The candidate of least credit (the first, least recent, on a tie)."""
        return min(candidates, key=self._credit.__getitem__)

    def _now(self, worth: float) -> float:
        extra = worth / self.least - 1.0 if self.least > 0 else 0.0
        return self.clock + EXTRA_LIFE * self.held() * extra
