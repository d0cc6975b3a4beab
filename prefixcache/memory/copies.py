"""A restore's copies, run by the caller's thread and a few pool threads together.

A hot restore costs its copies: every byte of the chain into the new buffers.
numpy releases the GIL while it copies a piece but takes it back between
pieces, so the caller's thread copies too rather than wait on the pool: each
thread takes the next job nobody has taken, and a thread held back costs at
most what one thread would (fixed shares would make every other thread wait
for it). A restore under ``PARALLEL_BYTES``, or of pieces under ``MIN_PIECE``
on average, stays on the caller's thread; ``PREFIXCACHE_COPY_THREADS=1`` keeps
every restore there. ``tools/bench_blocks.py --tiers hot`` measures a hot
restore on one thread and on several.

Jobs run numpy only (no MLX), on buffers the restore owns alone until it
returns; ``wait`` returns once every job has ended, the first error raised.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from .pools import SharedPool

PARALLEL_BYTES = 4 << 20  # below, one thread: waking others costs more than it saves
# Pieces under this on average stay on one thread: a second thread gains nothing
# on pieces of 4 and 16 KiB and about 1.3x at 32 KiB (tools/bench_blocks.py
# --tiers hot, a 24-layer model of 2 KV heads x 64 dims at blocks 16 and 64).
MIN_PIECE = 32 << 10

_CORES = min(4, os.cpu_count() or 1)  # read once: each os.cpu_count() reads /sys

Job = Callable[[], None]


def _threads() -> int:
    raw = os.environ.get("PREFIXCACHE_COPY_THREADS")
    if raw is None:
        return _CORES
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"PREFIXCACHE_COPY_THREADS must be an integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"PREFIXCACHE_COPY_THREADS must be >= 1, got {n}")
    return n


_pools: dict[int, SharedPool] = {}  # by helper count (the caller copies too)


def _shared_pool(helpers: int) -> ThreadPoolExecutor:
    pool = _pools.get(helpers)
    if pool is None:
        pool = _pools.setdefault(helpers, SharedPool(helpers, "prefixcache-copy"))
    return pool.get()


class Copies:
    """Copy jobs of one restore, run by ``wait``: on the caller's thread, joined by
    pool threads once they add up to ``PARALLEL_BYTES`` in pieces of ``MIN_PIECE``
    on average."""

    def __init__(self) -> None:
        self._threads = _threads()
        self._jobs: list[Job] = []
        self._bytes = 0
        self._pieces = 0

    def add(self, nbytes: int, job: Job, pieces: int = 1) -> None:
        """Queue ``job`` (``nbytes`` copied from ``pieces`` arrays) for ``wait``."""
        self._jobs.append(job)
        self._bytes += nbytes
        self._pieces += pieces

    def wait(self) -> None:
        """Run every job, wait for them all; raise the first error."""
        jobs, self._jobs = self._jobs, []
        big = self._bytes >= PARALLEL_BYTES and self._bytes >= MIN_PIECE * self._pieces
        threads = self._threads if big else 1
        self._bytes = self._pieces = 0
        helpers = min(threads, len(jobs)) - 1
        turns = itertools.count()  # next() is atomic: each job is taken once
        # one pool per thread count: a restore of fewer jobs uses fewer of its threads
        futures = [_shared_pool(threads - 1).submit(_take, jobs, turns) for _ in range(helpers)]
        error = None
        try:
            error = _take(jobs, turns)
        finally:  # every job ends before anything is raised
            errors = [future.result() for future in futures]
        error = error or next((e for e in errors if e is not None), None)
        if error is not None:
            raise error


def _take(jobs: list[Job], turns: Iterator[int]) -> BaseException | None:
    """Run the next job nobody has taken until none is left; the first error, or None."""
    error: BaseException | None = None
    while (i := next(turns)) < len(jobs):
        try:
            jobs[i]()
        except Exception as err:  # the other jobs still run: the buffers are whole or unused
            error = error or err
    return error
