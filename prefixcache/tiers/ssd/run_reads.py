"""Reads of run files: a chain's blocks that share one payload file, as one job.

Runs on a reader thread: plain file I/O, xxh3, numpy, no MLX. The blocks of a
restore that lie in one run file (``runfiles.py``), consecutive in it and in
the chain, are read together: the file is opened once, and each tensor's
(batch, head) rows go straight into the restore buffer's region for those
blocks (``place(first index, name, dtype, block shape, count)``: the blocks one
after another on the token axis, as in the file), one piece per row; the
run's blocks before and after them (a chain that uses part of the run) are
read only to be hashed. The whole file's checksum is verified as it is read
(where the tensors after the last one read are all unused, only the data up
to its end, against its lead digest: those are not read at all),
so its bytes may reach a place before the checksum fails: the stream then
stops before these blocks, all of which are misses (the file quarantines all
its blocks). A tensor without such a region (a window layer that uses only
the run's last blocks) is read into each block's own place where every block
has one or is UNNEEDED (``block_places.py``); else (no buffer yet, a layout
the restore does not place, no place at all) into a fresh buffer, handed to the
caller per block (placed then, or a ``HostArray``); one no layer reads
(``UNNEEDED``) is only hashed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from ...blocks import BlockMeta
from ...errors import PayloadError
from ...memory.host import MX_DTYPES, UNNEEDED, HostArray, Place, Placed, PlacedRun
from . import run_layout
from .block_places import BlockPlaces, add_rows
from .checked import Steps, verify
from .files import PayloadRoot, open_sized
from .large import region_rows
from .payload import read_payload, read_spans
from .read_into import Buffers, Job, Outcome, Span, streamed
from .runfiles import RunRef


class LastRunFile:
    """Single-block loads of run files (a warm start's, a pin's, a prefetch's one at a
    time, in chain order): the last run file read, verified, as MLX arrays, so the
    loads of its other blocks cut theirs from it instead of reading it again. It is
    dropped once its last block is loaded, or replaced by another file's: one run
    file's bytes at most."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: tuple[tuple[bytes, int], dict[str, mx.array]] | None = None

    def block(self, path: str, meta: BlockMeta, run: RunRef) -> tuple[dict[str, mx.array], int]:
        """Block ``meta`` (at ``run`` in the file at ``path``) as fresh arrays; (arrays,
        their nbytes).

        Raises:
            FileNotFoundError, PayloadError: as ``payload.read_payload``.
        """
        which = (run.file_key, meta.checksum)
        with self._lock:
            held = self._held
        if held is None or held[0] != which:
            arrays, nbytes = read_payload(path, run.file_key, meta.file_bytes, meta.checksum)
            n = meta.num_tokens
            if any(
                run_layout.split_extra(name) is None
                and (a.ndim != 4 or a.shape[2] != run.count * n)
                for name, a in arrays.items()
            ):
                raise PayloadError(f"run file of {nbytes} bytes is not {run.count} blocks")
            held = (which, arrays)
        with self._lock:
            self._held = None if run.position == run.count - 1 else held
        lo, hi = run.position * meta.num_tokens, (run.position + 1) * meta.num_tokens
        out = {}
        for name, a in held[1].items():
            extra = run_layout.split_extra(name)
            if extra is None:
                out[name] = mx.contiguous(a[:, :, lo:hi, :])
            elif extra[1] == run.position:
                out[extra[0]] = mx.array(a)
        mx.eval(out)
        return out, sum(a.nbytes for a in out.values())


def same_file(first: Job, job: Job, gap: int) -> bool:
    """Whether ``job`` is ``gap`` blocks after ``first`` in ``first``'s run file
    (and in the chain): then they are read as one job."""
    a, b = first.run, job.run
    return (
        a is not None
        and b is not None
        and first.meta is not None
        and job.meta is not None
        and b.file_key == a.file_key
        and b.position == a.position + gap
        and job.meta.index == first.meta.index + gap
    )


def plan(jobs: Sequence[Job], cut: Callable[[Sequence[Job]], list[range]]) -> list[range]:
    """The jobs cut into runs: the blocks of one run file that follow each other one
    run (read as one job), the stretches between them as ``cut`` (``runs.plan_runs``)
    cuts them."""
    out: list[range] = []
    start = i = 0
    while i <= len(jobs):
        if i < len(jobs) and jobs[i].run is None:
            i += 1
            continue
        out += [range(start + r.start, start + r.stop) for r in cut(jobs[start:i])]
        if i == len(jobs):
            return out
        j = i + 1
        while j < len(jobs) and same_file(jobs[i], jobs[j], j - i):
            j += 1
        out.append(range(i, j))
        start = i = j
    return out


def read_run_file(
    jobs: Sequence[Job], bufs: Buffers, place: Place | None, root: PayloadRoot | None = None
) -> Iterator[Outcome]:
    """The blocks of ``jobs`` (consecutive blocks of one run file), in order: each
    (None, block) or (None, the error that makes every one of them a miss).
    ``root``: the payloads' root held open, the file opened relative to it."""
    try:
        fd, size = root.open(jobs[0].path) if root is not None else open_sized(jobs[0].path)
        try:
            blocks = _read(fd, size, jobs, bufs, place)
        finally:
            os.close(fd)
    except (PayloadError, OSError) as e:
        for _ in jobs:
            yield None, e
        return
    for job, arrays in zip(jobs, blocks, strict=True):
        yield None, streamed(job, arrays)


def _read(fd: int, size: int, jobs: Sequence[Job], bufs: Buffers, place: Place | None) -> list:
    """Read and verify the file (``size`` bytes, as opened); each job's tensors
    (Placed in its region, or a HostArray of its own)."""
    first, run = jobs[0].meta, jobs[0].run
    assert first is not None and run is not None
    if size != first.file_bytes:
        raise PayloadError(f"payload has {size} bytes, index says {first.file_bytes}")
    prefix, spans = read_spans(fd, run.file_key, size)
    n, m = first.num_tokens, len(jobs)
    steps = Steps(bufs)
    whole: dict[str, Placed] = {}
    loose: dict[str, tuple[np.ndarray, Span]] = {}
    extras = _Extras(place, first.index, run.position, m)
    each = BlockPlaces(place, first.index, run.position, run.count, m)
    read: list[bool] = []  # per tensor: read (else only hashed)
    apart: dict[int, list] = {}  # extras read: their views (verified apart where that pays)
    for span in spans:
        name, dtype, shape, start, end = span
        if (taken := extras.take(span, steps)) is not None:
            if taken:
                apart[len(read)] = extras.views
            read.append(taken)
            continue
        if len(shape) != 4 or shape[2] != run.count * n:
            raise PayloadError(f"run file tensor {name!r} has shape {shape}")
        block_shape = (shape[0], shape[1], n, shape[3])
        dt = MX_DTYPES[dtype]
        region = None if place is None else place(first.index, name, dt, block_shape, m)
        rows = None if region is None else region_rows(region)  # None for UNNEEDED too
        if region is UNNEEDED:
            steps.skip(end - start)
            read.append(False)
        elif rows is not None and region.nbytes * run.count == m * (end - start):
            piece = (end - start) // len(rows) // run.count
            add_rows(steps, [(0, m, region, rows)], piece, run.position, run.count, m)
            whole[name] = Placed(region, dt, block_shape)
            read.append(True)
        elif (taken := each.take(span, dt, block_shape, steps)) is not None:
            read.append(taken)
        else:
            data = np.empty(end - start, np.uint8)
            steps.add([data] if data.nbytes else [], data.nbytes)
            loose[name] = (data, span)
            read.append(True)
    verify(fd, steps.done(), prefix, spans, read, first.checksum, bufs, apart)
    at = _Loose(loose, place, first.index, run.position, n)
    return [_block(spans, whole, each, at, extras.of(i), i) for i in range(m)]


class _Loose:
    """The verified tensors read without a run region: each block's part placed
    on its own (``place`` per block), left out where UNNEEDED, else a copy of its
    own handed to the caller."""

    def __init__(self, loose: dict, place: Place | None, index: int, position: int, n: int):
        self.loose, self.place = loose, place
        self.index, self.position, self.n = index, position, n

    def part(self, name: str, i: int) -> HostArray | Placed | None:
        data, (_, dtype, shape, _, _) = self.loose[name]
        b, h, _, d = shape
        n, j = self.n, self.position + i
        rows = data.reshape(b, h, shape[2], -1)[:, :, j * n : (j + 1) * n]
        dt, block_shape = MX_DTYPES[dtype], (b, h, n, d)
        got = None if self.place is None else self.place(self.index + i, name, dt, block_shape)
        if got is UNNEEDED:
            return None
        if got is not None and got.nbytes == rows.nbytes:
            np.copyto(got, rows.reshape(got.shape))
            return Placed(got, dt, block_shape)
        return HostArray(np.ascontiguousarray(rows).reshape(-1), dt, block_shape)


class _Extras:
    """The run file's extras (``run_layout.extra_name``: a tensor kept whole per block)
    of the job's blocks: each read into a buffer of its own, placed (``place`` per
    block, as a block's own file's) once the file is verified; the other blocks'
    and those UNNEEDED only hashed."""

    def __init__(self, place: Place | None, index: int, position: int, m: int) -> None:
        self.place, self.index, self.position, self.m = place, index, position, m
        self.views: list[np.ndarray] = []
        self.got: list[dict[str, tuple[np.ndarray, mx.Dtype, tuple, object]]] = [
            {} for _ in range(m)
        ]

    def take(self, span: Span, steps: Steps) -> bool | None:
        """Whether extra ``span`` is read (False: only hashed); None if it is no extra."""
        name, dtype, shape, start, end = span
        extra = run_layout.split_extra(name)
        if extra is None:
            return None
        base, i = extra[0], extra[1] - self.position
        dt = MX_DTYPES[dtype]
        region = None
        if 0 <= i < self.m and self.place is not None:
            region = self.place(self.index + i, base, dt, tuple(shape))
        if not 0 <= i < self.m or region is UNNEEDED:
            steps.skip(end - start)
            return False
        data = np.empty(end - start, np.uint8)
        self.views = [data] if data.nbytes else []  # the last one taken's
        steps.add(self.views, data.nbytes)
        self.got[i][base] = (data, dt, tuple(shape), region)
        return True

    def of(self, i: int) -> dict[str, HostArray | Placed]:
        """Block ``i``'s extras, verified: in their regions, or HostArrays."""
        out: dict[str, HostArray | Placed] = {}
        for base, (data, dt, shape, region) in self.got[i].items():
            if region is not None and region.nbytes == data.nbytes:
                np.copyto(region, data.reshape(region.shape))
                out[base] = Placed(region, dt, shape)
            else:
                out[base] = HostArray(data, dt, shape)
        return out


def _block(
    spans: tuple[Span, ...],
    whole: dict[str, Placed],
    each: BlockPlaces,
    loose: _Loose,
    extras: dict[str, HostArray | Placed],
    i: int,
) -> PlacedRun | dict[str, HostArray | Placed]:
    """Block ``i`` of the job: its token range of the placed regions, its own placed
    tensors, and its part of each loose tensor, in file order, then its extras."""
    n = loose.n
    tokens = (i * n, (i + 1) * n)
    if not loose.loose and not extras and not each.has(i):
        return PlacedRun(whole, tokens)
    out: dict[str, HostArray | Placed] = {}
    for name, *_ in spans:
        if name in whole:
            p = whole[name]
            out[name] = Placed(p.region, p.dtype, p.shape, tokens)
        elif (own := each.of(name, i)) is not None:
            out[name] = own
        elif name in loose.loose and (part := loose.part(name, i)) is not None:
            out[name] = part
    return out | extras
