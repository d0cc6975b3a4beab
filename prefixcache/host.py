"""HostArray: a block's tensor as bytes in host memory (a view into a read buffer).

The SSD stream (ssd_stream.py) hands a restore its blocks as HostArrays: views
into a reused, already-touched read buffer, verified and valid until the next
block. A builder that takes them (``takes_host``) copies the bytes straight into
its restore buffer; any other gets MLX arrays from ``to_mx`` (one copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, slots=True)
class HostArray:
    """Row-major bytes of an array of ``shape`` and ``dtype``."""

    data: np.ndarray  # uint8, 1-D, contiguous
    dtype: mx.Dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self) -> np.ndarray:
        """The bytes shaped like the array, its last axis in bytes (uint8)."""
        if not self.shape:
            return self.data
        return self.data.reshape(*self.shape[:-1], self.shape[-1] * self.dtype.size)

    def to_mx(self) -> mx.array:
        """An evaluated MLX array owning a copy of the bytes."""
        if self.data.nbytes == 0:
            return mx.zeros(self.shape, self.dtype)
        out = mx.array(self.data).view(self.dtype).reshape(self.shape)
        mx.eval(out)
        return out


def host_view(x: mx.array) -> np.ndarray:
    """A writable uint8 numpy view of an evaluated, row-contiguous MLX array's memory.

    Writes through it change ``x`` in place: only for buffers the caller owns
    alone (a restore buffer before it is handed out).
    """
    view = np.asarray(memoryview(x).cast("B"))
    return view.reshape(*x.shape[:-1], x.shape[-1] * x.dtype.size)
