"""Reader threads of the SSD stream: each reads, verifies and places payload files.

Plain file I/O, xxh3, numpy copies and header checks: no MLX call leaves the
caller's thread. The jobs are cut into runs of consecutive files (small files read whole and
placed together; large ones each read straight into their places, the places
asked once per run); each reader takes the next run nobody has taken. How many readers
depends on whether the chain's files are in the page cache (a few probed). The
blocks of one run file are handed over as one batch (read together, ready
together); other blocks one by one, as each is read.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Iterator

import mlx.core as mx
import numpy as np

from ...memory.host import Place, StreamedBlock
from .files import PayloadRoot
from .large import read_large_run
from .prime import SLICE, Primer, cached
from .read_into import Buffers, Job, Outcome, Stopped
from .run_reads import plan, read_run_file
from .runs import plan_runs, read_run, small

# Reader threads. Warm (the files in the page cache) each is mostly copying,
# one per core: a third on 2 cores only contends for the GIL and the cores (about
# 10% slower). Cold, a reader's reads wait on the disk and more readers keep more
# in flight: three at least (about 1.2x two on 2 cores at block 16), four at most.
# Measured by tools/bench_blocks.py --tiers ssd --modes warm cold.
_CORES = os.cpu_count() or 2
_WARM_READERS = max(2, min(4, _CORES))
_COLD_READERS = min(4, max(3, _CORES))
# Files probed for being in the page cache, spread over the chain.
_PROBES = 3


# Seconds between asks for a destination still being allocated.
_PLACE_POLL = 0.0005


class Readers:
    """Reader threads that read and verify the jobs' payload files in parallel.

    Each reader takes the next run nobody has taken yet (so the readers end
    together, whatever share of the cores each gets) and hands over its jobs'
    outcomes in order, on the run's own queue. A block read wholly into its
    places lends nothing: the reader goes straight on, however far ahead of
    the caller. Tensors without a place go into the reader's ONE reused loose
    buffer, lent to the caller with the block (its HostArrays are views of
    it): the reader's next such read waits until it is given back
    (``Buffers``).
    """

    def __init__(self, jobs: list[Job], place: Place | None):
        self.jobs = jobs
        self.runs = plan(jobs, plan_runs)  # a run file's blocks: one run (run_reads.py)
        # a chain of a few runs gets as many readers either way: no probe (a request's
        # few blocks are its common case), its files asked into the page cache as cold
        self.warm = len(self.runs) > _WARM_READERS and _warm(jobs)
        self.n = n = min(_WARM_READERS if self.warm else _COLD_READERS, len(self.runs)) or 1
        self._run_of = [r for r, run in enumerate(self.runs) for _ in run]
        # next() is atomic: each run goes to one reader
        self._next_run = itertools.chain(_order(jobs, self.runs), itertools.repeat(len(self.runs)))
        self._free: list[queue.SimpleQueue[np.ndarray | None]] = [
            queue.SimpleQueue() for _ in range(n)
        ]
        # per run: (the reader that read them, a batch of outcomes), its jobs in order
        self._done: list[queue.SimpleQueue[tuple[int, list[tuple[np.ndarray | None, object]]]]] = [
            queue.SimpleQueue() for _ in self.runs
        ]
        self._lender: dict[int, int] = {}  # job -> the reader whose loose buffer it holds
        self._stopped = threading.Event()
        self.first_taken = threading.Event()  # the caller has the first block: places exist
        # the first job's read triggers the allocation: it must not wait for it
        self._first_place = self._judge = place  # the judge: is a tensor UNNEEDED (never waits)
        ahead = self.runs[n].start if len(self.runs) > n else len(jobs)  # readers' first runs
        later = list(dict.fromkeys((j.path, j.meta.file_bytes) for j in jobs[ahead:] if j.meta))
        primer = Primer(later, self.first_taken)
        self._place = None if place is None else _patient(place, primer, self._stopped)
        self._root = _root(jobs)
        self._threads = [
            threading.Thread(target=self._run, args=(k,), name=f"prefixcache-ssd-read-{k}")
            for k in range(n)
        ]
        # every reader started before any reads: ``start`` waits until the new thread
        # runs, and a reader already reading keeps the interpreter lock from the caller
        # for up to the switch interval (5 ms) at each start
        self._go = threading.Event()
        try:
            for t in self._threads:
                t.daemon = True
                t.start()
        except BaseException:  # a start failed (no thread to be had): stop those started
            self.stop()
            raise
        self._go.set()

    def take(self, i: int) -> list[tuple[np.ndarray | None, StreamedBlock | BaseException | None]]:
        """The outcomes of job ``i`` and of the jobs read with it (a run file's
        blocks: one batch), in order; ``i`` is the first job not taken yet."""
        k, batch = self._done[self._run_of[i]].get()
        for j, (buf, result) in enumerate(batch):
            if isinstance(result, _Crash):
                raise RuntimeError("SSD stream reader failed") from result.error
            if buf is not None:
                self._lender[i + j] = k
        return batch  # type: ignore[return-value]

    def give_back(self, i: int, buf: np.ndarray | None) -> None:
        if buf is not None:
            self._free[self._lender.pop(i)].put(buf)

    def stop(self) -> None:
        self._stopped.set()
        self.first_taken.set()  # wakes a reader waiting for the first block
        for free in self._free:
            free.put(None)  # wakes a reader waiting for its buffer
        self._go.set()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join()
        if self._root is not None:
            self._root.close()
        # the places reach the restore buffers: hold nothing once stopped
        self._first_place = self._place = self._judge = None

    def _run(self, k: int) -> None:
        self._go.wait()
        bufs = Buffers(self._free[k])
        r = 0
        try:
            while (r := next(self._next_run)) < len(self.runs):
                if self._stopped.is_set():
                    return
                done = self._done[r]
                for batch in self._outcomes(self.runs[r], bufs):
                    if self._stopped.is_set():  # a long run's later files are not read
                        return
                    done.put((k, batch))
        except Stopped:
            return
        except BaseException as e:  # a bug: hand it to the caller instead of hanging it
            self._done[r].put((k, [(None, _Crash(e))]))

    def _outcomes(self, run: range, bufs: Buffers) -> Iterator[list[Outcome | tuple[None, None]]]:
        """The run's outcomes in batches: a run file's blocks all at once (they are
        read together and lend no buffer), any other block on its own."""
        jobs = self.jobs[run.start : run.stop]
        place = self._place if run.start else self._first_place
        if jobs[0].meta is None:  # queued, absent or a bad entry: the caller sees to it
            yield [(None, None)]
            return
        if jobs[0].run is not None:
            yield list(read_run_file(jobs, bufs, place, self._root))
            return
        if small(jobs[0]):
            each = read_run(
                jobs, bufs, place, willneed=not self.warm, judge=self._judge, root=self._root
            )
        else:
            each = read_large_run(jobs, bufs, place)
        for outcome in each:
            yield [outcome]


def _order(jobs: list[Job], runs: list[range]) -> list[int]:
    """The order the readers take the runs in: the first (its block makes the
    caller's buffers), the runs of large files (a hybrid's state snapshot, read
    beside the small files' runs, not by one reader alone at the end), the rest."""
    large = [
        r
        for r in range(1, len(runs))
        if jobs[runs[r].start].meta and not small(jobs[runs[r].start])
    ]
    taken = set(large)
    return [0, *large, *(r for r in range(1, len(runs)) if r not in taken)] if runs else []


def _root(jobs: list[Job]) -> PayloadRoot | None:
    """The payloads' root (``root/ab/file``) held open for the restore; None where
    it cannot be opened (each file is then opened by its path, and fails alike)."""
    path = next((j.path for j in jobs if j.meta is not None), None)
    if path is None:
        return None
    try:
        return PayloadRoot(os.path.dirname(os.path.dirname(path)))
    except OSError:
        return None


def _warm(jobs: list[Job]) -> bool:
    """Whether the chain's files are in the page cache, judged by a few of them
    spread over the chain (False where the kernel cannot be asked)."""
    files = [(j.path, j.meta.file_bytes) for j in jobs if j.meta is not None]
    if not hasattr(os, "RWF_NOWAIT"):
        return False
    step = max(len(files) - 1, 0) / (_PROBES - 1)
    probes = dict.fromkeys(files[round(k * step)] for k in range(_PROBES)) if files else {}
    return all(cached(path, size) for path, size in probes)


def _patient(place: Place, primer: Primer, stopped: threading.Event) -> Place:
    """``place`` that waits for a destination still being allocated: until the
    caller has the first block, a tensor without a place yet is asked again (the
    first block's copy allocates each layer's buffer in turn, and the readers
    follow right behind instead of waiting for all of them); meanwhile the
    reader primes later files. It refers to no reader object: a reference back
    would be a cycle keeping the restore buffers alive until the garbage
    collector runs."""
    scratch: list[memoryview] = []  # allocated once a reader has to wait

    def patient(
        index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None:
        while True:
            dest = place(index, name, dtype, shape, count)
            if dest is not None or primer.done.is_set() or stopped.is_set():
                return dest
            if not scratch:
                scratch.append(memoryview(bytearray(SLICE)))
            if not primer.step(scratch[0]):
                primer.done.wait(_PLACE_POLL)

    return patient


class _Crash:
    def __init__(self, error: BaseException):
        self.error = error
