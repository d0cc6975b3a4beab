"""Pins held in this process: which blocks eviction must skip, and until when.

:class:`Pins` is the stack's table of pinned keys and their ends, which the
hot tier consults when it picks a victim; a lower tier that keeps pins of its
own (``KeepsPins``) records them in its own store. A pin's end is a Unix time
(``inf``: never, from :func:`pin_until`): a TTL ends the pin, never the block,
which is then an ordinary LRU block again. An expired pin is dropped where it
is met. Pinned bytes count against each tier's cap, checked by whoever pins
(a pin that would exceed one raises :class:`~prefixcache.errors.PinCapacityError`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

FOREVER = math.inf


def pin_until(ttl: float | None, now: float) -> float:
    """The Unix time a pin of ``ttl`` seconds (None: forever) made at ``now`` ends.

    Raises:
        ValueError: ``ttl`` is negative, zero or not a finite number.
    """
    if ttl is None:
        return FOREVER
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf:
        raise ValueError(f"ttl must be a number of seconds > 0 (or None: forever), got {ttl!r}")
    return now + float(ttl)


class Pins:
    """Pinned block keys and when each pin ends; expired pins drop as they are met.

    Args:
        clock: the time source (Unix seconds); default ``time.time``, looked up now.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock if clock is not None else time.time
        self._until: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def add(self, keys: Iterable[bytes], until: float) -> None:
        """Pin ``keys`` until ``until`` (a later pin of the same key replaces its end)."""
        for key in keys:
            self._until[key] = until

    def remove(self, keys: Iterable[bytes]) -> int:
        """Unpin ``keys``; how many were pinned."""
        return sum(self._until.pop(key, None) is not None for key in keys)

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is pinned now (an expired pin is dropped here)."""
        until = self._until.get(key)
        if until is None:
            return False
        if until <= self.clock():
            del self._until[key]
            return False
        return True

    def until(self, key: bytes) -> float | None:
        """When ``key``'s pin ends, or None if it is not pinned now."""
        return self._until[key] if self.holds(key) else None

    def live(self) -> dict[bytes, float]:
        """Every pin in force now: key -> end."""
        now = self.clock()
        expired = [k for k, until in self._until.items() if until <= now]
        for key in expired:
            del self._until[key]
        return dict(self._until)
