"""A payload file's reads in file order, hashed as they land, and their verification.

Runs on a reader thread: plain file I/O and xxh3. ``Steps`` lists a file's reads
(batches of views, each one ``preadv`` hashed while still in the CPU cache, and
byte counts only hashed); ``read_checked`` reads them and checks the whole
file's checksum, ``read_lead`` only the data up to a tensor's end against its
lead digest (``digests.py``): the tensors after it are neither read nor hashed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import xxhash

from ...errors import PayloadError
from . import digests as tensor_digests
from .read_into import Buffer, Buffers, Span, pread_all, preadv_all

# Read and hash in slices: each is hashed while still in the CPU cache. (xxhash
# 4.1 releases the GIL while it hashes; older ones may not: slices bound that too.)
_CHUNK = 1 << 20
_IOV_MAX = 512  # iovecs per preadv (the kernel's limit is 1024)
_GAPS = _CHUNK // 4  # scratch bytes a batch reads ``through``: fewer fresh pages to touch


class Steps:
    """A file's reads in file order: batches of views (about _CHUNK bytes, at most
    _IOV_MAX views: one ``preadv`` each, hashed while still in the CPU cache), and
    byte counts only to hash (tensors no layer reads). ``bufs``: the reader's
    buffers, whose scratch takes the bytes of ``through``."""

    def __init__(self, bufs: Buffers | None = None) -> None:
        self.steps: list[tuple[list[Buffer], int] | int] = []
        self._batch: list[Buffer] = []
        self._size = 0
        self._bufs = bufs
        self._scratch: np.ndarray | None = None
        self._used = 0  # of the scratch, by the open batch

    def add(self, views: list[Buffer], nbytes: int) -> None:
        """A tensor's views (``nbytes`` in all), in order."""
        if len(views) > 1 and nbytes > _CHUNK:  # pieces apart: each batch hashed while cached
            each = len(views[0])
            per = max(1, _CHUNK // each)
            for i in range(0, len(views), per):
                self.add(views[i : i + per], sum(len(v) for v in views[i : i + per]))
            return
        if views and len(views[0]) > _CHUNK:  # one large piece: in slices
            views = [v[i : i + _CHUNK] for v in views for i in range(0, len(v), _CHUNK)]
        if self._batch and (
            self._size + nbytes > _CHUNK or len(self._batch) + len(views) > _IOV_MAX
        ):
            self._close()
        self._batch += views
        self._size += nbytes
        if len(views) > _IOV_MAX or self._size >= _CHUNK:
            self._close()

    def skip(self, nbytes: int) -> None:
        self._close()
        self.steps.append(nbytes)

    def through(self, nbytes: int) -> None:
        """Bytes only to hash between views (the pieces of a row no block takes): read
        with the batch's views (one ``preadv``, not one more) into the batch's own
        part of the scratch, which a later batch reuses once this one is hashed; as
        ``skip`` where there is no scratch or they are large."""
        if self._bufs is None or nbytes > _GAPS:
            self.skip(nbytes)
            return
        if self._scratch is None:
            self._scratch = self._bufs.scratch(_GAPS)
        if self._batch and (
            self._size + nbytes > _CHUNK
            or self._used + nbytes > _GAPS
            or len(self._batch) >= _IOV_MAX
        ):
            self._close()
        self._batch.append(self._scratch[self._used : self._used + nbytes])
        self._used += nbytes
        self._size += nbytes

    def done(self) -> list[tuple[list[Buffer], int] | int]:
        self._close()
        return self.steps

    def _close(self) -> None:
        if self._batch:
            self.steps.append((self._batch, self._size))
            self._batch, self._size, self._used = [], 0, 0


def read_checked(
    fd: int,
    steps: list[tuple[list[Buffer], int] | int],
    prefix: bytes,
    checksum: int,
    bufs: Buffers,
) -> None:
    """Read the file's data (``_read_steps``) and check the whole file's checksum."""
    hasher = xxhash.xxh3_64(prefix)
    _read_steps(fd, steps, len(prefix), hasher, bufs)
    if hasher.intdigest() != checksum:
        raise PayloadError("payload checksum mismatch")


def read_lead(
    fd: int,
    steps: list[tuple[list[Buffer], int] | int],
    base: int,
    spans: Sequence[Span],
    lead: int,
    bufs: Buffers,
) -> None:
    """Read the file's data from its first tensor to the end of the last of ``spans``
    (``_read_steps``, from ``base``) and check it against that tensor's lead digest:
    the tensors after it are neither read nor hashed.

    Raises:
        PayloadError: a short read or a digest mismatch.
    """
    hasher = xxhash.xxh3_64()
    _read_steps(fd, steps, base, hasher, bufs)
    if not tensor_digests.data_leads(hasher.intdigest(), spans, lead):
        raise PayloadError(f"payload tensors {spans[0][0]!r} to {spans[-1][0]!r} digest mismatch")


def _read_steps(
    fd: int, steps: list[tuple[list[Buffer], int] | int], offset: int, hasher, bufs: Buffers
) -> None:
    """Read each batch of views with one ``preadv`` and hash it (or hash bytes only,
    through the scratch), in file order from ``offset``."""
    for step in steps:
        if type(step) is int:
            _hash_only(fd, offset, step, hasher, bufs.scratch(min(step, _CHUNK)))
            offset += step
            continue
        batch, size = step  # type: ignore[misc]
        preadv_all(fd, batch, offset, size)
        deque(map(hasher.update, batch), maxlen=0)
        offset += size


def _hash_only(fd: int, offset: int, nbytes: int, hasher, scratch: np.ndarray) -> None:
    """Hash ``nbytes`` of ``fd`` from ``offset``, read a ``scratch`` at a time."""
    while nbytes > 0:
        view = scratch[: min(nbytes, scratch.nbytes)]
        if pread_all(fd, view, offset) != view.nbytes:
            raise PayloadError("short read")
        hasher.update(view)
        offset += view.nbytes
        nbytes -= view.nbytes


def verify(
    fd: int,
    steps: list,
    prefix: bytes,
    spans: tuple[Span, ...],
    read: list[bool],
    checksum: int,
    bufs: Buffers,
    apart: dict[int, list[Buffer]] | None = None,
) -> None:
    """Read ``steps`` and verify the file: where the tensors after the last one read
    are only hashed (a window layer's K/V far behind its window, other blocks'
    extras: the writer puts them last), only the data up to that one's end, against
    its lead digest (``digests.py``); else all of it, against the whole checksum.

    ``apart``: tensors (by index) read whole into buffers of their own (a run
    file's extras), with their views. Where every tensor read after the first
    one only hashed is such, and what lies between is worth skipping, the
    tensors before that one are verified by its predecessor's lead digest and
    each later one by its own digest: the stretches between (other blocks'
    window K/V or state snapshots) are neither read nor hashed."""
    if apart and _verify_apart(fd, steps, prefix, spans, read, bufs, apart):
        return
    last = max((i for i, r in enumerate(read) if r), default=len(spans) - 1)
    lead = None
    if last < len(spans) - 1:
        lead = tensor_digests.lead(prefix[8:], spans, spans[last][0])
    if lead is None:
        read_checked(fd, steps, prefix, checksum, bufs)
        return
    tail = len(spans) - 1 - last  # each only hashed: one step of its bytes each
    assert all(type(s) is int for s in steps[-tail:]), "a trailing tensor was read"
    read_lead(fd, steps[:-tail], len(prefix), spans[: last + 1], lead, bufs)


def _verify_apart(
    fd: int,
    steps: list,
    prefix: bytes,
    spans: tuple[Span, ...],
    read: list[bool],
    bufs: Buffers,
    apart: dict[int, list[Buffer]],
) -> bool:
    """``verify`` of the tensors after the first one only hashed by their own digests;
    False (nothing read) where that does not apply."""
    gap = read.index(False) if False in read else len(read)
    later = [i for i in range(gap + 1, len(read)) if read[i]]
    if not gap or not later or any(i not in apart for i in later):
        return False
    if not tensor_digests.worth_skipping(spans[gap:], [not r for r in read[gap:]]):
        return False
    text = prefix[8:]
    lead = tensor_digests.lead(text, spans, spans[gap - 1][0])
    digests = tensor_digests.parse(text, spans, [spans[i] for i in later])
    if lead is None or digests is None:
        return False
    cut, at = 0, 0  # the steps before tensor ``gap``, whose own step only hashes it
    while at < spans[gap][3]:
        step = steps[cut]
        at += step if type(step) is int else step[1]
        cut += 1
    assert at == spans[gap][3] and type(steps[cut]) is int, "a skipped tensor was read"
    read_lead(fd, steps[:cut], len(prefix), spans[:gap], lead, bufs)
    tensor_digests.read_used(fd, [(spans[i], apart[i]) for i in later], len(prefix), digests)
    return True
