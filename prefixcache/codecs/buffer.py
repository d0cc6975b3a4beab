"""TokenBuffer: one (B, heads, capacity, dim) buffer assembled from token-axis segments.

Segments of blocks already in memory (hot) are joined by ONE concatenate with
the zero headroom: every byte is written once. Blocks streamed from SSD arrive
as HostArrays (views into the stream's read buffer) and are copied straight
into the evaluated buffer at once (one memcpy per head, no MLX array per
block), so only one block is in flight. Either way the result is a single
buffer of final length plus headroom that the next prefill writes into in place.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..host import HostArray, host_view
from .base import LayoutMismatchError


class TokenBuffer:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.array: mx.array | None = None
        self._pending: list[tuple[int, mx.array]] = []
        self._host: np.ndarray | None = None  # byte view of ``array`` while it is current

    def add(self, start: int, x: mx.array | HostArray) -> None:
        """Queue ``x`` (B, heads, n, dim) for tokens ``[start, start + n)``.

        A HostArray is copied in at once (it is only valid until the next block).
        """
        if isinstance(x, HostArray):
            self._write(start, x)
        else:
            self._pending.append((start, x))

    def reserve(self, x: mx.array | HostArray | None) -> list[mx.array]:
        """Allocate (lazily) the zero buffer a first streamed ``x`` will be copied into.

        Returns the new buffer to schedule (``mx.async_eval``), so the pages of
        every layer's buffer are faulted in on MLX's thread while earlier layers
        are copied; [] when there is nothing to allocate.
        """
        if not isinstance(x, HostArray) or self.array is not None or self._pending:
            return []
        if len(x.shape) != 4:
            return []  # _write reports it
        self.array = mx.zeros((*x.shape[:2], self.capacity, x.shape[3]), x.dtype)
        return [self.array]

    def materialize(self) -> mx.array | None:
        """Write the queued segments; returns the buffer (lazy) or None if empty."""
        if not self._pending:
            return self.array
        self._host = None
        if self.array is None:
            self.array = self._allocate(self._pending[0][1])
        else:
            for start, x in self._pending:
                self.array[..., start : start + x.shape[2], :] = x
        self._pending.clear()
        return self.array

    def _write(self, start: int, x: HostArray) -> None:
        if len(x.shape) != 4:
            raise LayoutMismatchError(f"block tensor has shape {x.shape}, expected 4 axes")
        self.reserve(x)
        self.materialize()
        if self._host is None:
            mx.eval(self.array)
            self._host = host_view(self.array)
        b, h, cap, d = self.array.shape
        n = x.shape[2]
        if x.dtype != self.array.dtype or (x.shape[0], x.shape[1], x.shape[3]) != (b, h, d):
            raise LayoutMismatchError(
                f"block tensor {x.dtype}{x.shape} does not fit buffer {self.array.dtype}"
                f"{self.array.shape}"
            )
        if not 0 <= start <= cap - n:
            raise LayoutMismatchError(f"tokens {start}..{start + n} outside the buffer ({cap})")
        self._host[:, :, start : start + n, :] = x.rows()  # releases the GIL

    def _allocate(self, like: mx.array) -> mx.array:
        parts: list[mx.array] = []
        end = 0
        for start, x in sorted(self._pending, key=lambda p: p[0]):
            if start > end:
                parts.append(_zeros_like(x, start - end))
            parts.append(x)
            end = start + x.shape[2]
        if end < self.capacity:
            parts.append(_zeros_like(parts[-1] if parts else like, self.capacity - end))
        # mx.array copies: a lone hot array must not become the cache's buffer.
        return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.array(parts[0])


def _zeros_like(x: mx.array, tokens: int) -> mx.array:
    # a broadcast: concatenate reads it without a transient buffer of zeros
    return mx.broadcast_to(mx.zeros((1, 1, 1, 1), x.dtype), (*x.shape[:2], tokens, x.shape[3]))
