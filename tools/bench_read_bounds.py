"""How fast can ANY restore from the page cache be, against a dd-style read?

Issue 3's warm target compares an SSD restore with a sequential read of an
equal-size file from the page cache. That read (``seq``: a reused 1 MiB buffer,
``dd bs=1M``) leaves nothing in memory; a restore must end with the bytes in
MLX arrays. This measures, in one run, warm, what the plain steps of any such
restore cost on this machine, with no prefixcache code at all:

  seq            the file into a reused 1 MiB buffer (the reference)
  into_full      the file into a reused, already-touched buffer of its size,
                 by all cores (the copy a restore cannot avoid)
  into_full_huge the same into a buffer on transparent huge pages
  into_fresh     the file into fresh memory, by all cores (pages faulted in)
  zeros_fresh    mx.zeros of the file's size on one CPU stream per core, MLX's
                 buffer cache empty (fresh pages faulted in)
  zeros_reuse    the same with MLX reusing a freed buffer of that size

Every restore must at least copy the bytes into memory that stays (``into_full``,
with no restore work around it) and have MLX write its buffers once
(``zeros_*``: MLX has no uninitialised allocation). GB/s of file bytes, medians
over repetitions, and each as a share of ``seq``.

    python tools/bench_read_bounds.py --mib 1024 --repeat 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time

import mlx.core as mx
import numpy as np
from benchlib import read_reused

MiB = 1 << 20


def read_parallel(path: str, dest: np.ndarray, threads: int) -> None:
    """The file into ``dest``, each thread a contiguous share, 1 MiB per call."""
    view, size = memoryview(dest), dest.nbytes

    def work(k: int) -> None:
        lo, hi = k * size // threads, (k + 1) * size // threads
        fd = os.open(path, os.O_RDONLY)
        try:
            for off in range(lo, hi, MiB):
                os.preadv(fd, [view[off : min(off + MiB, hi)]], off)
        finally:
            os.close(fd)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()


def huge_buffer(size: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(m, np.uint8)
    arr[:] = 1
    return m, arr


def zeros(size: int, streams: list[mx.Stream], reuse: bool) -> None:
    """``size`` bytes of MLX zeros in one buffer per stream (each its own thread)."""
    if not reuse:
        mx.clear_cache()
    parts = [mx.zeros((size // len(streams),), mx.uint8, stream=s) for s in streams]
    mx.eval(parts)
    del parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    size = args.mib * MiB
    threads = os.cpu_count() or 2
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        path = os.path.join(work, "file")
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
        full = np.ones(size, np.uint8)
        _mapping, huge = huge_buffer(size)  # freed at exit
        streams = [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in range(threads - 1)]
        mx.set_cache_limit(2 * size)  # zeros_reuse: the freed buffer stays with MLX
        steps = {
            "seq": lambda: read_reused([path], bytearray(MiB)),
            "into_full": lambda: read_parallel(path, full, threads),
            "into_full_huge": lambda: read_parallel(path, huge, threads),
            "into_fresh": lambda: read_parallel(path, np.empty(size, np.uint8), threads),
            "zeros_fresh": lambda: zeros(size, streams, reuse=False),
            "zeros_reuse": lambda: zeros(size, streams, reuse=True),
        }
        read_reused([path], bytearray(MiB))  # into the page cache
        zeros(size, streams, reuse=True)
        speed: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for name, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                speed.setdefault(name, []).append(size / (time.perf_counter() - t0) / 1e9)
    med = {name: statistics.median(v) for name, v in speed.items()}
    print(f"{args.mib} MiB from the page cache, {threads} threads; GB/s and share of seq")
    for name, value in med.items():
        print(f"{name:15s} {value:6.2f}  {value / med['seq']:5.0%}")


if __name__ == "__main__":
    main()
