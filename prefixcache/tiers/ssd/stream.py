"""Streamed SSD reads for a restore: reader threads read payloads into their places.

:class:`SsdReader` is the SSD tier's :class:`~prefixcache.tiers.base.TierReader`:
``stream(reads, keys, place)`` yields the blocks of a chain in order. Blocks on
disk are read by reader threads (plain file I/O, xxh3 and header checks: no MLX
call leaves the caller's thread), several files in flight, so later blocks are
read while the caller handles earlier ones. The index entries of the whole
chain are read in one LMDB transaction. A reader asks ``place`` where each
tensor goes: once the restore's buffers exist, that is a region of the buffer
itself. Small payload files are read whole, verified, and copied into their
places in runs of consecutive blocks, one numpy copy per tensor and run; a
large one is read from the page cache straight into the restored cache (one
copy) and hashed there while it is still in the CPU cache. A tensor with no
place goes into the reader's loose buffer.

The buffers normally exist before the stream starts: the restore sizes them
from the first block's header (``SsdReader.first_shapes``), so every block goes
straight into place. When it cannot (that header unreadable, the block still
queued for the writer), the first block is read into a read buffer and its
copy allocates the buffers; until the caller has taken it, a later tensor
whose buffer does not exist yet is asked for again, and in between the
readers pull later payload files into the page cache (``Primer``). Otherwise
the kernel's own readahead serves each file.

A yielded :class:`StreamedBlock` holds ``Placed`` tensors (already in their
place) and HostArrays (zero-copy views into a read buffer, verified, valid until
the next block is requested). The blocks of one run file come to the caller
as one batch (``stream_runs``, ``SsdReader.load_run``): read together, they
are taken together, so the caller's work is per batch, not per block. A block
still queued for the writer is served
from the queue (a fresh :class:`Block`). A block that is missing or fails its
checks is quarantined (on the caller's thread), counted, and yielded as None: a
miss. A large one's bytes may already be in the restore buffer (a small one is
verified before any byte is placed): the restore then stops before that block
(the buffers are discarded or the block is never exposed).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from ...blocks import Block
from ...errors import PayloadError
from ...memory.host import Place, Placed, StreamedBlock
from ..base import TierReader
from .index import decode_or_none
from .read_into import Job
from .readers import Readers
from .reads import SsdReads


class SsdReader(TierReader):
    """The blocks of one restore that the SSD tier holds, streamed in chain order."""

    def __init__(self, tier: SsdReads, keys: Sequence[bytes]):
        self.tier, self.keys = tier, keys
        self._stream: Iterator[list[Block | StreamedBlock | None]] | None = None
        self._order: list[int] = []
        self._next = 0
        self._ready: list[Block | StreamedBlock | None] = []  # the batch being loaded
        self._at = 0  # its first block not loaded yet

    def first_shapes(self, indices: list[int]) -> Mapping[str, Placed] | None:
        """Block ``indices[0]``'s tensor dtypes and shapes from its payload header
        (unverified: they only size the restore buffers, so every block, that one
        too, can be read straight into place); None if queued or unreadable."""
        if not indices:
            return None
        key = self.keys[indices[0]]
        if self.tier.writer.pending(key) is not None:
            return None
        try:
            specs = self.tier.header(key)
        except (OSError, PayloadError):
            return None  # the stream reads it again and tells
        return {name: Placed(None, dtype, shape) for name, dtype, shape in specs}

    def prepare(self, indices: list[int], place: Place | None) -> None:
        self.close()
        self._order, self._next = list(indices), 0
        if indices:
            self._stream = stream_runs(self.tier, [self.keys[i] for i in indices], place)

    def load(self, index: int) -> Block | StreamedBlock | None:
        return self.load_run(index, 1)[0]

    def load_run(self, index: int, limit: int | None = None) -> list[Block | StreamedBlock | None]:
        """Block ``index`` and the blocks after it read with it (a run file's), at
        most ``limit``, while their chain indices follow on: the stream hands a run
        file's blocks over as one batch."""
        order, at = self._order, self._next
        if self._stream is None or order[at : at + 1] != [index]:
            return [self.tier.load(self.keys[index])]  # unplanned: one synchronous load
        if not self._ready:
            self._ready, self._at = next(self._stream), 0
        ready, first = self._ready, self._at
        stop = len(ready) if limit is None else min(len(ready), first + limit)
        n = 1
        while first + n < stop and order[at + n] == index + n:
            n += 1
        self._next, self._at = at + n, first + n
        if self._at == len(ready):
            self._ready = []
        return ready[first : first + n]

    def close(self) -> None:
        """Stop the stream and wait for its readers; safe to call more than once."""
        self._ready = []
        if self._stream is not None:
            self._stream.close()  # type: ignore[attr-defined]
            self._stream = None


def stream(
    tier: SsdReads, keys: Sequence[bytes], place: Place | None = None
) -> Iterator[Block | StreamedBlock | None]:
    """Yield the blocks of ``keys`` in order (see the module docstring).

    Args:
        place: where a tensor (or a run of blocks' tensors) goes in the
            restore buffers (``host.Place``), or None. Called from reader
            threads; the regions must stay valid until the generator is closed.

    Closing the generator (a restore done or falling short) stops the readers
    and waits for them: after that nothing writes into a destination.
    """
    runs = stream_runs(tier, keys, place)
    try:
        for batch in runs:
            yield from batch
    finally:
        runs.close()


def stream_runs(
    tier: SsdReads, keys: Sequence[bytes], place: Place | None = None
) -> Iterator[list[Block | StreamedBlock | None]]:
    """As ``stream``, in batches of consecutive blocks: a run file's blocks read
    together come as one batch (the caller's work is per batch), any other
    block on its own. A batch's views stay valid until the next is requested."""
    jobs = _jobs(tier, keys)
    readers = Readers(jobs, place)
    served: list[bytes] = []  # read by the readers: counted once, at the end
    nbytes = 0
    i = 0
    try:
        while i < len(jobs):
            batch = readers.take(i)
            try:
                out = []
                for job, (_, result) in zip(jobs[i : i + len(batch)], batch, strict=True):
                    block = _result(tier, job, result)
                    if block is not None and block is result:
                        served.append(job.key)
                        nbytes += block.nbytes
                    out.append(block)
                yield out
            finally:
                for j, (buf, _) in enumerate(batch):
                    readers.give_back(i + j, buf)
                if not i:
                    readers.first_taken.set()
                i += len(batch)
    finally:
        readers.stop()
        tier.note_loads(served, nbytes)


def _jobs(tier: SsdReads, keys: Sequence[bytes]) -> list[Job]:
    """A job per key: the index entries read in one transaction; a block still
    queued for the writer gets none (it is served from the queue). A run file's
    path is made once for all its blocks."""
    jobs = []
    paths: dict[bytes, str] = {}
    queued = tier.writer.pending_many(keys)
    for key, (raw, run), item in zip(keys, tier.index.get_runs(keys), queued, strict=True):
        if item is not None:
            raw = run = None
        file_key = key if run is None else run.file_key
        path = paths.get(file_key)
        if path is None:
            path = paths[file_key] = tier.payload_file(file_key)
        jobs.append(Job(key, raw, decode_or_none(key, raw), path, run))
    return jobs


def _result(
    tier: SsdReads, job: Job, result: StreamedBlock | BaseException | None
) -> Block | StreamedBlock | None:
    """What the caller gets for ``job`` (runs on the caller's thread); a block
    read by the readers is counted by the stream."""
    if result is None:  # nothing read: queued, absent, or a bad entry
        return tier.load(job.key)  # the queue first; quarantines a bad entry
    if isinstance(result, PayloadError | FileNotFoundError):
        tier.quarantine(job.key, job.raw, str(result) or type(result).__name__)
        return None
    if isinstance(result, OSError):  # unreadable now (EMFILE, EIO...): a miss, not a verdict
        tier.read_error(job.key, result)
        return None
    if isinstance(result, BaseException):
        raise result
    return result
