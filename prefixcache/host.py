"""A block's tensor as bytes in host memory, as the SSD stream hands it over.

The SSD stream (tiers/ssd/stream.py) reads each tensor straight into the restore
buffer that will hold it when the builder offers a destination (``Placed``:
the bytes are already where they belong), and otherwise into a reused read
buffer (``HostArray``: a view, verified, valid until the next block). A builder
that takes them (``takes_host``) copies a HostArray straight into its restore
buffer; any other gets MLX arrays from ``to_mx`` (one copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .blocks import Block

# MLX dtype <-> safetensors dtype name (every dtype a cache uses; no float64)
SAFETENSORS_DTYPES: dict[mx.Dtype, str] = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
    mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64",
    mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32",
}  # fmt: skip
MX_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
ITEMSIZE = {name: dtype.size for dtype, name in SAFETENSORS_DTYPES.items()}

# (chain index, flat payload name, dtype, shape) -> where a reader thread may write
# that tensor (the destination's contiguous runs in row-major order), or None.
Place = Callable[[int, str, mx.Dtype, tuple[int, ...]], "list[memoryview] | None"]


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


@dataclass(frozen=True, slots=True)
class Placed:
    """A tensor the stream already read into the destination its builder gave.

    ``views`` are the destination's contiguous runs in row-major order (valid
    while the restore buffer is).
    """

    views: tuple[memoryview, ...]
    dtype: mx.Dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def to_mx(self) -> mx.array:
        """An evaluated MLX array owning a copy of the bytes (e.g. to promote into hot)."""
        if self.nbytes == 0:
            return mx.zeros(self.shape, self.dtype)
        flat = np.concatenate([np.frombuffer(v, np.uint8) for v in self.views])
        out = mx.array(flat).view(self.dtype).reshape(self.shape)
        mx.eval(out)
        return out


def host_bytes(x: mx.array) -> np.ndarray:
    """``host_view`` of an evaluated MLX array's bytes, made row-major first if needed
    (a copy); for reading only."""
    if not memoryview(x).c_contiguous:
        x = mx.array(x)  # copy: numpy needs row-major bytes
        mx.eval(x)
    return host_view(x)


def host_view(x: mx.array) -> np.ndarray:
    """A writable uint8 numpy view of an evaluated, row-contiguous MLX array's memory.

    Writes through it change ``x`` in place: only for buffers the caller owns
    alone (a restore buffer before it is handed out).
    """
    view = np.asarray(memoryview(x).cast("B"))
    return view.reshape(*x.shape[:-1], x.shape[-1] * x.dtype.size)


@dataclass(frozen=True, slots=True)
class Tensor:
    """Raw bytes of one array, taken zero-copy on the caller's thread."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    data: memoryview  # flat bytes ('B' format)


def tensors_of(arrays: dict[str, mx.array]) -> list[Tensor]:
    """Zero-copy byte views of evaluated, row-contiguous arrays.

    Call on the thread that owns the arrays: ``memoryview`` reads MLX's buffer
    but runs no MLX computation, so the views are safe to hand to the writer.

    Raises:
        ValueError: an array has a dtype safetensors cannot hold or is not contiguous.
    """
    out = []
    for name, arr in arrays.items():
        if arr.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"cannot store array {name!r} of dtype {arr.dtype}")
        view = memoryview(arr)
        if not view.c_contiguous:
            raise ValueError(f"array {name!r} is not row-contiguous")
        data = view.cast("B") if arr.size else memoryview(b"")
        out.append(Tensor(name, SAFETENSORS_DTYPES[arr.dtype], tuple(arr.shape), data))
    return out


@dataclass(frozen=True, slots=True)
class StreamedBlock:
    """A verified block whose arrays are views into the stream's read buffer."""

    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes
    arrays: dict[str, HostArray | Placed]
    nbytes: int

    def to_block(self) -> Block:
        """A Block owning MLX copies of the arrays (e.g. to promote into hot)."""
        arrays = {name: a.to_mx() for name, a in self.arrays.items()}
        return Block(self.key, self.parent, self.root, self.index, self.tokens, arrays, self.nbytes)
