"""Streamed SSD reads for a restore: reader threads fill reused host buffers.

``stream(tier, keys)`` yields the blocks of a chain in order. Blocks on disk are
read by two reader threads (plain file I/O, xxh3 and header checks: no MLX call
leaves the caller's thread), each into its own reused read buffer, so block
i + 1 is read and verified while the caller copies block i into its restore
buffers. Each file is read and hashed in 1 MiB slices (hashed while still in
the CPU cache). The kernel is asked to read the next files ahead meanwhile
(POSIX_FADV_WILLNEED), so the disk queue never runs dry.

A yielded :class:`StreamedBlock` holds HostArrays: zero-copy views into the read
buffer, already verified, valid until the next block is requested. A block
still queued for the writer is served from the queue (a fresh :class:`Block`),
as ``SsdTier.load`` does. A block that is missing or fails its checks is
quarantined (on the caller's thread), counted, and yielded as None: a miss.
Peak memory: the two read buffers (two payload files).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from .blocks import Block, BlockMeta
from .host import HostArray
from .payload import _MX_DTYPES, PayloadError, _header_length, _parse_header, payload_path
from .ssd_index import decode_or_none

if TYPE_CHECKING:
    from .ssd import SsdTier

logger = logging.getLogger(__name__)

# Read and hash in slices: each is hashed while still in the CPU cache, and
# xxhash (which holds the GIL) never stalls the caller for long.
_CHUNK = 1 << 20
_ADVISE_AHEAD = 4  # payload files handed to the kernel's readahead beyond the one being read
# Reader threads, each with one read buffer: two reads in flight read a cold file
# set faster than one (tools/bench_ssd_restore.py); memory: two payload files.
_READERS = 2


@dataclass(frozen=True, slots=True)
class StreamedBlock:
    """A verified block whose arrays are views into the stream's read buffer."""

    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes
    arrays: dict[str, HostArray]
    nbytes: int

    def to_block(self) -> Block:
        """A Block owning MLX copies of the arrays (e.g. to promote into hot)."""
        arrays = {name: a.to_mx() for name, a in self.arrays.items()}
        return Block(self.key, self.parent, self.root, self.index, self.tokens, arrays, self.nbytes)


@dataclass(frozen=True, slots=True)
class _Job:
    key: bytes
    raw: bytes | None  # index value, for a quarantine that only drops this version
    meta: BlockMeta | None  # None: queued for the writer, absent, or a bad entry
    path: str


def stream(tier: SsdTier, keys: Sequence[bytes]) -> Iterator[Block | StreamedBlock | None]:
    """Yield the blocks of ``keys`` in order (see the module docstring).

    Closing the generator early (a restore falling short) stops the reader.
    """
    jobs = [_job(tier, key) for key in keys]
    readers = _Readers(jobs, min(_READERS, len(jobs)) or 1)
    try:
        for i, job in enumerate(jobs):
            buf, result = readers.take(i)
            try:
                yield _result(tier, job, result)
            finally:
                readers.give_back(i, buf)
    finally:
        readers.stop()


def _job(tier: SsdTier, key: bytes) -> _Job:
    path = payload_path(os.path.join(tier.path, "blocks"), key)
    if tier.writer.pending(key) is not None:
        return _Job(key, None, None, path)
    raw = tier.index.get(key)
    return _Job(key, raw, decode_or_none(key, raw), path)


def _result(
    tier: SsdTier, job: _Job, result: StreamedBlock | BaseException | None
) -> Block | StreamedBlock | None:
    """What the caller gets for ``job`` (runs on the caller's thread)."""
    if result is None:  # nothing read: queued, absent, or a bad entry
        return tier.load(job.key)  # the queue first; quarantines a bad entry
    if isinstance(result, PayloadError | FileNotFoundError):
        tier._quarantine(job.key, job.raw, str(result) or type(result).__name__)
        return None
    if isinstance(result, OSError):  # unreadable now (EMFILE, EIO...): a miss, not a verdict
        logger.warning("SSD tier: cannot read block %s: %s", job.key.hex(), result)
        return None
    if isinstance(result, BaseException):
        raise result
    tier._note_load(job.key, result.nbytes)
    return result


class _Readers:
    """Reader threads that read and verify the jobs' payload files in parallel.

    Job ``i`` goes to reader ``i % n``, each with ONE reused buffer: a reader
    starts its next file once the caller gave back the buffer of its last one,
    so at most ``n`` files are in memory and up to ``n`` reads are in flight.
    """

    def __init__(self, jobs: list[_Job], n: int):
        self.jobs, self.n = jobs, n
        self._free: list[queue.SimpleQueue[np.ndarray | None]] = []
        self._done: list[queue.SimpleQueue[tuple[np.ndarray | None, object]]] = []
        for _ in range(n):
            self._free.append(queue.SimpleQueue())
            self._done.append(queue.SimpleQueue())
            self._free[-1].put(np.empty(0, np.uint8))
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._advised = 0
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
        for free in self._free:
            free.put(None)  # wakes a reader waiting for its buffer
        for t in self._threads:
            t.join()

    def _run(self, k: int) -> None:
        try:
            for i in range(k, len(self.jobs), self.n):
                job = self.jobs[i]
                if job.meta is None:
                    self._done[k].put((None, None))
                    continue
                self._advise(i + 1, i + 1 + _ADVISE_AHEAD)
                buf = self._free[k].get()
                if buf is None or self._stopped.is_set():
                    return
                try:
                    buf, result = _read(job, buf)
                except (PayloadError, OSError) as e:
                    result = e
                self._done[k].put((buf, result))
        except BaseException as e:  # a bug: hand it to the caller instead of hanging it
            self._done[k].put((None, _Crash(e)))

    def _advise(self, start: int, end: int) -> None:
        """Hand the files of jobs ``[start, end)`` to the kernel's readahead (no waiting)."""
        if not hasattr(os, "posix_fadvise"):
            return
        with self._lock:
            todo = self.jobs[max(self._advised, start) : end]
            self._advised = max(self._advised, end)
        for job in todo:
            if job.meta is None:
                continue
            try:
                fd = os.open(job.path, os.O_RDONLY)
            except OSError:
                continue  # the read will tell
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


class _Crash:
    def __init__(self, error: BaseException):
        self.error = error


def _read(job: _Job, buf: np.ndarray) -> tuple[np.ndarray, StreamedBlock]:
    """Read, size-check, checksum and parse one payload file into ``buf`` (grown if small)."""
    meta = job.meta
    assert meta is not None
    with open(job.path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != meta.file_bytes:
            raise PayloadError(f"payload has {size} bytes, index says {meta.file_bytes}")
        if buf.nbytes < size:
            buf = np.empty(size, np.uint8)
        view = memoryview(buf)[:size]
        hasher = xxhash.xxh3_64()
        got = 0
        while got < size:  # hash each chunk while it is still in the CPU cache
            n = f.readinto(view[got : got + _CHUNK])
            if not n:
                raise PayloadError("short read")
            hasher.update(view[got : got + n])
            got += n
    data = buf[:size]
    if hasher.intdigest() != meta.checksum:
        raise PayloadError("payload checksum mismatch")
    length = _header_length(bytes(data[:8]), size)
    spans = _parse_header(bytes(data[8 : 8 + length]), job.key, size - 8 - length)
    base = 8 + length
    arrays = {
        name: HostArray(data[base + start : base + end], _MX_DTYPES[dtype], shape)
        for name, dtype, shape, start, end in spans
    }
    nbytes = size - base
    if nbytes != meta.nbytes:
        raise PayloadError(f"payload holds {nbytes} bytes, index says {meta.nbytes}")
    block = StreamedBlock(meta.key, meta.parent, meta.root, meta.index, meta.tokens, arrays, nbytes)
    return buf, block
