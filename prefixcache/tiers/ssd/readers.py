"""Reader threads of the SSD stream: read, size-check and hash payload files.

Plain file I/O, xxh3 and header checks: no MLX call leaves the caller's thread
(see stream.py). Each tensor is read into its place in the restore buffers
when ``place`` gives one, else into the reader's reused read buffer.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import xxhash

from ...blocks import BlockMeta
from ...errors import PayloadError
from ...host import MX_DTYPES, HostArray, Place, Placed, StreamedBlock
from .files import open_payload
from .payload import read_spans
from .prime import SLICE, Primer

# Read and hash in slices: each is hashed while still in the CPU cache, and
# xxhash (which holds the GIL) never stalls the caller for long.
_CHUNK = 1 << 20
_IOV_MAX = 512  # iovecs per preadv (the kernel's limit is 1024)
# Reader threads, one per core up to four: each is mostly in the kernel copying
# (GIL released). On 2 cores, 2 readers streamed from the page cache at ~6.9 GB/s
# and 4 at ~5.2; cold, 2-4 were alike (tools/bench_ssd_restore.py).
_READERS = min(4, max(2, os.cpu_count() or 2))


def num_readers(num_jobs: int) -> int:
    return min(_READERS, num_jobs) or 1


# Seconds between asks for a destination still being allocated.
_PLACE_POLL = 0.0005


@dataclass(frozen=True, slots=True)
class Job:
    key: bytes
    raw: bytes | None  # index value, for a quarantine that only drops this version
    meta: BlockMeta | None  # None: queued for the writer, absent, or a bad entry
    path: str


class Readers:
    """Reader threads that read and verify the jobs' payload files in parallel.

    Job ``i`` goes to reader ``i % n``. A block read wholly into its places
    needs no buffer: the reader goes straight on to its next file, however far
    ahead of the caller. Tensors without a place go into the reader's ONE
    reused read buffer, lent to the caller with the block (its HostArrays are
    views of it): the reader's next such read waits until it is given back.
    """

    def __init__(self, jobs: list[Job], n: int, place: Place | None):
        self.jobs, self.n = jobs, n
        self._free: list[queue.SimpleQueue[np.ndarray | None]] = []
        self._done: list[queue.SimpleQueue[tuple[np.ndarray | None, object]]] = []
        for _ in range(n):
            self._free.append(queue.SimpleQueue())
            self._done.append(queue.SimpleQueue())
        self._stopped = threading.Event()
        self.first_taken = threading.Event()  # the caller has the first block: places exist
        # the first job's read triggers the allocation: it must not wait for it
        self._first_place = place
        later = [(j.path, j.meta.file_bytes) for j in jobs[n:] if j.meta is not None]
        primer = Primer(later, self.first_taken)
        self._place = None if place is None else _patient(place, primer, self._stopped)
        self._threads = [
            threading.Thread(target=self._run, args=(k,), name=f"prefixcache-ssd-read-{k}")
            for k in range(n)
        ]
        for t in self._threads:
            t.daemon = True
            t.start()

    def take(self, i: int) -> tuple[np.ndarray | None, StreamedBlock | BaseException | None]:
        buf, result = self._done[i % self.n].get()
        if isinstance(result, _Crash):
            raise RuntimeError("SSD stream reader failed") from result.error
        return buf, result  # type: ignore[return-value]

    def give_back(self, i: int, buf: np.ndarray | None) -> None:
        if buf is not None:
            self._free[i % self.n].put(buf)

    def stop(self) -> None:
        self._stopped.set()
        self.first_taken.set()  # wakes a reader waiting for the first block
        for free in self._free:
            free.put(None)  # wakes a reader waiting for its buffer
        for t in self._threads:
            t.join()
        # the places reach the restore buffers: hold nothing once stopped
        self._first_place = self._place = None

    def _run(self, k: int) -> None:
        own: np.ndarray | None = np.empty(0, np.uint8)  # None: lent to the caller

        def buffer(nbytes: int) -> np.ndarray:
            """The reader's buffer, grown to ``nbytes``; waits for it while lent."""
            nonlocal own
            if own is None:
                own = self._free[k].get()
                if own is None:
                    raise _Stopped
            if own.nbytes < nbytes:
                own = np.empty(nbytes, np.uint8)
            return own

        try:
            for i in range(k, len(self.jobs), self.n):
                job = self.jobs[i]
                if job.meta is None:
                    self._done[k].put((None, None))
                    continue
                if self._stopped.is_set():
                    return
                try:
                    used, result = _read(job, buffer, self._place if i else self._first_place)
                except _Stopped:
                    return
                except (PayloadError, OSError) as e:
                    used, result = None, e
                if used is not None:
                    own = None  # its HostArrays are views of it until the caller gives it back
                self._done[k].put((used, result))
        except BaseException as e:  # a bug: hand it to the caller instead of hanging it
            self._done[k].put((None, _Crash(e)))


def _patient(place: Place, primer: Primer, stopped: threading.Event) -> Place:
    """``place`` that waits for a destination still being allocated: until the
    caller has the first block, a tensor without a place yet is asked again (the
    first block's copy allocates each layer's buffer in turn, and the readers
    follow right behind instead of waiting for all of them); meanwhile the
    reader primes later files. It refers to no reader object: a reference back
    would be a cycle keeping the restore buffers alive until the garbage
    collector runs."""
    scratch = memoryview(bytearray(SLICE))

    def patient(index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...]):
        while True:
            dest = place(index, name, dtype, shape)
            if dest is not None or primer.done.is_set() or stopped.is_set():
                return dest
            if not primer.step(scratch):
                primer.done.wait(_PLACE_POLL)

    return patient


class _Stopped(Exception):
    """The stream closed while a reader waited for its buffer."""


class _Crash:
    def __init__(self, error: BaseException):
        self.error = error


def _read(
    job: Job, buffer: Callable[[int], np.ndarray], place: Place | None
) -> tuple[np.ndarray | None, StreamedBlock]:
    """Read, size-check, checksum and parse one payload file; each tensor goes to
    its place, or into ``buffer(nbytes)`` (returned: None when all are placed)."""
    meta = job.meta
    assert meta is not None
    with os.fdopen(open_payload(job.path), "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if size != meta.file_bytes:
            raise PayloadError(f"payload has {size} bytes, index says {meta.file_bytes}")
        prefix, spans = read_spans(fd, job.key, size)
        hasher = xxhash.xxh3_64(prefix)
        base = len(prefix)
        dests = []
        for name, dtype, shape, start, end in spans:
            dest = place(meta.index, name, MX_DTYPES[dtype], shape) if place else None
            dests.append(dest if dest is not None and _nbytes(dest) == end - start else None)
        pairs = list(zip(spans, dests, strict=True))
        loose = sum(end - start for (*_, start, end), dest in pairs if dest is None)
        buf = buffer(loose) if loose else None
        arrays: dict[str, HostArray | Placed] = {}
        used = 0
        for (name, dtype, shape, start, end), dest in pairs:
            if dest is None:
                assert buf is not None
                data = buf[used : used + end - start]
                used += end - start
                dest = [memoryview(data)]
                arrays[name] = HostArray(data, MX_DTYPES[dtype], shape)
            else:
                arrays[name] = Placed(tuple(dest), MX_DTYPES[dtype], shape)
            _read_into(fd, dest, base + start, hasher)
    if hasher.intdigest() != meta.checksum:
        raise PayloadError("payload checksum mismatch")
    nbytes = size - base
    if nbytes != meta.nbytes:
        raise PayloadError(f"payload holds {nbytes} bytes, index says {meta.nbytes}")
    block = StreamedBlock(meta.key, meta.parent, meta.root, meta.index, meta.tokens, arrays, nbytes)
    return buf, block


def _nbytes(views: list[memoryview]) -> int:
    return sum(v.nbytes for v in views)


def _read_into(fd: int, views: list[memoryview], offset: int, hasher: xxhash.xxh3_64) -> None:
    """Fill ``views`` in order from ``offset`` of ``fd`` and hash them, in slices of
    about _CHUNK bytes (each hashed while still in the CPU cache)."""
    views = [v.cast("B") for v in views if v.nbytes]
    todo: list[memoryview] = []
    for v in views:  # split big runs so each slice is hashed while cached
        todo += [v[i : i + _CHUNK] for i in range(0, v.nbytes, _CHUNK)]
    while todo:
        batch, size = [], 0
        while todo and size < _CHUNK and len(batch) < _IOV_MAX:
            batch.append(todo.pop(0))
            size += batch[-1].nbytes
        got = 0
        while got < size:
            n = os.preadv(fd, _skip(batch, got), offset + got)
            if n <= 0:
                raise PayloadError("short read")
            got += n
        for v in batch:
            hasher.update(v)
        offset += size


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes (after a short read)."""
    out = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out
