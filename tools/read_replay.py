"""A fetch's reads, recorded and replayed: what ``bench_ssd_replay`` measures a fetch against.

``Recorder`` records every read of more than one byte while active; ``Replay``
replays them on threads, each into kept buffers, fresh ones, restore-like MLX
buffers (``floor``) or those with each read landing at its bytes' offset from a
64-byte boundary (``floor64``), hashing (xxh3-64) every byte as it lands.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import xxhash
from benchlib import restore_like_buffers

Read = tuple[str, int, int]  # path, offset, bytes


class Recorder:
    """Every ``os.preadv`` / ``os.pread`` of more than one byte while active."""

    def __init__(self) -> None:
        self.reads: list[Read] = []
        self._lock = threading.Lock()
        self._real = (os.preadv, os.pread)

    def __enter__(self) -> Recorder:
        preadv, pread = self._real

        def rec_preadv(fd, buffers, offset, *flags):
            n = preadv(fd, buffers, offset, *flags)
            self._add(fd, offset, n)
            return n

        def rec_pread(fd, length, offset):
            data = pread(fd, length, offset)
            self._add(fd, offset, len(data))
            return data

        os.preadv, os.pread = rec_preadv, rec_pread
        return self

    def __exit__(self, *exc: object) -> None:
        os.preadv, os.pread = self._real

    def _add(self, fd: int, offset: int, n: int) -> None:
        if n > 1:
            path = os.readlink(f"/proc/self/fd/{fd}")
            with self._lock:
                self.reads.append((path, offset, n))


class Replay:
    """The recorded reads in file order, cut into ``threads`` contiguous shares, each
    replayed on its own thread and hashed as it lands. Where each read lands is laid
    out before the clock starts; the times are the buffers' making and the reads."""

    def __init__(self, reads: list[Read], threads: int) -> None:
        reads = sorted(reads)
        self.total = total = sum(n for *_, n in reads)
        self.shares: list[list[Read]] = [[] for _ in range(threads)]
        done = 0
        for r in reads:
            self.shares[min(threads - 1, done * threads // max(total, 1))].append(r)
            done += r[2]
        self.bufs = [np.ones(max(sum(n for *_, n in s), 1), np.uint8) for s in self.shares]
        self._kept = [_layout([s], [b], 1)[0] for s, b in zip(self.shares, self.bufs, strict=True)]
        self._spill: np.ndarray | None = None

    def run(self, fresh: bool = False) -> float:
        """Seconds to replay; ``fresh``: into new buffers (numpy's), not the kept ones."""
        if not fresh:
            return _on_threads(self._kept)
        began = time.perf_counter()
        bufs = [np.empty_like(b) for b in self.bufs]
        made = time.perf_counter() - began
        return made + _on_threads(
            [_layout([s], [b], 1)[0] for s, b in zip(self.shares, bufs, strict=True)]
        )

    def floor(self, sizes: list[int], align: int = 1) -> float:
        """Seconds to make restore-like buffers of ``sizes`` bytes (``benchlib``) and
        replay into them, filled in turn (bytes beyond them land in a kept buffer);
        ``align`` 64: each read where its bytes and the buffer share their offset
        from a 64-byte boundary (a little slack per buffer)."""
        slack = 0 if align == 1 else 2 * align * (-(-len(self._reads()) // max(len(sizes), 1)) + 1)
        began = time.perf_counter()
        made = restore_like_buffers([((n + slack) // 2,) for n in sizes])
        made_s = time.perf_counter() - began
        bufs = [b.view(np.uint8) for b in made] + [self._spilled()]
        return made_s + _on_threads(_layout(self.shares, bufs, align))

    def _reads(self) -> list[Read]:
        return [r for s in self.shares for r in s]

    def _spilled(self) -> np.ndarray:
        if self._spill is None:
            area = mmap.mmap(-1, self.total + (self.total >> 4) + (1 << 20))
            self._spill = np.frombuffer(area, np.uint8)
            self._spill[:] = 1
        return self._spill


Job = list[tuple[str, int, list[np.ndarray]]]  # (path, offset, views) per read


def _layout(shares: list[list[Read]], bufs: list[np.ndarray], align: int) -> list[Job]:
    """Per share, each read's views: ``bufs`` filled in turn, each view starting at
    its bytes' offset from an ``align``-byte boundary (1: end to end)."""
    k = pos = 0
    out = []
    for share in shares:
        job = []
        for path, offset, n in share:
            views, at = [], offset
            while n:
                pos += (at - bufs[k].ctypes.data - pos) % align
                take = min(n, bufs[k].size - pos)
                if take <= 0:
                    k, pos = k + 1, 0
                    continue
                views.append(bufs[k][pos : pos + take])
                at, n, pos = at + take, n - take, pos + take
            job.append((path, offset, views))
        out.append(job)
    return out


def _on_threads(jobs: list[Job]) -> float:
    """Seconds to replay each job on a thread of its own."""
    began = time.perf_counter()
    threads = [threading.Thread(target=_replay, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - began


def _replay(job: Job) -> None:
    """Each read into its views, hashed as it lands."""
    fds: dict[str, int] = {}
    hasher = xxhash.xxh3_64()
    try:
        for path, offset, views in job:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            os.preadv(fd, views, offset)
            for view in views:
                hasher.update(view)
    finally:
        for fd in fds.values():
            os.close(fd)
