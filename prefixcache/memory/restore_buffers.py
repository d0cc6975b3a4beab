"""Restore buffers: MLX arrays whose memory MLX allocates but does not write, each
starting on a 64-byte boundary, as a payload's data does (their huge pages:
``huge_pages.py``).

MLX has no ``empty``: ``mx.zeros`` writes every byte, and a restore then
writes them all again with the blocks. ``mx.load`` reads a safetensors
stream from a Python file object through its ``readinto``, handing it the new
array's own memory; a stream whose data ``readinto`` writes nothing leaves the
memory as the allocator gave it: fresh pages stay untouched until the
restore's copy faults them in, and a buffer MLX reuses from its cache keeps
its old bytes. Whoever takes such an array writes every byte that is read.

Should a future MLX read through a scratch buffer instead, the result is still
an array of the right shape (of unspecified bytes), only not faster; should
``mx.load`` refuse the stream, ``mx.zeros`` is used.

A restore needs a buffer per layer and per K/V (32 for a 16-layer model):
inside ``batched``, a restore's buffers come from ONE ``mx.load`` of a stream
holding them all (``Batch``), still each in its own allocation (a cache sharing
one buffer with another layer's would copy it on its first write: MLX writes in
place only into a buffer no other array holds). One load wakes MLX's IO thread
once, where one per buffer woke it 32 times (tools/bench_restore_buffers.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from .host import SAFETENSORS_DTYPES, host_view

logger = logging.getLogger(__name__)

_works = True  # until mx.load refuses the stream once
# bytes: an unwritten buffer starts on this boundary, as a payload's data does
# (tiers/ssd/payload.py): MLX's allocator puts a buffer 24 bytes past one, and the
# kernel's copy from the page cache ran at half speed between bytes at different
# offsets from it (tools/bench_read_align.py)
ALIGN = 64


class _Unwritten:
    """A read-only safetensors stream of tensors ``"0"``, ``"1"``, ... whose data
    bytes are never written."""

    closed = False

    def __init__(self, specs: list[tuple[tuple[int, ...], mx.Dtype]]):
        _count_reader(+1)
        meta, end = {}, 0
        for i, (shape, dtype) in enumerate(specs):
            nbytes = math.prod(shape) * dtype.size
            offsets = [end, end + nbytes]
            meta[str(i)] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": offsets,
            }
            end += nbytes
        header = json.dumps(meta).encode()
        self._head = struct.pack("<Q", len(header)) + header
        self._end = len(self._head) + end
        self._pos = 0

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, self._end)[whence]
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = len(view)
        if self._pos < len(self._head):  # the header is real
            n = min(n, len(self._head) - self._pos)
            view[:n] = self._head[self._pos : self._pos + n]
        self._pos += n
        return n

    def __del__(self) -> None:
        _count_reader(-1)


# MLX reads a Python stream on an IO thread, whose task holds the stream's reader
# and frees it after the load returns; freeing it takes the GIL. Should the
# interpreter be shutting down by then, the thread is ended inside a C++
# destructor and the process aborts ("terminate called without an active
# exception", status 134): about one process in four that exits right after
# making 48 ``empty`` buffers. So the readers alive are counted, and the exit
# waits (the GIL released) until the IO thread has freed them all: no wait when
# none is left, at most EXIT_WAIT_MAX for a stream an unevaluated array still holds
# (tests/test_restore_buffers.py exits 16 such processes at once).
EXIT_WAIT_MAX = 1.0  # seconds
_readers = 0
_readers_lock = threading.Lock()
_exit_wait_registered = False


def _count_reader(step: int) -> None:
    global _readers
    with _readers_lock:
        _readers += step


def pending_readers() -> int:
    """Streams MLX's IO thread (or an unevaluated buffer) has not freed yet."""
    return _readers


def _wait_for_readers() -> None:
    deadline = time.monotonic() + EXIT_WAIT_MAX
    while _readers and time.monotonic() < deadline:
        time.sleep(0.002)


def _wait_at_exit() -> None:
    global _exit_wait_registered
    if not _exit_wait_registered:
        _exit_wait_registered = True
        atexit.register(_wait_for_readers)


def empty(shape: tuple[int, ...], dtype: mx.Dtype, *, stream=None) -> mx.array:
    """A lazy array of ``shape`` and ``dtype`` whose bytes are unspecified."""
    return _load([(shape, dtype)], stream)[0]


def _usable(shape: tuple[int, ...], dtype: mx.Dtype) -> bool:
    return _works and math.prod(shape) > 0 and dtype in SAFETENSORS_DTYPES


def _load(specs: list[tuple[tuple[int, ...], mx.Dtype]], stream) -> list[mx.array]:
    """Arrays of ``specs`` (shape, dtype), unwritten where ``mx.load`` allows, each
    starting on an ``ALIGN`` boundary."""
    global _works
    if all(_usable(*spec) for spec in specs):
        _wait_at_exit()
        try:
            padded = [((math.prod(shape) + ALIGN // dtype.size,), dtype) for shape, dtype in specs]
            loaded = mx.load(_Unwritten(padded), format="safetensors", stream=stream)
            flat = [loaded[str(i)] for i in range(len(specs))]
            mx.eval(flat)  # a stream's load has read them already: nothing to do
            return [_aligned(a, shape) for a, (shape, _) in zip(flat, specs, strict=True)]
        except (ValueError, RuntimeError) as err:
            _works = False
            logger.info("restore buffers are zero-filled: mx.load refused a stream (%s)", err)
    return [mx.zeros(shape, dtype, stream=stream) for shape, dtype in specs]


def _aligned(flat: mx.array, shape: tuple[int, ...]) -> mx.array:
    """``shape`` of evaluated ``flat`` (its size plus ``ALIGN`` bytes) from its first element on
    an ``ALIGN`` boundary: a view, the rest of the allocation unused. MLX writes such
    a view in place as it does a whole buffer (it holds the allocation alone)."""
    at = host_view(flat).__array_interface__["data"][0]  # (``ctypes.data`` costs ~10 us)
    first = -at % ALIGN // flat.dtype.size
    return flat[first : first + math.prod(shape)].reshape(shape)


class Slot:
    """A buffer a ``Batch`` makes: ``array`` once the batch has allocated."""

    __slots__ = ("array", "dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: mx.Dtype):
        self.shape, self.dtype = shape, dtype
        self.array: mx.array | None = None


class Batch:
    """The buffers of one restore, made by one ``mx.load`` when the batch ends.

    A restore's builders ``add`` their buffers to the batch open on their thread
    (``current``) and get a ``Slot`` (not an array); they take its ``array``
    after the ``with`` block, which evaluates only MLX's load: the arrays are in
    ``arrays`` for the caller to evaluate with its others.
    """

    def __init__(self, stream) -> None:
        self.stream = stream
        self.slots: list[Slot] = []
        self.arrays: list[mx.array] = []

    def takes(self, shape: tuple[int, ...], dtype: mx.Dtype, stream) -> bool:
        return stream == self.stream and _usable(shape, dtype)

    def add(self, shape: tuple[int, ...], dtype: mx.Dtype) -> Slot:
        slot = Slot(shape, dtype)
        self.slots.append(slot)
        return slot

    def allocate(self) -> list[mx.array]:
        """Make every slot's array (lazily), in one load; returns them."""
        if self.slots:
            arrays = _load([(s.shape, s.dtype) for s in self.slots], self.stream)
            for slot, array in zip(self.slots, arrays, strict=True):
                slot.array = array
            self.arrays += arrays
            self.slots = []
        return self.arrays


_current = threading.local()  # the batch of this thread's restore, if one is open


@contextlib.contextmanager
def batched(stream=None) -> Iterator[Batch]:
    """Open a ``Batch`` on this thread for the buffers added inside the block; they
    are allocated (lazily) as it ends. Not reentrant."""
    batch = _current.batch = Batch(stream)
    try:
        yield batch
    finally:
        _current.batch = None
    batch.allocate()


def current() -> Batch | None:
    """The batch open on this thread (``batched``), or None."""
    return getattr(_current, "batch", None)


def resolve(x: Any) -> Any:
    """The array of a ``Slot`` (made by its batch by now), else ``x`` itself."""
    if type(x) is Slot:
        if x.array is None:
            raise RuntimeError("a batched restore buffer was used before its batch ended")
        return x.array
    return x


# bytes: below, a buffer is zeros from MLX's cache: an unwritten one's set-up (an
# ``mx.load``) costs more than writing it
SMALL = 1 << 20


def new_buffer(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array | Slot:
    """A restore buffer on the CPU stream (nothing is computed; on Apple silicon the
    memory is shared): unwritten when large (its pages are faulted in once, by the
    copy), zeros when small. In a restore's batch (``batched``): a Slot, made with
    the others."""
    if math.prod(shape) * dtype.size < SMALL:
        return mx.zeros(shape, dtype, stream=mx.cpu)
    batch = current()
    if batch is not None and batch.takes(shape, dtype, mx.cpu):
        return batch.add(shape, dtype)
    return empty(shape, dtype, stream=mx.cpu)
