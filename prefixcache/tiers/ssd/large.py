"""Runs of large payload files, each read straight into its places.

Runs on a reader thread: plain file I/O, xxh3, numpy and header checks, no
MLX. A reader takes consecutive large payload files (over ``SMALL_READ``) of
one file size in runs (``plan_runs``). Each file is read straight into its
places (one copy: the kernel's, from the page cache to the restore buffer) and
hashed a slice at a time while the slice is still in the CPU cache. Its bytes
may reach a place before the checksum fails, so the stream stops before such a
block.

A tensor's place is asked once per run (``place(..., count)``), not per block:
its region is one row of the restore buffer per (batch, head), each holding
the run's blocks one after another, so a block's piece of a row is a slice of
a row view made once per run. A block of a model with many layers and kv
heads has hundreds of pieces (512 for 32 layers of 8 heads); each costs a
slice and a hash call, the file a few ``preadv`` calls. A tensor with no run
region (a layer that does not use every block of the run, a buffer not made
yet, a header unlike the run's first) is placed block by block; one with no
place at all goes into the reader's loose buffer, lent to the caller; one no
layer reads (``UNNEEDED``) is not read where the file has per-tensor digests
(``digests.py``: each tensor read is verified against its own), else read
through the scratch only to be hashed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np

from ...errors import PayloadError
from ...memory.host import (
    MX_DTYPES,
    UNNEEDED,
    HostArray,
    Place,
    Placed,
    PlacedRun,
    contiguous,
)
from . import digests as tensor_digests
from .checked import Steps, read_checked
from .files import open_sized
from .payload import read_spans
from .read_into import Buffer, Buffers, Job, Outcome, Span, streamed


class _RunPlaces:
    """A run's regions, asked once per tensor from the first header read: name ->
    (the run's region, its flat rows), or UNNEEDED."""

    def __init__(self, jobs: Sequence[Job], place: Place | None):
        first = jobs[0].meta
        self._index = -1 if first is None else first.index
        self._count = len(jobs)
        self._place = place if self._count > 1 else None
        self._spans: tuple[Span, ...] | None = None
        self.regions: dict[str, tuple[np.ndarray, list[np.ndarray]] | np.ndarray] = {}
        self.whole: dict[str, Placed] = {}  # name -> a Placed of its run region

    def of(self, spans: tuple[Span, ...]) -> dict | None:
        """The run's regions for a file of ``spans`` (None: none, or another layout)."""
        if self._place is None:
            return None
        if self._spans is None:
            self._spans = spans
            self._ask(spans)
        return self.regions if spans is self._spans or spans == self._spans else None

    def _ask(self, spans: tuple[Span, ...]) -> None:
        assert self._place is not None
        for name, dtype, shape, start, end in spans:
            dt = MX_DTYPES[dtype]
            region = self._place(self._index, name, dt, shape, self._count)
            if region is UNNEEDED:
                self.regions[name] = UNNEEDED
                continue
            if region is None or region.nbytes != self._count * (end - start):
                continue
            rows = region_rows(region)
            if rows is not None:
                self.regions[name] = (region, rows)
                self.whole[name] = Placed(region, dt, shape)


def region_rows(region: np.ndarray) -> list[np.ndarray] | None:
    """A run region's (batch, head) rows, flat (None if one is not contiguous: its
    blocks are then placed one by one). numpy views, not memoryviews: a block's
    hundreds of slices of them are then no work for the garbage collector."""
    if region.ndim != 4 or region.size == 0 or not region[0, 0].flags.c_contiguous:
        return None
    b, h = region.shape[:2]
    flat = region.reshape(b * h, -1)  # a view where the rows' strides allow (they do)
    if not np.may_share_memory(flat, region):
        return [region[i, k].reshape(-1) for i in range(b) for k in range(h)]
    return list(flat)


def read_large_run(jobs: Sequence[Job], bufs: Buffers, place: Place | None) -> Iterator[Outcome]:
    """The blocks of a run of large files, in order: each a (lent loose buffer or
    None, block) or (None, the error that makes it a miss).

    Raises:
        Stopped: the stream closed while a block waited for the loose buffer.
    """
    runs = _RunPlaces(jobs, place)
    for j, job in enumerate(jobs):
        try:
            fd, size = open_sized(job.path)
            try:
                outcome = _read_file(fd, size, job, j, runs, bufs, place)
            finally:
                os.close(fd)
        except (PayloadError, OSError) as e:
            outcome = None, e
        yield outcome


def _read_file(
    fd: int, size: int, job: Job, j: int, runs: _RunPlaces, bufs: Buffers, place: Place | None
) -> Outcome:
    """Read, size-check, checksum and parse run file ``j`` (``size`` bytes, as opened):
    each tensor straight into its place, or into the loose buffer (then lent)."""
    meta = job.meta
    assert meta is not None
    if size != meta.file_bytes:
        raise PayloadError(f"payload has {size} bytes, index says {meta.file_bytes}")
    prefix, spans = read_spans(fd, job.key, size)
    base = len(prefix)
    if size - base != meta.nbytes:
        raise PayloadError(f"payload holds {size - base} bytes, index says {meta.nbytes}")
    regions = runs.of(spans)
    dests = [_destination(span, j, regions, place, meta.index) for span in spans]
    loose = sum(end - start for (*_, start, end), d in zip(spans, dests, strict=True) if d is None)
    lent = bufs.loose(loose) if loose else None
    arrays: dict[str, HostArray | Placed] = {}
    steps = Steps()
    used = 0
    for (name, dtype, shape, start, end), dest in zip(spans, dests, strict=True):
        if dest is UNNEEDED:
            steps.skip(end - start)
        elif dest is None:
            assert lent is not None
            data = lent[used : used + end - start]
            used += end - start
            arrays[name] = HostArray(data, MX_DTYPES[dtype], shape)
            steps.add([data] if data.nbytes else [], end - start)
        else:
            views, arrays[name], _ = dest
            steps.add(views, end - start)
    skip = tensor_digests.worth_skipping(spans, [d is UNNEEDED for d in dests])
    digests = tensor_digests.parse(prefix[8:], spans) if skip else None
    try:
        if digests is None:
            read_checked(fd, steps.done(), prefix, meta.checksum, bufs)
        else:
            tensor_digests.read_used(fd, _used_views(spans, dests, lent), base, digests)
    except (PayloadError, OSError):
        if lent is not None:  # a miss lends nothing: the next block's loose read needs it
            bufs.unlend(lent)
        raise
    if regions and not loose and all(type(d) is tuple and d[2] for d in dests if d is not UNNEEDED):
        n = spans[0][2][2]
        return None, streamed(job, PlacedRun(runs.whole, (j * n, (j + 1) * n)))
    return lent, streamed(job, arrays)


Dest = tuple[list[Buffer], Placed, bool] | np.ndarray | None


def _used_views(
    spans: tuple[Span, ...], dests: list[Dest], lent: np.ndarray | None
) -> list[tuple[Span, list[Buffer]]]:
    """Each tensor the restore uses with the views it is read into (the loose
    buffer's in file order), UNNEEDED ones left out."""
    out = []
    used = 0
    for span, dest in zip(spans, dests, strict=True):
        if dest is UNNEEDED:
            continue
        if dest is None:
            assert lent is not None
            size = span[4] - span[3]
            out.append((span, [lent[used : used + size]] if size else []))
            used += size
        else:
            out.append((span, dest[0]))  # type: ignore[index]
    return out


def _destination(span: Span, j: int, regions: dict | None, place: Place | None, index: int) -> Dest:
    """Where tensor ``span`` of run file ``j`` goes: (its views, its Placed, whether
    by the run's region), UNNEEDED, or None (the loose buffer)."""
    name, dtype, shape, start, end = span
    dt = MX_DTYPES[dtype]
    got = regions.get(name) if regions else None
    if got is UNNEEDED:
        return UNNEEDED
    if got is not None:
        region, rows = got
        n = shape[2]
        piece = n * region.shape[3]
        views = [row[j * piece : (j + 1) * piece] for row in rows]
        return views, Placed(region, dt, shape, (j * n, (j + 1) * n)), True
    got = place(index, name, dt, shape) if place is not None else None
    if got is UNNEEDED:
        return UNNEEDED
    if got is None or got.nbytes != end - start:
        return None
    return contiguous(got), Placed(got, dt, shape), False
