"""Restore points: the block boundaries where a first prefill keeps what a restore needs.

A layer that cannot be cut back (a recurrent state, a window that has rolled, a
chunk that has moved on) resumes only where a snapshot or its window K/V was
kept. The points are every ``interval``-th boundary and, when the interval was
picked from the snapshot budget, the boundaries after 1, 2, 4, ... blocks below
it (``early``).

Why the early points: a prompt branches where nothing is stored yet mostly near
its start (another user's turn after the same system prompt), and a budgeted
interval can be longer than that prefix, so the first prefill would keep no
point inside it. There are at most log2(interval) of them, in the first
``interval`` blocks of a sequence: the blocks every prompt with the same
opening shares, so they are paid once per opening, not once per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestorePoints:
    """Which block boundaries are restore points.

    Attributes:
        interval: every ``interval``-th boundary is one (>= 1).
        early: whether the boundaries after a power of two blocks below ``interval``
            are too.
    """

    interval: int
    early: bool = False

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval!r}")

    def at(self, blocks: int) -> bool:
        """Whether the boundary after ``blocks`` blocks is a point."""
        if blocks <= 0:
            return False
        if blocks % self.interval == 0:
            return True
        return self.early and blocks < self.interval and blocks & (blocks - 1) == 0

    def next(self, blocks: int) -> int:
        """The first point at or after ``blocks`` blocks (``blocks`` >= 1)."""
        step = self.interval
        boundary = -(-blocks // step) * step
        if self.early and blocks < step:
            power = 1 << max(0, blocks - 1).bit_length()  # the first power of two >= blocks
            boundary = min(boundary, power)
        return boundary

    def between(self, start: int, end: int, block_size: int) -> list[int]:
        """The points' token positions in ``(start, end)``."""
        first = start // block_size + 1
        last = -(-end // block_size) - 1  # the last boundary strictly before ``end``
        out: list[int] = []
        blocks = self.next(first) if first <= last else last + 1
        while blocks <= last:
            out.append(blocks * block_size)
            blocks = self.next(blocks + 1)
        return out
