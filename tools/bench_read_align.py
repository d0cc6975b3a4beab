"""How a file read's speed depends on where its buffer starts: the SSD references' hidden variable.

A warm read copies page-cache pages into the caller's buffer (the kernel's
``copy_to_user``). On some CPUs (this project's AMD EPYC VM: ``erms``, ``fsrm``)
that copy runs about half as fast when the buffer and the file's bytes sit at
different offsets from a 64-byte boundary. ``numpy.empty`` / ``numpy.ones`` of a
large array start 16 bytes past a page (glibc's ``mmap`` chunk header), and
MLX's CPU buffers 24 bytes past one (the same header and MLX's own size word),
while a file's data starts at offset 0. So ``bench_blocks``' SSD reference (one
file into one numpy buffer, as issue 42 asks) reads at the misaligned speed.

Each round reads one ``--mib`` file (page cache warm) into a buffer kept across
rounds that starts ``--offsets`` bytes past a 2 MiB boundary (an ``mmap``, so no
allocator header), on 1 and 2 threads (each its half of the file into its half
of the buffer), every way in turn, rotating order. Printed: the offsets numpy's
and MLX's allocations got in this process, then per offset and thread count the
median time, GB/s and the median per-round ratio to offset 0 on one thread.

    python tools/bench_read_align.py [--mib 99] [--repeat 9] [--offsets 0 8 16 24 32 64]
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

from prefixcache.memory.host import host_view
from prefixcache.memory.restore_buffers import empty

MiB = 1 << 20
BOUNDARY = 2 * MiB


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=99, help="file size (MiB)")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--offsets", type=int, nargs="+", default=[0, 8, 16, 24, 32, 64])
    p.add_argument("--dir", default=None)
    return p


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A kept buffer of ``nbytes`` starting on a page (an ``mmap``: no allocator
    header before it), written once: a file read into it runs at the memory's copy
    speed, the references' other choice (bench_blocks' ``file64``)."""
    out = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes]
    out[:] = 1
    return out


def allocator_offsets(nbytes: int) -> dict[str, int]:
    """Where a large numpy array and a large MLX restore buffer start, mod 64."""
    a = np.ones(nbytes, np.uint8)
    b = empty((nbytes // 2,), mx.uint16, stream=mx.cpu)
    mx.eval(b)
    return {"numpy": a.ctypes.data % 64, "MLX": host_view(b).ctypes.data % 64}


def read(fd: int, buf: np.ndarray, threads: int) -> float:
    """Seconds to read the file into ``buf``, each thread its contiguous share."""
    share = -(-buf.size // threads)

    def part(k: int) -> None:
        view = buf[k * share : (k + 1) * share]
        if os.preadv(fd, [view], k * share) != view.size:
            raise OSError("short read")

    began = time.perf_counter()
    if threads == 1:
        part(0)
    else:
        workers = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return time.perf_counter() - began


def main() -> None:
    args = setup_arg_parser().parse_args()
    bad = [o for o in args.offsets if not 0 <= o < BOUNDARY]
    if bad:
        raise SystemExit(f"--offsets: {bad[0]} is outside [0, {BOUNDARY})")
    nbytes = args.mib * MiB
    where = allocator_offsets(nbytes)
    area = mmap.mmap(-1, nbytes + 2 * BOUNDARY)
    base = np.frombuffer(area, np.uint8)
    start = -base.ctypes.data % BOUNDARY
    bufs = {o: base[start + o : start + o + nbytes] for o in args.offsets}
    for b in bufs.values():
        b[:] = 1  # mapped before the rounds: the reads copy, nothing faults
    ways = [(o, t) for o in args.offsets for t in (1, 2)]
    times: dict[tuple[int, int], list[float]] = {w: [] for w in ways}
    with tempfile.NamedTemporaryFile(dir=args.dir) as f:
        f.write(os.urandom(nbytes))
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        try:
            read(fd, bufs[args.offsets[0]], 1)  # the page cache warm
            for i in range(args.repeat):
                k = i % len(ways)
                for o, t in ways[k:] + ways[:k]:
                    times[(o, t)].append(read(fd, bufs[o], t))
        finally:
            os.close(fd)
    ref = times[(args.offsets[0], 1)]
    print(f"large allocations start, mod 64: numpy +{where['numpy']}, MLX +{where['MLX']}")
    print(f"\n| offset | threads | ms | GB/s | / offset {args.offsets[0]}, 1 thread |")
    print("|---|---|---|---|---|")
    for o, t in ways:
        ms = statistics.median(times[(o, t)]) * 1e3
        ratio = statistics.median(a / b for a, b in zip(times[(o, t)], ref, strict=True))
        print(f"| {o} | {t} | {ms:.1f} | {nbytes / ms / 1e6:.1f} | {ratio:.2f} |")
    load = os.getloadavg()[0]
    print(f"\n{args.mib} MiB, medians of {args.repeat}; load average (1 min) at end {load:.2f}.")


if __name__ == "__main__":
    main()
