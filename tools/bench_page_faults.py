"""Faulting in a restore buffer's 2 MiB regions: small pages, huge pages, collapsed ones.

A restore buffer's end regions hold a page written before any advice (the allocator's
chunk header), and a region where a small page is mapped never takes a huge page on a
fault (``memory/huge_pages.advise_huge``). This writes ``--regions`` 2 MiB regions
of fresh anonymous memory, each with one small page mapped first, four ways:

  small      advised (``MADV_HUGEPAGE``), then written: 511 faults of 4 KiB per region
  populate   advised, ``MADV_POPULATE_WRITE`` (one call), then written
  collapse   ``MADV_COLLAPSE`` of each region (what ``advise_huge`` does), then written
  huge       no small page first: advised, written (one fault per region; the
             reference, as numpy's big buffers)

Prints the medians of this process's CPU time per region (steadier than wall time on a
busy machine) and each way over ``huge``. Linux only; ``collapse`` needs Linux 6.1.

    python tools/bench_page_faults.py [--regions 32] [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time

import numpy as np

HUGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux's values
MADV_COLLAPSE = 25

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--regions", type=int, default=32, help="2 MiB regions written per round")
    p.add_argument("--rounds", type=int, default=7)
    return p


def one(way: str, regions: int) -> float:
    """CPU seconds per region of writing fresh memory the ``way`` given."""
    size = regions * HUGE
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(mem, np.uint8)
    start = view.ctypes.data  # a length of whole regions is mapped aligned (Linux 6.7 on)
    first = -(-start // HUGE) * HUGE
    if way != "huge":
        view[first - start :: HUGE] = 1  # a small page in each region, as a header's
    began = time.process_time()
    if way == "collapse":
        for region in range(first, start + size - HUGE + 1, HUGE):
            _libc.madvise(region, HUGE, MADV_COLLAPSE)
    else:
        _libc.madvise(start, size, mmap.MADV_HUGEPAGE)
    if way == "populate":
        _libc.madvise(start, size, MADV_POPULATE_WRITE)
    view[...] = 2
    took = time.process_time() - began
    del view
    mem.close()
    return took / regions


def main() -> None:
    args = setup_arg_parser().parse_args()
    ways = ["small", "populate", "collapse", "huge"]
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            times[way].append(one(way, args.regions))
    ref = statistics.median(times["huge"])
    print("| way | CPU us per 2 MiB region | / huge |")
    print("|---|---|---|")
    for way in ways:
        median = statistics.median(times[way])
        print(f"| {way} | {median * 1e6:.0f} | {median / ref:.2f} |")


if __name__ == "__main__":
    main()
