"""Restore buffers: MLX arrays whose memory MLX allocates but does not write,
on huge pages where Linux gives them.

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
import ctypes
import json
import logging
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np

from .host import SAFETENSORS_DTYPES

logger = logging.getLogger(__name__)

_works = True  # until mx.load refuses the stream once


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
    """Lazy arrays of ``specs`` (shape, dtype), unwritten where ``mx.load`` allows."""
    global _works
    if all(_usable(*spec) for spec in specs):
        _wait_at_exit()
        try:
            loaded = mx.load(_Unwritten(specs), format="safetensors", stream=stream)
            return [loaded[str(i)] for i in range(len(specs))]
        except (ValueError, RuntimeError) as err:
            _works = False
            logger.info("restore buffers are zero-filled: mx.load refused a stream (%s)", err)
    return [mx.zeros(shape, dtype, stream=stream) for shape, dtype in specs]


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
    after the ``with`` block, which evaluates nothing: the arrays are in
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


_HUGE = 2 << 20
_MADV_COLLAPSE = 25  # Linux's value (6.1 on); Python's mmap names it from 3.13 on
_libc = None


def advise_huge(host: np.ndarray) -> None:
    """Put a new, untouched buffer on transparent huge pages, where Linux gives them.

    A restore writes a whole buffer at once, so 2 MiB pages waste little, and
    they make its fresh pages several times cheaper to fault in (one fault per
    2 MiB) and the copies into them faster (tools/bench_ssd_restore.py: warm
    fetch of 1 GiB ~1.35x, with reused buffers ~1.6x). The 2 MiB regions inside
    the buffer are advised (``MADV_HUGEPAGE``). The two at its ends are shared
    with its neighbours (a restore's buffers lie one after the other), and the
    first holds the allocator's chunk header (and MLX's size), written before
    any advice: a region where a small page is mapped never gets a huge page on
    a fault, so a 4.25 MiB buffer had half its memory in small pages (~15,600
    faults per fetch of a 128 MiB chain; tools/bench_blocks.py). Such a region,
    partly in memory (``mincore``), is collapsed into a huge page at once
    (``MADV_COLLAPSE``, Linux 6.1; the bytes already there are kept): about 5x
    cheaper than faulting in 512 small pages (tools/bench_page_faults.py). A
    region all in memory (recycled, or a huge page already) has nothing left
    to fault and is left alone: a collapse waits for every CPU's page lists to
    drain, a wait that grows on a busy machine. A region shared with another
    mapping stays as it is. Hints the kernel may decline (THP "never", no 2 MiB
    page free, an older kernel); ``PREFIXCACHE_HUGE_PAGES=0`` turns them off.
    """
    global _libc
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if host.nbytes < _HUGE or advice is None or os.environ.get("PREFIXCACHE_HUGE_PAGES") == "0":
        return  # (the size first: numpy's ``ctypes.data`` costs ~10 us)
    data = host.ctypes.data
    stop = data + host.nbytes
    start, end = -(-data // _HUGE) * _HUGE, stop // _HUGE * _HUGE  # the regions inside
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    if end > start:  # a failure only loses the hint
        _libc.madvise(start, end - start, advice)
    for edge in {start - _HUGE if data < start else None, end if stop > end else None}:
        if edge is not None and _partly_in_memory(edge):
            _libc.madvise(edge, _HUGE, _MADV_COLLAPSE)


def _partly_in_memory(region: int) -> bool:
    """Whether some pages of the 2 MiB ``region`` are in memory and some are not
    (False where it is not all mapped)."""
    pages = np.empty(_HUGE // mmap.PAGESIZE, np.uint8)  # mincore's answer: a byte a page
    if _libc.mincore(region, _HUGE, pages.ctypes.data) != 0:
        return False
    present = int(np.count_nonzero(pages & 1))
    return 0 < present < len(pages)
