"""What the SSD stream's reader threads share: their jobs, buffers and outcomes.

Small payload files are read in runs (``runs.py``), large ones straight into
their places (``large.py``); both hand the caller the same outcomes.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...blocks import BlockMeta
from ...errors import PayloadError
from ...memory.host import (
    HostArray,
    Placed,
    StreamedBlock,
)
from .runfiles import RunRef

Span = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, start, end
Buffer = np.ndarray | memoryview  # a writable, contiguous run of bytes
# What a reader hands the caller for a job: (the loose buffer, lent with the
# block, or None; the block) or (None, the error that makes it a miss).
Outcome = tuple[np.ndarray | None, StreamedBlock | PayloadError | OSError]


@dataclass(frozen=True, slots=True)
class Job:
    key: bytes
    raw: bytes | None  # index value, for a quarantine that only drops this version
    meta: BlockMeta | None  # None: queued for the writer, absent, or a bad entry
    path: str
    run: RunRef | None = None  # where it lies in a run file (path: that file's)


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

    def unlend(self, lent: np.ndarray) -> None:
        """Keep ``lent`` after all: its block failed, so the caller never gets it."""
        self._loose = lent


def streamed(job: Job, arrays: Mapping[str, HostArray | Placed]) -> StreamedBlock:
    meta = job.meta
    assert meta is not None
    return StreamedBlock(
        meta.key, meta.parent, meta.root, meta.index, meta.tokens, arrays, meta.nbytes, meta.tenant
    )


def pread_all(fd: int, view: np.ndarray, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; bytes read."""
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def preadv_all(fd: int, batch: list[Buffer], offset: int, size: int) -> None:
    """Fill ``batch`` (``size`` bytes in all) from ``offset`` with ``preadv``."""
    got = os.preadv(fd, batch, offset) if batch else 0
    while got < size:  # a short read: go on from where it stopped
        more = os.preadv(fd, skip_bytes(batch, got), offset + got)
        if more <= 0:
            raise PayloadError("short read")
        got += more


def skip_bytes(views: list[Buffer], n: int) -> list[Buffer]:
    """``views`` without their first ``n`` bytes (after a short read)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out
