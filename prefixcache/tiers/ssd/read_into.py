"""One large payload file read straight into its places, and what the SSD
stream's reader threads share: their jobs, buffers and outcomes.

Runs on a reader thread: plain file I/O, xxh3, numpy and header checks, no
MLX. A large payload file (over ``SMALL_READ``) is read straight into its
places (one copy: the kernel's, from the page cache to the restore buffer) and
hashed a slice at a time while the slice is still in the CPU cache. Its bytes
may reach a place before the checksum fails, so the stream stops before such a
block. A tensor no layer reads (``UNNEEDED``) is read through the reader's
scratch only to be hashed. Small files are read in runs instead.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import xxhash

from ...blocks import BlockMeta
from ...errors import PayloadError
from ...memory.host import (
    MX_DTYPES,
    UNNEEDED,
    HostArray,
    Place,
    Placed,
    StreamedBlock,
    contiguous,
)
from .files import open_payload
from .payload import read_spans

Span = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, start, end
# What a reader hands the caller for a job: (the loose buffer, lent with the
# block, or None; the block) or (None, the error that makes it a miss).
Outcome = tuple[np.ndarray | None, StreamedBlock | PayloadError | OSError]

# Read and hash in slices: each is hashed while still in the CPU cache. (xxhash
# 4.1 releases the GIL while it hashes; older ones may not: slices bound that too.)
_CHUNK = 1 << 20
_IOV_MAX = 512  # iovecs per preadv (the kernel's limit is 1024)


@dataclass(frozen=True, slots=True)
class Job:
    key: bytes
    raw: bytes | None  # index value, for a quarantine that only drops this version
    meta: BlockMeta | None  # None: queued for the writer, absent, or a bad entry
    path: str


class Stopped(Exception):
    """The stream closed while a reader waited for its loose buffer."""


class Buffers:
    """A reader thread's two reused buffers.

    ``scratch`` holds small files read whole and never leaves the reader.
    ``loose`` holds tensors without a place; a block that has such tensors
    lends it to the caller (its HostArrays are views of it): the next ``loose``
    waits until the caller gives it back through ``free``.
    """

    def __init__(self, free: queue.SimpleQueue[np.ndarray | None]):
        self._free = free
        self._scratch = np.empty(0, np.uint8)
        self._loose: np.ndarray | None = np.empty(0, np.uint8)  # None: lent

    def scratch(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]

    def loose(self, nbytes: int) -> np.ndarray:
        """The loose buffer, grown to ``nbytes`` and lent from now on.

        Raises:
            Stopped: the stream closed while it was lent.
        """
        if self._loose is None:
            self._loose = self._free.get()
            if self._loose is None:
                raise Stopped
        if self._loose.nbytes < nbytes:
            self._loose = np.empty(nbytes, np.uint8)
        lent, self._loose = self._loose, None
        return lent


def streamed(job: Job, arrays: Mapping[str, HostArray | Placed]) -> StreamedBlock:
    meta = job.meta
    assert meta is not None
    return StreamedBlock(
        meta.key, meta.parent, meta.root, meta.index, meta.tokens, arrays, meta.nbytes, meta.tenant
    )


def read_large(job: Job, bufs: Buffers, place: Place | None) -> Outcome:
    """Read, size-check, checksum and parse a large payload file: each tensor
    straight into its place, or into the loose buffer (then lent).

    Raises:
        Stopped: the stream closed while it waited for the loose buffer.
    """
    try:
        fd = open_payload(job.path)
        try:
            return _read_placed(fd, job, bufs, place)
        finally:
            os.close(fd)
    except (PayloadError, OSError) as e:
        return None, e


def _read_placed(fd: int, job: Job, bufs: Buffers, place: Place | None) -> Outcome:
    meta = job.meta
    assert meta is not None
    size = os.fstat(fd).st_size
    if size != meta.file_bytes:
        raise PayloadError(f"payload has {size} bytes, index says {meta.file_bytes}")
    prefix, spans = read_spans(fd, job.key, size)
    base = len(prefix)
    if size - base != meta.nbytes:
        raise PayloadError(f"payload holds {size - base} bytes, index says {meta.nbytes}")
    hasher = xxhash.xxh3_64(prefix)
    regions = []
    for name, dtype, shape, start, end in spans:
        region = place(meta.index, name, MX_DTYPES[dtype], shape) if place else None
        fits = region is UNNEEDED or (region is not None and region.nbytes == end - start)
        regions.append(region if fits else None)
    pairs = list(zip(spans, regions, strict=True))
    loose = sum(end - start for (*_, start, end), region in pairs if region is None)
    lent = bufs.loose(loose) if loose else None
    arrays: dict[str, HostArray | Placed] = {}
    used = 0
    for (name, dtype, shape, start, end), region in pairs:
        if region is UNNEEDED:  # hashed through the scratch, kept nowhere
            scratch = bufs.scratch(min(end - start, _CHUNK))
            _hash_only(fd, base + start, end - start, hasher, scratch)
            continue
        if region is None:
            assert lent is not None
            data = region = lent[used : used + end - start]
            used += end - start
            arrays[name] = HostArray(data, MX_DTYPES[dtype], shape)
        else:
            arrays[name] = Placed(region, MX_DTYPES[dtype], shape)
        _read_into(fd, contiguous(region), base + start, hasher)
    if hasher.intdigest() != meta.checksum:
        raise PayloadError("payload checksum mismatch")
    return lent, streamed(job, arrays)


def pread_all(fd: int, view: np.ndarray, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; bytes read."""
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def _read_into(fd: int, views: list[memoryview], offset: int, hasher: xxhash.xxh3_64) -> None:
    """Fill ``views`` in order from ``offset`` of ``fd`` and hash them, in slices of
    about _CHUNK bytes (each hashed while still in the CPU cache)."""
    todo: list[memoryview] = []
    for v in views:  # split big runs so each slice is hashed while cached
        todo += [v[i : i + _CHUNK] for i in range(0, v.nbytes, _CHUNK)]
    todo.reverse()
    while todo:
        batch, size = [], 0
        while todo and size < _CHUNK and len(batch) < _IOV_MAX:
            batch.append(todo.pop())
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


def _hash_only(fd: int, offset: int, nbytes: int, hasher: xxhash.xxh3_64, scratch: np.ndarray):
    """Hash ``nbytes`` of ``fd`` from ``offset``, read a ``scratch`` at a time."""
    while nbytes > 0:
        view = scratch[: min(nbytes, scratch.nbytes)]
        if pread_all(fd, view, offset) != view.nbytes:
            raise PayloadError("short read")
        hasher.update(view)
        offset += view.nbytes
        nbytes -= view.nbytes


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
