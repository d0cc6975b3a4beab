"""Runs of small payload files: read whole, verified, then placed together.

A reader thread takes the chain's small payload files (up to ``SMALL_READ``
bytes) in runs of consecutive blocks of one file size, up to ``RUN_BYTES`` in
all. Each file (opened by ``files.PayloadRoot``, its size checked against the
index, its header parsed once per run: ``headers.py``) is read whole in one read
into its slot of the reader's scratch buffer (reused: it stays in the CPU's
caches), and verified there in one hash call: nothing
reaches the restore buffers before its block's checksum matched. The run's
files are opened first and asked into the page cache together, so that read
cold their reads are in flight at once.

Then each tensor of the run goes into its place with ONE numpy copy for the
whole run (``place(..., count)``: the restore buffer's region of that tensor
for all the run's blocks, one after another on the token axis): a few calls
per tensor name and run, not per block and row. A tensor that has no run
region (a layer that does not use every block of the run, a buffer not
allocated yet) is placed block by block; one without a place at all goes into
the reader's loose buffer, lent to the caller with the block. A tensor no layer
of the restore reads (``UNNEEDED``) is left out of its block: never copied, and
never read where the file has per-tensor digests (``loads.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ...errors import PayloadError
from ...memory.host import MX_DTYPES, UNNEEDED, HostArray, Place, Placed, PlacedRun
from .files import PayloadRoot, open_sized
from .headers import Headers
from .loads import Judged, LoadedFile, load, unneeded
from .read_into import Buffers, Job, Outcome, Span, streamed

_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
# Payloads of up to this many bytes are read whole, in runs; larger ones straight
# into their places (``read_large``). Read whole is faster warm and cold up to 3 MiB
# payloads; at 4 MiB it is still faster warm but slower cold
# (tools/bench_blocks.py --tiers ssd --modes warm cold).
SMALL_READ = 3 << 20
# Payload bytes a run may hold: consecutive files read, verified and placed together.
# Fewer, longer copies (one per tensor and run, not per block) and fewer calls per
# run pay for a scratch buffer beyond the CPU's L2: a warm fetch at block 16 is
# about 1.5x faster with 8 MiB runs than with 2 MiB, and no faster with 16 MiB;
# cold, 4 and 8 MiB are alike (tools/bench_blocks.py --tiers ssd).
# A reader's scratch holds one run.
RUN_BYTES = 8 << 20
# Payload bytes a run of large files may hold (each read straight into place, so
# no scratch holds them): a place asked per tensor and run, not per block, and a
# region's rows cut once per run. Longer runs share the chain among the readers
# more coarsely (tools/bench_blocks.py --tiers ssd).
LARGE_RUN_BYTES = 32 << 20


def plan_runs(jobs: Sequence[Job]) -> list[range]:
    """The jobs cut into runs: payloads of one file size that follow each other in
    the chain, RUN_BYTES at most for small ones, LARGE_RUN_BYTES for large ones;
    every other job (queued, absent, or the first: it must not wait for the
    buffers it allocates) a run of its own. A run is placed as one region from
    its first block on, so a block another tier holds (e.g. hot, between two SSD
    blocks) ends it."""
    out: list[range] = []
    start = 0
    for i in range(1, len(jobs)):
        first, meta = jobs[start].meta, jobs[i].meta
        if (
            start == 0
            or first is None
            or meta is None
            or meta.file_bytes != first.file_bytes
            or meta.index != first.index + (i - start)
            or (i - start + 1) * first.nbytes > (RUN_BYTES if small(jobs[i]) else LARGE_RUN_BYTES)
        ):
            out.append(range(start, i))
            start = i
    if jobs:
        out.append(range(start, len(jobs)))
    return out


def small(job: Job) -> bool:
    return job.meta is not None and job.meta.nbytes <= SMALL_READ


def read_run(
    jobs: Sequence[Job],
    bufs: Buffers,
    place: Place | None,
    *,
    willneed: bool = True,
    judge: Place | None = None,
    root: PayloadRoot | None = None,
) -> Iterator[Outcome]:
    """The blocks of a run of small files (``plan_runs``), in order: each a
    (lent loose buffer or None, block) or the error that makes it a miss.
    ``willneed``: ask the run's files into the page cache at once (pointless
    when they are there already, and a system call each). ``judge``: a place that
    never waits, asked only whether a tensor is UNNEEDED (then, where the file has
    digests, left unread); None: every file read whole. ``root``: the payloads'
    root held open, the files opened relative to it (None: each by its path).

    Raises:
        Stopped: the stream closed while a block waited for the loose buffer.
    """
    first = jobs[0].meta
    assert first is not None
    size = first.file_bytes
    scratch = bufs.scratch(len(jobs) * size + 1)
    judged = None if judge is None else Judged(judge, first.index, len(jobs))
    files = _load_all(jobs, scratch, willneed, judged, root)
    good = [f for f in files if isinstance(f, LoadedFile)]
    arrays: list[dict[str, HostArray | Placed]] = [{} for _ in files]
    loose: list[list[tuple[str, Span]]] = [[] for _ in files]
    same = all(f.spans == good[0].spans and f.base == good[0].base for f in good)
    whole: dict[str, Placed] = {}
    answers = {} if judged is None else judged.answers
    if len(good) == len(files) and same:
        whole = _place_run(good, scratch[: len(files) * size], place, arrays, loose, answers)
    else:
        each = answers if len(files) == 1 else unneeded(answers)
        for k, f in enumerate(files):
            if isinstance(f, LoadedFile):
                _place_block(f, place, arrays[k], loose[k], each)
    for j, (f, placed, rest) in enumerate(zip(files, arrays, loose, strict=True)):
        if not isinstance(f, LoadedFile):
            yield None, f
            continue
        block = _run_part(whole, j, f, placed, rest)
        lent = None
        if rest:
            lent = _loose(f, rest, bufs, placed)
            block = {name: placed[name] for name, *_ in f.spans if name in placed}  # file order
        yield lent, streamed(f.job, block)


def _load_all(
    jobs: Sequence[Job],
    scratch: np.ndarray,
    willneed: bool,
    judged: Judged | None,
    root: PayloadRoot | None,
) -> list[LoadedFile | PayloadError | OSError]:
    """The run's files, each read into its slot of ``scratch`` and verified (or why not)."""
    size = (scratch.nbytes - 1) // len(jobs)
    files: list[LoadedFile | PayloadError | OSError] = []
    headers = Headers()  # one layout: each header alike to the first is parsed once
    with _opened(jobs, willneed, root) as fds:
        for k, (job, opened) in enumerate(zip(jobs, fds, strict=True)):
            try:  # slot k, plus the next slot's first byte (read over by the next file)
                if isinstance(opened, BaseException):
                    raise opened
                slot = scratch[k * size : (k + 1) * size + 1]
                files.append(load(job, *opened, slot, judged, headers))
            except (PayloadError, OSError) as e:
                files.append(e)
    return files


@contextlib.contextmanager
def _opened(
    jobs: Sequence[Job], willneed: bool, root: PayloadRoot | None
) -> Iterator[list[tuple[int, int] | PayloadError | OSError]]:
    """The run's files opened, each (descriptor, size), or why not; each asked into the
    page cache at once: read cold, the run's reads are in flight together."""
    fds: list[tuple[int, int] | PayloadError | OSError] = []
    try:
        for job in jobs:
            try:
                fds.append(root.open(job.path) if root else open_sized(job.path))
            except (PayloadError, OSError) as e:
                fds.append(e)
                continue
            if willneed and _WILLNEED is not None:
                os.posix_fadvise(fds[-1][0], 0, 0, _WILLNEED)
        yield fds
    finally:
        for opened in fds:
            if isinstance(opened, tuple):
                os.close(opened[0])


def _place_run(
    files: list[LoadedFile],
    scratch: np.ndarray,
    place: Place | None,
    arrays: list[dict[str, HostArray | Placed]],
    loose: list[list[tuple[str, Span]]],
    known: dict[str, np.ndarray],
) -> dict[str, Placed]:
    """Place the tensors of files of one layout: one copy per tensor for all of
    them where the run has a region (4-axis tensors, several full blocks; returned:
    name -> a Placed of the run's region and the block's shape), else block by
    block (into ``arrays`` or ``loose``). ``known``: the run's answers already given."""
    k, first, base = len(files), files[0], files[0].base
    each = known if k == 1 else unneeded(known)
    rows = scratch.reshape(k, -1)  # file j's bytes in row j
    whole: dict[str, Placed] = {}
    for span in first.spans:
        name, dtype, shape, start, end = span
        dt = MX_DTYPES[dtype]
        region = None
        if k > 1:  # a run of one file is placed as a block
            region = known.get(name)
            if region is None and place is not None:
                region = place(first.index, name, dt, shape, k)
        if region is UNNEEDED:  # no layer reads it in any of these blocks
            continue
        if region is None or region.nbytes != k * (end - start):
            for f, placed, rest in zip(files, arrays, loose, strict=True):
                _place_tensor(f, span, place, placed, rest, each)
            continue
        b, h, n, width = region.shape[0], region.shape[1], shape[2], region.shape[3]
        dest = _view(region, (b, h, k, n, width))
        src = _view(rows[:, base + start : base + end], (k, b, h, n, width))
        np.copyto(dest, src.transpose(1, 2, 0, 3, 4))
        whole[name] = Placed(region, dt, shape)
    return whole


def _run_part(
    whole: dict[str, Placed],
    j: int,
    f: LoadedFile,
    placed: dict[str, HostArray | Placed],
    loose: list[tuple[str, Span]],
) -> Mapping[str, HostArray | Placed]:
    """Block ``j`` of a run's tensors: a PlacedRun when the run's copies placed
    all of them (but those skipped), else its Placed parts of ``whole`` added to
    ``placed``."""
    if not whole:
        return placed
    n = next(iter(whole.values())).shape[2]  # run_shape: every one a full block
    if not placed and not loose:  # every tensor placed by the run's copies, or skipped
        return PlacedRun(whole, (j * n, (j + 1) * n))
    for name, p in whole.items():
        placed[name] = Placed(p.region, p.dtype, p.shape, (j * n, (j + 1) * n))
    return {name: placed[name] for name, *_ in f.spans if name in placed}  # in file order


def _place_block(
    f: LoadedFile,
    place: Place | None,
    placed: dict[str, HostArray | Placed],
    loose: list[tuple[str, Span]],
    known: dict[str, np.ndarray],
) -> None:
    for span in f.spans:
        _place_tensor(f, span, place, placed, loose, known)


def _place_tensor(
    f: LoadedFile,
    span: Span,
    place: Place | None,
    placed: dict[str, HostArray | Placed],
    loose: list[tuple[str, Span]],
    known: dict[str, np.ndarray],
) -> None:
    """One tensor of a verified file into its place, or onto ``loose``."""
    name, dtype, shape, start, end = span
    dt = MX_DTYPES[dtype]
    region = known.get(name)
    if region is None and place is not None:
        region = place(f.index, name, dt, shape)
    if region is UNNEEDED:
        return
    if region is None or region.nbytes != end - start:
        loose.append((name, span))
        return
    np.copyto(region, f.data[f.base + start : f.base + end].reshape(region.shape))
    placed[name] = Placed(region, dt, shape)


def _loose(
    f: LoadedFile,
    loose: list[tuple[str, Span]],
    bufs: Buffers,
    arrays: dict[str, HostArray | Placed],
) -> np.ndarray:
    """Copy tensors without a place into the loose buffer (lent from now on)."""
    lent = bufs.loose(sum(end - start for _, (*_, start, end) in loose))
    used = 0
    for name, (_, dtype, shape, start, end) in loose:
        out = lent[used : used + end - start]
        out[...] = f.data[f.base + start : f.base + end]
        used += end - start
        arrays[name] = HostArray(out, MX_DTYPES[dtype], shape)
    return lent


def _view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` reshaped without a copy (a copy would swallow what is written into it)."""
    out = a.reshape(shape)
    if out.base is None:
        raise ValueError(f"region of strides {a.strides} cannot be viewed as {shape}")
    return out
