"""A fetch's reads, recorded and replayed: what ``bench_ssd_replay`` measures a fetch against.

``Recorder`` records every read of more than one byte while active; ``Replay``
replays them on threads, each into kept buffers, fresh ones, restore-like MLX
buffers (``floor``) or those with each read landing at its bytes' offset from a
64-byte boundary (``floor64``), hashing (xxh3-64) every byte as it lands.
"""

from __future__ import annotations

import bisect
import itertools
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
    """The recorded reads in file order, cut into ``threads`` contiguous shares,
    each read into its kept buffer and hashed."""

    def __init__(self, reads: list[Read], threads: int) -> None:
        reads = sorted(reads)
        total = sum(n for *_, n in reads)
        self.shares: list[list[Read]] = [[] for _ in range(threads)]
        done = 0
        for r in reads:
            self.shares[min(threads - 1, done * threads // max(total, 1))].append(r)
            done += r[2]
        self.bufs = [np.ones(max(sum(n for *_, n in s), 1), np.uint8) for s in self.shares]
        sizes = [sum(n for *_, n in s) for s in self.shares]
        self.starts = [sum(sizes[:i]) for i in range(threads)]
        self.total = total

    def run(self, fresh: bool = False) -> float:
        """Seconds to replay; ``fresh``: into new buffers (numpy's), not the kept ones."""
        began = time.perf_counter()
        bufs = [np.empty_like(b) for b in self.bufs] if fresh else self.bufs
        threads = [
            threading.Thread(target=_replay, args=(s, b))
            for s, b in zip(self.shares, bufs, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - began

    def floor(self, sizes: list[int]) -> float:
        """Seconds to make restore-like buffers of ``sizes`` bytes and replay into
        them in order (bytes read beyond their sum land in one kept buffer)."""
        began = time.perf_counter()
        bufs = [b.view(np.uint8) for b in restore_like_buffers([(n // 2,) for n in sizes])]
        bufs.append(self._spill(sizes))
        threads = [
            threading.Thread(target=_replay_into, args=(s, bufs, at))
            for s, at in zip(self.shares, self.starts, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - began

    def floor64(self, sizes: list[int]) -> float:
        """``floor`` with every read landing where its bytes and the buffer share
        their offset from a 64-byte boundary (a little slack per buffer; the
        placing itself is not timed): the least a restore whose files and buffers
        were laid out for the kernel's fastest copy would do."""
        slack = 128 * (-(-sum(len(s) for s in self.shares) // max(len(sizes), 1)) + 1)
        began = time.perf_counter()
        made = restore_like_buffers([((n + slack) // 2,) for n in sizes])
        made_s = time.perf_counter() - began
        bufs = [b.view(np.uint8) for b in made] + [self._spill64()]
        jobs = _aligned(self.shares, bufs)
        began = time.perf_counter()
        threads = [threading.Thread(target=_replay_views, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return made_s + time.perf_counter() - began

    def _spill64(self) -> np.ndarray:
        if getattr(self, "spill64", None) is None:
            area = mmap.mmap(-1, self.total + (self.total >> 4) + (1 << 20))
            self.spill64 = np.frombuffer(area, np.uint8)
            self.spill64[:] = 1
        return self.spill64

    def _spill(self, sizes: list[int]) -> np.ndarray:
        n = max(self.total - sum(n // 2 * 2 for n in sizes), 1)
        if getattr(self, "spill", None) is None or self.spill.size != n:
            self.spill = np.ones(n, np.uint8)
        return self.spill


def _aligned(shares: list[list[Read]], bufs: list[np.ndarray]) -> list[list[tuple]]:
    """Per share, (path, offset, views) with each view starting at the same offset
    from a 64-byte boundary as its bytes in the file, the buffers filled in turn."""
    k = pos = 0
    out = []
    for share in shares:
        job = []
        for path, offset, n in share:
            views = []
            at = offset
            while n:
                addr = bufs[k].ctypes.data
                pos += (at - addr - pos) % 64
                take = min(n, bufs[k].size - pos)
                if take <= 0:
                    k, pos = k + 1, 0
                    continue
                views.append(bufs[k][pos : pos + take])
                at, n, pos = at + take, n - take, pos + take
            job.append((path, offset, views))
        out.append(job)
    return out


def _replay_views(job: list[tuple]) -> None:
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


def _replay_into(reads: list[Read], bufs: list[np.ndarray], at: int) -> None:
    """``reads`` landing at byte ``at`` of ``bufs`` taken end to end, hashed."""
    ends = list(itertools.accumulate(b.size for b in bufs))
    k = bisect.bisect_right(ends, at)
    pos = at - (ends[k - 1] if k else 0)
    fds: dict[str, int] = {}
    hasher = xxhash.xxh3_64()
    try:
        for path, offset, n in reads:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            views = []
            while n:
                take = min(n, bufs[k].size - pos)
                views.append(bufs[k][pos : pos + take])
                n, pos = n - take, pos + take
                if pos == bufs[k].size:
                    k, pos = k + 1, 0
            os.preadv(fd, views, offset)
            for view in views:
                hasher.update(view)
    finally:
        for fd in fds.values():
            os.close(fd)


def _replay(reads: list[Read], buf: np.ndarray) -> None:
    fds: dict[str, int] = {}
    hasher = xxhash.xxh3_64()
    at = 0
    try:
        for path, offset, n in reads:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            view = buf[at : at + n]
            os.preadv(fd, [view], offset)
            hasher.update(view)
            at += n
    finally:
        for fd in fds.values():
            os.close(fd)
