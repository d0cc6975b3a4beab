"""A restore's copies, spread over a few threads once they are large.

A hot restore costs its copies: every byte of the chain into the new buffers,
whose fresh pages fault in as they are written. numpy releases the GIL while
it copies, so a few threads copy (and fault in) at once: on this project's
2-core VM a 128 MiB restore at block 256 took 21-24 ms against 25.6-26.3 ms on
one thread (tools/bench_blocks.py, ``PREFIXCACHE_COPY_THREADS=1`` for one
thread; two threads copy there only 1.2-1.3x as fast as one). Small restores,
and restores of small pieces (blocks of a few KiB per layer), stay on the
caller's thread: at blocks 32 and 64 two threads were no faster there.

Jobs run numpy only (no MLX), on buffers the restore owns alone until it
returns; ``wait`` returns once every job has ended, the first error raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .pools import SharedPool

PARALLEL_BYTES = 4 << 20  # below, one thread: waking others costs more than it saves
# Below, one thread: numpy holds the GIL between the pieces it copies, so threads
# copying many small pieces (small blocks) mostly wait for each other.
MIN_PIECE = 256 << 10


_CORES = min(4, os.cpu_count() or 1)  # read once: each os.cpu_count() reads /sys


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


_pools: dict[int, SharedPool] = {}  # by thread count


def _shared_pool(threads: int) -> ThreadPoolExecutor:
    pool = _pools.get(threads)
    if pool is None:
        pool = _pools.setdefault(threads, SharedPool(threads, "prefixcache-copy"))
    return pool.get()


class Copies:
    """Copy jobs of one restore: held on the caller's thread until they add up to
    ``PARALLEL_BYTES``, then run on the shared pool as they come."""

    def __init__(self) -> None:
        self._threads = _threads()
        self._held: list[Callable[[], None]] = []
        self._bytes = 0
        self._pieces = 0
        self._futures: list[Future] = []

    def add(self, nbytes: int, job: Callable[[], None], pieces: int = 1) -> None:
        """Run ``job`` (``nbytes`` in ``pieces`` numpy copies) on the pool, or hold
        it for ``wait``."""
        self._bytes += nbytes
        self._pieces += pieces
        self._held.append(job)
        big = self._bytes >= PARALLEL_BYTES and self._bytes >= MIN_PIECE * self._pieces
        if self._threads > 1 and big:
            pool = _shared_pool(self._threads)
            self._futures += [pool.submit(j) for j in self._held]
            self._held.clear()

    def wait(self) -> None:
        """Run what is held, wait for every job; raise the first error."""
        error: BaseException | None = None
        for job in self._held:
            try:
                job()
            except Exception as err:  # the pool's jobs still write: wait for them first
                error = error or err
        self._held.clear()
        for future in self._futures:
            err = future.exception()
            error = error or err
        self._futures.clear()
        if error is not None:
            raise error
