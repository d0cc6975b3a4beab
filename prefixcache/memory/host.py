"""A block's tensor as bytes in host memory, on its way from a reader to a restore buffer.

``Place`` is where a reader may write a tensor: its region of the restore
buffer that will hold it (``contiguous`` gives the region's runs), or
``UNNEEDED`` for a tensor no layer of the restore reads (verified with its
file, never copied); ``Placed`` says the bytes are already there. Otherwise a
tensor stays in a reused read buffer as a ``HostArray`` (a verified view, valid
until the next block), which a builder that takes host bytes (``takes_host``)
copies into its buffer and any other turns into an MLX array with ``to_mx`` (one
copy). The safetensors dtype names map to MLX dtypes here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..blocks import Block, BlockHeader

# MLX dtype <-> safetensors dtype name (every dtype a cache uses; no float64)
SAFETENSORS_DTYPES: dict[mx.Dtype, str] = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
}
MX_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
ITEMSIZE = {name: dtype.size for dtype, name in SAFETENSORS_DTYPES.items()}


class Place(Protocol):
    """Where a reader thread may write a streamed tensor: its region of a restore
    buffer, ``UNNEEDED`` (no layer of the restore reads it: the reader leaves it
    out of the block), or None (no place: a HostArray).

    The region is a writable uint8 view shaped like the tensor with its last
    axis in bytes (as ``HostArray.rows``), not necessarily contiguous
    (``contiguous`` gives its contiguous runs). With ``count`` > 1 it holds
    tensor ``name`` of blocks ``index`` to ``index + count - 1``, each of
    ``shape``, one after another on the token axis (axis 2): ``count`` times
    ``shape[2]`` tokens.
    """

    def __call__(
        self, index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None: ...


# The place of a tensor the restore never reads (told apart by identity): a
# window layer's payload in a block before its window, a state snapshot before
# the boundary restored. Skipping it keeps its bytes out of the loose buffer
# and the caller's hands (the reader lends that buffer block by block).
UNNEEDED = np.zeros(0, np.uint8)
UNNEEDED.flags.writeable = False


def contiguous(region: np.ndarray) -> list[memoryview]:
    """The contiguous runs of a ``Place`` region in row-major order ('B' format):
    the region itself when it is contiguous, else one per block of its last two
    axes that is (a token range of one (batch, head) row of a restore buffer),
    else one per row of its last axis."""
    if region.nbytes == 0:
        return []
    if region.flags.c_contiguous:
        return [memoryview(region).cast("B")]
    lead = region.ndim - 1
    if region.ndim >= 2 and region[(0,) * (region.ndim - 2)].flags.c_contiguous:
        lead -= 1
    # indexing, never reshape: a copy would swallow the bytes written into it
    return [memoryview(region[i]).cast("B") for i in np.ndindex(region.shape[:lead])]


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

    def to_mx(self, *, evaluate: bool = True) -> mx.array:
        """An MLX array owning a copy of the bytes (evaluated unless told not to)."""
        if self.data.nbytes == 0:
            return mx.zeros(self.shape, self.dtype)
        out = mx.array(self.data).view(self.dtype).reshape(self.shape)
        if evaluate:
            mx.eval(out)
        return out


class Placed:
    """A tensor the stream already read into the destination its builder gave.

    ``region`` is that destination (a ``Place`` region, valid while the restore
    buffer is); None where only the dtype and shape are meant (a header's
    tensors, before anything is read). A run of blocks placed together gives
    each block its token range of the run's region (``tokens``): the slice is
    made only when asked for, since a restore mostly checks the dtype and shape.
    """

    __slots__ = ("_region", "_tokens", "dtype", "shape")

    def __init__(
        self,
        region: np.ndarray | None,
        dtype: mx.Dtype,
        shape: tuple[int, ...],
        tokens: tuple[int, int] | None = None,
    ):
        self._region, self._tokens, self.dtype, self.shape = region, tokens, dtype, shape

    @property
    def region(self) -> np.ndarray | None:
        if self._tokens is not None and self._region is not None:
            lo, hi = self._tokens
            self._region, self._tokens = self._region[:, :, lo:hi], None
        return self._region

    def __repr__(self) -> str:
        return f"Placed({self.dtype}, {self.shape})"

    @property
    def nbytes(self) -> int:
        region = self.region
        return 0 if region is None else region.nbytes

    def to_mx(self, *, evaluate: bool = True) -> mx.array:
        """An MLX array owning a copy of the bytes (evaluated unless told not to)."""
        if self.region is None or self.region.nbytes == 0:
            return mx.zeros(self.shape, self.dtype)
        flat = np.ascontiguousarray(self.region).reshape(-1)
        out = mx.array(flat).view(self.dtype).reshape(self.shape)
        if evaluate:
            mx.eval(out)
        return out


class PlacedRun(Mapping[str, Placed]):
    """A block's tensors, every one placed by its run's copies (one copy per tensor
    for a run of blocks): ``run`` maps each name to a Placed of the run's region
    and the block's shape, ``tokens`` is the block's range of that region. The
    block's own Placed tensors are made only when looked at: a restore mostly
    needs the names alone."""

    __slots__ = ("_run", "_tokens")

    def __init__(self, run: dict[str, Placed], tokens: tuple[int, int]):
        self._run, self._tokens = run, tokens

    @property
    def run(self) -> dict[str, Placed]:
        """The run's tensors (shared by its blocks: a block of the same run is this object's)."""
        return self._run

    def __getitem__(self, name: str) -> Placed:
        whole = self._run[name]
        return Placed(whole.region, whole.dtype, whole.shape, self._tokens)

    def __iter__(self) -> Iterator[str]:
        return iter(self._run)

    def __len__(self) -> int:
        return len(self._run)


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
    """Byte views of evaluated arrays: zero-copy for row-contiguous ones; a strided
    view (a block of a run: memory/runs.py) is copied row-major first (one evaluation).

    Call on the thread that owns the arrays: ``memoryview`` reads MLX's buffer,
    so the views are safe to hand to the writer.

    Raises:
        ValueError: an array has a dtype safetensors cannot hold.
    """
    strided = {n: mx.contiguous(a) for n, a in arrays.items() if not memoryview(a).c_contiguous}
    if strided:
        mx.eval(list(strided.values()))
        arrays = {**arrays, **strided}
    out = []
    for name, arr in arrays.items():
        dtype = SAFETENSORS_DTYPES.get(arr.dtype)  # one dtype lookup: a put takes every array
        if dtype is None:
            raise ValueError(f"cannot store array {name!r} of dtype {arr.dtype}")
        view = memoryview(arr)
        if not view.c_contiguous:
            raise ValueError(f"array {name!r} is not row-contiguous")
        data = view.cast("B") if view.nbytes else memoryview(b"")
        out.append(Tensor(name, dtype, view.shape, data))
    return out


@dataclass(frozen=True, slots=True)
class StreamedBlock(BlockHeader):
    """A verified block whose arrays are views into the stream's read buffer."""

    arrays: Mapping[str, HostArray | Placed]
    nbytes: int
    tenant: str = ""

    def to_block(self) -> Block:
        """A Block owning MLX copies of the arrays (e.g. to promote into hot)."""
        arrays = {name: a.to_mx(evaluate=False) for name, a in self.arrays.items()}
        mx.eval(list(arrays.values()))  # one evaluation for the block
        b = self
        return Block(b.key, b.parent, b.root, b.index, b.tokens, arrays, b.nbytes, b.tenant)
