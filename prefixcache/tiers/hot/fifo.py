"""FIFO eviction in O(log n): the leaf stored first, from a heap of leaves.

``fifo`` evicts the unpinned leaf that came into the hot tier first; a use does
not renew it, a block put at the cold end (its parent not hot) goes before
every other, and a pinned leaf passed over goes to the back of the line. A
chain's inner blocks are stored before their leaves, so a scan in storing
order walks past every inner block at each eviction: at a million blocks that
is most of the tier. Here each block has a place (a number: rising as blocks
come in, falling for those put at the cold end) and a heap holds the places of
leaves; an entry that went stale (its block removed, given a child, or
moved back) is dropped when it comes to the top. A block whose last child
leaves comes back into the heap at its old place. The victim is the same as
the scan's: the unpinned leaf of the lowest place.
"""

from __future__ import annotations

import heapq

from ..pins import Pins


class FifoOrder:
    """Blocks' storing places and a heap of leaves (not thread-safe: the tier's lock).

    Args:
        children: the tier's parent key -> child keys map (read only).
        pins: the pins in force.
    """

    def __init__(self, children: dict[bytes, dict[bytes, None]], pins: Pins) -> None:
        self.children, self.pins = children, pins
        self._place: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._last = 0  # the latest place given
        self._first = 0  # the earliest place given (the cold end)

    def __len__(self) -> int:
        return len(self._place)

    def added(self, key: bytes, *, first_to_go: bool) -> None:
        """``key`` came in: at the back of the line, or at its front (``first_to_go``)."""
        if first_to_go:
            self._first -= 1
            place = self._first
        elif key in self._place:
            return
        else:
            self._last += 1
            place = self._last
        self._place[key] = place
        heapq.heappush(self._heap, (place, key))

    def removed(self, key: bytes, parent: bytes) -> None:
        """``key`` left (already out of the children map); its parent may be a leaf now."""
        self._place.pop(key, None)
        place = self._place.get(parent)
        if place is not None and not self.children.get(parent):
            heapq.heappush(self._heap, (place, parent))
        if len(self._heap) > 2 * len(self._place) + 1024:
            self._compact()

    def victim(self) -> bytes | None:
        """The unpinned leaf stored first, or None. Pinned leaves met on the way go to
        the back of the line, so the next call does not meet them again."""
        met: dict[bytes, None] = {}
        found = None
        heap, place = self._heap, self._place
        while heap:
            at, key = heap[0]
            if place.get(key) != at or self.children.get(key) or key in met:
                heapq.heappop(heap)  # stale, no longer a leaf, or a duplicate
                continue
            if self.pins.holds(key):
                heapq.heappop(heap)
                met[key] = None
                continue
            found = key
            break
        for key in met:
            self._last += 1
            place[key] = self._last
            heapq.heappush(heap, (self._last, key))
        return found

    def _compact(self) -> None:
        """Rebuild the heap from the leaves held: stale entries cost memory only."""
        self._heap = [(p, k) for k, p in self._place.items() if not self.children.get(k)]
        heapq.heapify(self._heap)
