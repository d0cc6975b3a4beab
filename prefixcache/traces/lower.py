"""The SSD and remote tiers of a simulation: byte-bounded, leaves-first LRUs of sizes.

Each wraps the library's :class:`HotTier` for its eviction (the SSD tier's
index keeps its blocks the same way: leaves first, least recently used).
The SSD tier is :class:`Metered`: its writes pass the governor, and its
write budget is a leaky bucket on the trace's clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..blocks import Block
from ..tiers.base import Metered, Tier, TierReader
from ..tiers.hot.tier import HotTier

DAY_SECONDS = 86400.0


class LowerTier(Tier):
    """The remote tier of a simulation (and the SSD's base): a leaves-first LRU of sizes."""

    def __init__(self, name: str, max_bytes: int, *, write_budget: int = 0):
        self.name = name  # type: ignore[misc]  # one class for both lower tiers
        self.lru = HotTier(max_bytes)
        self.write_budget = write_budget
        self.bytes_written = 0
        self.now = 0.0
        self._level = 0.0
        self._level_at = 0.0

    def entry(self, key: bytes) -> Block | None:
        return self.lru.get(key)

    def contains(self, key: bytes) -> bool:
        return key in self.lru

    def reader(self, keys: Sequence[bytes]) -> TierReader:
        raise TypeError("a simulated tier holds no payloads to read")

    def put(self, block: Block) -> bool:
        if key_in := block.key in self.lru:
            return key_in
        if not self.lru.put(block):
            return False
        self.bytes_written += block.nbytes
        self._level = self._drained() + block.nbytes
        self._level_at = self.now
        return True

    def touch(self, keys: Sequence[bytes]) -> None:
        self.lru.touch(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        return self.lru.remove(keys)

    def stats(self) -> dict[str, int]:
        return {"nbytes": self.lru.nbytes, "bytes_written": self.bytes_written}


class MeteredTier(LowerTier, Metered):
    """The SSD tier of a simulation: its writes pass the governor; its write budget is
    a leaky bucket that drains at ``write_budget`` bytes per day of trace time."""

    def _drained(self) -> float:
        drain = self.write_budget * max(0.0, self.now - self._level_at) / DAY_SECONDS
        return max(0.0, self._level - drain)

    def write_budget_left(self) -> int | None:
        if not self.write_budget:
            return None
        return int(self.write_budget - self._drained())
