"""How far a cache reaches into its traffic's reuse distances, measured online.

A block used again is used again some number of new blocks later (the
blocks seen for the first time in between: the cache's inflow). A cache of
``capacity`` blocks that admits every newcomer keeps a block for about
``capacity`` new blocks after its last use, so the share of first reuses that
come within ``capacity`` new blocks is the share it can catch: its reach.

Measured from metadata only: the keys seen for the first time, each with the
count of new blocks at that moment, in a window bounded to ``horizon x
capacity`` keys (held or not: a key refused or evicted stays known until the
window passes it). A key's next sighting while in the window is a first reuse
at a known distance. The share is over the first reuses seen within the
window, counted with decay, and is known once ``decide_after`` were seen
(None until then). O(1) per sighting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

HORIZON = 8  # window of first sightings, in capacities
DECIDE_AFTER = 1000  # first reuses counted before the share is known (then halved)


class Reach:
    """The share of first reuses within one capacity of new blocks (the window's view).

    Args:
        horizon: the window of first sightings, in capacities (at least 2).
        decide_after: first reuses counted before each new share (at least 1).
    """

    def __init__(self, horizon: int = HORIZON, decide_after: int = DECIDE_AFTER) -> None:
        if not isinstance(horizon, int) or horizon < 2:
            raise ValueError(f"horizon must be an int >= 2, got {horizon!r}")
        if not isinstance(decide_after, int) or decide_after < 1:
            raise ValueError(f"decide_after must be an int >= 1, got {decide_after!r}")
        self.horizon, self.decide_after = horizon, decide_after
        self.num_new = 0  # first sightings so far: the clock distances are counted on
        self.near = 0.0  # first reuses within one capacity (decayed)
        self.far = 0.0  # first reuses within the window (decayed)
        self.share: float | None = None
        self._window: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._window)

    def first_seen(self, key: Hashable, capacity: int) -> None:
        """``key`` was seen for the first time (it opens the window for its reuse)."""
        self.num_new += 1
        self._window[key] = self.num_new
        self._window.move_to_end(key)
        limit = self.horizon * max(1, capacity)
        while len(self._window) > limit:
            self._window.popitem(last=False)

    def seen_again(self, key: Hashable, capacity: int) -> None:
        """``key`` was seen again: its first reuse if still in the window."""
        seen_at = self._window.pop(key, None)
        if seen_at is None:
            return
        self.far += 1
        self.near += self.num_new - seen_at <= capacity
        if self.far >= self.decide_after:
            self.share = self.near / self.far
            self.near, self.far = self.near / 2, self.far / 2
