"""TokenBuffer: one (B, heads, capacity, dim) buffer assembled from token-axis segments.

Segments of blocks already in memory (hot) are joined by ONE concatenate with
the zero headroom: every byte is written once. Blocks streamed from SSD are
slice-assigned into the allocated buffer as they arrive, so only one block is
in flight. Either way the result is a single buffer of final length plus
headroom that the next prefill writes into in place.
"""

from __future__ import annotations

import mlx.core as mx


class TokenBuffer:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.array: mx.array | None = None
        self._pending: list[tuple[int, mx.array]] = []

    def add(self, start: int, x: mx.array) -> None:
        """Queue ``x`` (B, heads, n, dim) for tokens ``[start, start + n)``."""
        self._pending.append((start, x))

    def materialize(self) -> mx.array | None:
        """Write the queued segments; returns the buffer (lazy) or None if empty."""
        if not self._pending:
            return self.array
        if self.array is None:
            self.array = self._allocate()
        else:
            for start, x in self._pending:
                self.array[..., start : start + x.shape[2], :] = x
        self._pending.clear()
        return self.array

    def _allocate(self) -> mx.array:
        parts: list[mx.array] = []
        end = 0
        for start, x in sorted(self._pending, key=lambda p: p[0]):
            if start > end:
                parts.append(_zeros_like(x, start - end))
            parts.append(x)
            end = start + x.shape[2]
        if end < self.capacity:
            parts.append(_zeros_like(parts[-1], self.capacity - end))
        # mx.array copies: a lone hot array must not become the cache's buffer.
        return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.array(parts[0])


def _zeros_like(x: mx.array, tokens: int) -> mx.array:
    # a broadcast: concatenate reads it without a transient buffer of zeros
    return mx.broadcast_to(mx.zeros((1, 1, 1, 1), x.dtype), (*x.shape[:2], tokens, x.shape[3]))
