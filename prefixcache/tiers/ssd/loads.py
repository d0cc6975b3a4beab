"""One small payload file of a run (``runs.py``) read into its scratch slot and verified.

Read whole and checked against its whole-file checksum; or, where its header
has per-tensor digests (``digests.py``) and some of its tensors no layer of the
restore reads (``UNNEEDED``), its header and the tensors the restore uses only,
each checked against its digest: nothing else of the file is read. Which
tensors are UNNEEDED is asked once per run, from its first header read.

The writer puts what restores mostly skip (window K/V, recurrent state) at the
end of a file (``cache/capture.py``), so the used tensors follow the header in
one stretch: once a run's first file showed where that stretch ends, each later
file of the run (one layout) is read in one read that stops there, and verified
in one hash call against the lead digest of its last tensor (files without lead
digests: each tensor against its own digest).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import xxhash

from ...errors import PayloadError
from ...memory.host import MX_DTYPES, UNNEEDED, Place
from . import digests as tensor_digests
from .digests import Layout
from .headers import Headers
from .payload import header_length
from .read_into import Job, Span, pread_all


@dataclass(frozen=True, slots=True)
class LoadedFile:
    """A payload file read into its scratch slot and verified."""

    job: Job
    index: int  # in the chain
    data: np.ndarray  # the file's bytes
    base: int  # where the tensors' data start
    spans: tuple[Span, ...]


class Judged:
    """A run's answers to ``place(its first index, name, dtype, shape, its count)``,
    asked once per tensor from the first header read, before the data are read
    (a judge never waits: None where no place exists yet). A tensor without a
    run-wide answer (some of the run's blocks use it: the run reaches into a
    window) is asked again per block while it is UNNEEDED there: a window layer
    uses a run's blocks from some block on, so once one uses it, it is read on."""

    def __init__(self, judge: Place, index: int, count: int):
        self._judge, self._index, self._count = judge, index, count
        self._asked = False
        self.skips: bool | None = None  # False: the run's later files are read whole
        self.head = 8  # bytes a file's first read takes: the last header's (a run's alike)
        # where the used tensors end, if they follow the header in one stretch (0: not)
        self.front = 0
        self.answers: dict[str, np.ndarray] = {}  # name -> UNNEEDED or a region
        self._unneeded: frozenset[str] = frozenset()
        self._per_block: dict[str, tuple[mx.Dtype, tuple[int, ...]]] = {}  # asked per block

    def unneeded(self, spans: tuple[Span, ...], index: int) -> frozenset[str]:
        """Names of ``spans`` no layer of the restore reads in block ``index`` of the run."""
        if not self._asked:
            self._asked = True
            for name, dtype, shape, *_ in spans:
                got = self._judge(self._index, name, MX_DTYPES[dtype], shape, self._count)
                if got is not None:
                    self.answers[name] = got
                elif self._count > 1:
                    self._per_block[name] = (MX_DTYPES[dtype], shape)
            self._unneeded = frozenset(unneeded(self.answers))
        if not self._per_block:
            return self._unneeded
        more = set()
        for name, (dtype, shape) in list(self._per_block.items()):
            if self._judge(index, name, dtype, shape, 1) is UNNEEDED:
                more.add(name)
            else:
                del self._per_block[name]
        return self._unneeded | more if more else self._unneeded


def unneeded(answers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The run's UNNEEDED answers: true of each of its blocks too."""
    return {name: got for name, got in answers.items() if got is UNNEEDED}


def load(
    job: Job, fd: int, st_size: int, slot: np.ndarray, judged: Judged | None, headers: Headers
) -> LoadedFile:
    """Read a small payload file (``st_size``: its size as ``fstat`` gave it) into
    ``slot`` (the index's size + 1) and verify it: whole, or (it has digests and
    some of its tensors are UNNEEDED) its header and the tensors the restore uses,
    each against its digest. ``headers``: its run's, each parsed once."""
    meta = job.meta
    assert meta is not None
    size = meta.file_bytes
    if st_size != size:  # refused unread
        raise PayloadError(f"payload has {st_size} bytes, index says {size}")
    if judged is None or judged.skips is False:
        return _verified(job, slot, pread_all(fd, slot[:size], 0), headers)  # sized already
    got = pread_all(fd, slot[: min(size, max(judged.head, judged.front))], 0)
    base = 8 + header_length(slot[:8].tobytes(), size) if got >= 8 else size + 1
    if got < base <= size:
        got += pread_all(fd, slot[got:base], got)
    if got < base or size - base != meta.nbytes:
        return _verified(job, slot, got, headers)  # the sizes' error
    judged.head = base
    text = slot[8:base].tobytes()
    spans, layout, alike = headers.parse(text, job.key, size - base)
    unneeded = judged.unneeded(spans, meta.index)
    plan = headers.plans.get(unneeded) if alike else None
    if plan is None:
        plan = _plan(text, spans, layout, unneeded)
        if alike:  # of the run's layout: the digests lie where the first file's do
            headers.plans[unneeded] = plan
    used, skip, front, at, seeds = plan
    lead = None if at is None else int(text[at : at + 16], 16)
    digests = tensor_digests.parse(text, spans, used, layout) if skip and lead is None else None
    judged.skips = lead is not None or digests is not None
    if not judged.skips:
        got += pread_all(fd, slot[got:size], got)
        return _verified(job, slot, got, headers, spans)
    judged.front = base + used[-1][4] if front else 0
    if lead is None:
        assert digests is not None
        _read_used(fd, slot, base, used, digests, got)
    else:
        _read_lead(fd, slot, base, used, (lead, seeds), got)
    return LoadedFile(job, meta.index, slot[:size], base, spans)


def _plan(
    text: bytes, spans: tuple[Span, ...], layout: Layout | None, unneeded: frozenset[str]
) -> tuple[list[Span], bool, bool, int | None, bytes]:
    """(the used tensors, whether skipping the others is worth it, whether the used
    ones lead the file, where the last one's lead digest lies in the header, the
    used tensors' seeds as the lead digest binds them)."""
    used = [s for s in spans if s[0] not in unneeded]
    skip = tensor_digests.worth_skipping(spans, [s[0] in unneeded for s in spans])
    # the used tensors lead the file: one read up to their end, one hash (its lead digest)
    front = bool(used) and tuple(used) == spans[: len(used)]
    at = tensor_digests.lead_at(text, spans, used[-1][0], layout) if skip and front else None
    return used, skip, front, at, tensor_digests.packed_seeds(used)


def _read_lead(
    fd: int, slot: np.ndarray, base: int, used: list[Span], lead: tuple[int, bytes], got: int
) -> None:
    """Read the file's first tensors (``used``, the first ``got`` bytes of ``slot``
    held already) into ``slot`` and verify them against ``lead``: the last one's lead
    digest, and their packed seeds."""
    end = base + used[-1][4]
    if got < end and pread_all(fd, slot[got:end], got) != end - got:
        raise PayloadError("short read")
    if not tensor_digests.lead_matches(slot[base:end], used, *lead):
        raise PayloadError(f"payload tensors {used[0][0]!r} to {used[-1][0]!r} digest mismatch")


def _verified(
    job: Job, slot: np.ndarray, got: int, headers: Headers, spans: tuple[Span, ...] | None = None
) -> LoadedFile:
    """The file read whole (``got`` bytes into ``slot``), size-checked and verified."""
    meta = job.meta
    assert meta is not None
    size = meta.file_bytes
    if got != size:
        more = "more than " if got > size else ""
        raise PayloadError(f"payload has {more}{min(got, size)} bytes, index says {size}")
    data = slot[:size]
    if xxhash.xxh3_64_intdigest(data) != meta.checksum:
        raise PayloadError("payload checksum mismatch")
    base = 8 + header_length(data[:8].tobytes(), size)
    if size - base != meta.nbytes:
        raise PayloadError(f"payload holds {size - base} bytes, index says {meta.nbytes}")
    if spans is None:
        spans = headers.parse(data[8:base].tobytes(), job.key, size - base)[0]
    return LoadedFile(job, meta.index, data, base, spans)


def _read_used(
    fd: int, slot: np.ndarray, base: int, used: list[Span], digests: dict[str, int], got: int
) -> None:
    """Read the ``used`` tensors into their places in ``slot`` (neighbours in one
    read; none of what the first ``got`` bytes of ``slot`` hold already) and verify
    each against its digest."""
    groups: list[list[Span]] = []
    for span in used:
        if groups and groups[-1][-1][4] == span[3]:
            groups[-1].append(span)
        else:
            groups.append([span])
    for group in groups:
        start, end = base + group[0][3], base + group[-1][4]
        start = min(max(start, got), end)
        if pread_all(fd, slot[start:end], start) != end - start:
            raise PayloadError("short read")
        for span in group:
            data = slot[base + span[3] : base + span[4]]
            if xxhash.xxh3_64_intdigest(data, tensor_digests.seed(span)) != digests[span[0]]:
                raise PayloadError(f"payload tensor {span[0]!r} digest mismatch")
