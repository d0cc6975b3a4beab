"""TokenBuffer: one (B, heads, capacity, dim) buffer assembled from token-axis segments.

Segments of blocks already in memory (hot) are joined by ONE concatenate with
the zero headroom: every byte is written once. Blocks streamed from SSD need the
buffer at once: it is allocated unwritten (``reserve``; uninit.py) and from then
on written only through a host view of its memory, so its address never
changes: the SSD stream reads later blocks straight into it (``destination``;
they arrive as ``Placed``), a HostArray is copied in at once, and a hot segment
after that is copied in the same way; ``finish`` zeroes what no block wrote.
Either way the result is a single buffer of final length plus headroom that the
next prefill writes into in place, and every byte is written once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import LayoutMismatchError
from ..host import HostArray, Placed, host_bytes, host_view
from ..uninit import advise_huge, empty


class TokenBuffer:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.array: mx.array | None = None
        self._pending: list[tuple[int, mx.array]] = []
        self._end = 0  # tokens [0, _end) are covered by what was added
        # Byte view of ``array`` once it is written in place; set once, never reset
        # (reader threads hold destinations into it).
        self._host: np.ndarray | None = None

    def add(self, start: int, x: mx.array | HostArray | Placed) -> None:
        """Queue ``x`` (B, heads, n, dim) for tokens ``[start, start + n)``.

        A HostArray is copied in at once (it is only valid until the next block);
        a Placed tensor is already in place.
        """
        self._end = max(self._end, start + x.shape[2]) if len(x.shape) == 4 else self._end
        if isinstance(x, Placed):
            if self._host is None or self._fit(start, x) is None:
                raise LayoutMismatchError(f"placed tensor {x.dtype}{x.shape} is not in this buffer")
        elif isinstance(x, HostArray) or self._host is not None:
            self._write(start, x)
        else:
            self._pending.append((start, x))

    def reserve(self, x: mx.array | HostArray | Placed | None) -> list[mx.array]:
        """Allocate (lazily) the buffer a first streamed ``x`` goes into, and write
        in place from then on: readers may read later tensors straight into it.

        ``x`` is a HostArray or the dtype and shape of one (a ``Placed``). The
        memory is left unwritten (a restore writes every byte once: the blocks,
        then ``finish`` the rest). Returns the new buffer; [] when there is
        nothing to allocate.
        """
        if not isinstance(x, HostArray | Placed) or self.array is not None or self._pending:
            return []
        if len(x.shape) != 4:
            return []  # _write reports it
        shape = (*x.shape[:2], self.capacity, x.shape[3])
        # on the CPU stream: nothing is computed, and on Apple silicon the memory is shared
        self._open(empty(shape, x.dtype, stream=mx.cpu))
        return [self.array]

    def destination(
        self, start: int, dtype: mx.Dtype, shape: tuple[int, ...]
    ) -> list[memoryview] | None:
        """Where a streamed tensor of ``dtype`` and ``shape`` for tokens from
        ``start`` goes: the contiguous runs of the buffer in row-major order,
        or None when the buffer is not written in place yet or it does not fit.

        Safe from a reader thread: reads only the view, which never changes once set.
        """
        host = self._host
        region = None if host is None else self._fit(start, Placed((), dtype, shape))
        if region is None:
            return None
        # each (batch, head) row is contiguous; never reshape: a copy would swallow the bytes
        batch, heads = region.shape[:2]
        return [memoryview(region[b, h]) for b in range(batch) for h in range(heads)]

    def materialize(self) -> mx.array | None:
        """Write the queued segments; returns the buffer (lazy) or None if empty."""
        if not self._pending:
            return self.array
        if self.array is None:
            self.array = self._allocate(self._pending[0][1])
        else:
            for start, x in self._pending:
                self.array[..., start : start + x.shape[2], :] = x
        self._pending.clear()
        return self.array

    def finish(self) -> mx.array | None:
        """The buffer, with the tokens no block wrote (the headroom) zeroed."""
        array = self.materialize()
        if self._host is not None and self._end < self.capacity:
            self._host[:, :, self._end :, :] = 0
        return array

    def _fit(self, start: int, x: HostArray | Placed) -> np.ndarray | None:
        """The region of the host view for ``x`` at ``start``, or None if it does not fit."""
        host, array = self._host, self.array
        if host is None or array is None or len(x.shape) != 4 or x.dtype != array.dtype:
            return None
        b, h, cap, d = array.shape
        n = x.shape[2]
        if (x.shape[0], x.shape[1], x.shape[3]) != (b, h, d) or not 0 <= start <= cap - n:
            return None
        return host[:, :, start : start + n, :]

    def _write(self, start: int, x: HostArray | mx.array) -> None:
        if len(x.shape) != 4:
            raise LayoutMismatchError(f"block tensor has shape {x.shape}, expected 4 axes")
        if self._host is None and not self.reserve(x):
            self._open(self.materialize())  # hot segments queued before: joined once
        region = self._fit(start, x)
        if region is None:
            raise LayoutMismatchError(
                f"block tensor {x.dtype}{tuple(x.shape)} at token {start} does not fit "
                f"buffer {self.array.dtype}{self.array.shape}"
            )
        region[...] = x.rows() if isinstance(x, HostArray) else host_bytes(x)  # releases the GIL

    def _open(self, array: mx.array) -> None:
        """Make ``array`` the buffer, written in place through its host view from now on."""
        mx.eval(array)
        self.array = array
        self._host = host_view(array)
        advise_huge(self._host)

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
