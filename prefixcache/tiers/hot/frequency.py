"""Frequency eviction and admission: GreedyDual over use counts (LFU with aging).

A block's priority is the floor plus how many times its key was used (a
store or a hit, counted even while the block is not held, so a block that
comes back is known). The victim is the leaf of least priority; the floor
rises to each victim's priority, so blocks not used for a while age out
(GreedyDual's inflation) instead of holding the cache forever as in plain
LFU. A newcomer is admitted only if its priority is above the victim's
(TinyLFU's admission, without a window): a block seen once does not push
out one that was reused. Counts are halved every ``HALVE_EVERY x capacity`` uses, so
old popularity fades. O(log n) per use and per eviction (a heap of leaves,
stale entries skipped).
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Hashable, Mapping

HALVE_EVERY = 100  # uses per block of capacity between two halvings of the counts


class FrequencyPolicy:
    """Use counts and a heap of leaves by priority (least first).

    Args:
        capacity: the cache's size in blocks (sets how often counts are halved).
        held: the keys held now (the tier's own map, read only).
        kids: parent key -> child keys held (read only): a key with none is a leaf.
    """

    def __init__(self, capacity: int, held: Mapping[Hashable, object], kids: Mapping) -> None:
        self.held, self.kids = held, kids
        self.floor = 0.0
        self.uses: dict[Hashable, int] = {}
        self._priority: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._serial = 0  # heap tie-break: the least recently used first
        self._used_at: dict[Hashable, int] = {}  # key -> serial of its last use
        self._added = 0
        self._period = HALVE_EVERY * max(1, capacity)

    def count(self, key: Hashable) -> int:
        """Count a use of ``key``; its new count."""
        n = self.uses[key] = self.uses.get(key, 0) + 1
        self._added += 1
        if self._added >= self._period:
            self._added = 0
            self.uses = {k: v >> 1 for k, v in self.uses.items() if v > 1}
            self.uses[key] = max(1, n >> 1)
            return self.uses[key]
        return n

    def newcomer(self, key: Hashable) -> float:
        """The priority ``key`` would enter with (its uses counted, this one too)."""
        return self.floor + self.uses.get(key, 0) + 1

    def set(self, key: Hashable, uses: int) -> None:
        """``key`` (held) was used: its priority is now the floor plus ``uses``."""
        self._priority[key] = self.floor + uses
        self._serial += 1
        self._used_at[key] = self._serial
        self.leaf(key)

    def leaf(self, key: Hashable) -> None:
        """``key`` may be a leaf now: put it on the heap (checked when popped), in its
        place by its last use (with every count 1, the order is LRU's)."""
        heapq.heappush(self._heap, (self._priority[key], self._used_at[key], key))

    def first(self, key: Hashable) -> None:
        """``key`` (held, a leaf) is worth nothing: it goes before every other leaf."""
        self._priority[key] = -1.0  # below any floor
        self.leaf(key)

    def forget(self, key: Hashable) -> None:
        self._priority.pop(key, None)
        self._used_at.pop(key, None)

    def least(self, exclude: Container[Hashable]) -> tuple[float, Hashable] | None:
        """The leaf of least priority not in ``exclude`` (left on the heap), or None."""
        skipped, found = [], None
        heap = self._heap
        while heap:
            item = heap[0]
            prio, used_at, key = item
            if self._used_at.get(key) != used_at or self.kids.get(key) or key not in self.held:
                heapq.heappop(heap)  # stale: used again since, removed, or not a leaf
                continue
            if key in exclude:
                skipped.append(heapq.heappop(heap))
                continue
            found = (prio, key)
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def evicted(self, priority: float) -> None:
        self.floor = max(self.floor, priority)
