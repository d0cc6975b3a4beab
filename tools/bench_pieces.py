"""Copy speed against piece size: why a hot restore of small heads is slower than one copy.

A hot restore writes each block's rows of each (layer, K/V, head) into place: pieces of
``block_size x head_dim x 2`` bytes (bf16), 2 KiB for a 64-dim head at block 16. This
copies the same bytes (128 MiB) in pieces of each ``--sizes`` (one numpy call: a source
of pieces one after another into every other piece of a destination twice as large),
and as ONE flat copy, into memory already touched (no page faults), in rotating order.
Prints the medians of this thread's CPU time (steadier than wall time on a busy
machine) and each piece size over the flat copy.

    python tools/bench_pieces.py [--sizes 1024 2048 4096 8192 32768] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768])
    p.add_argument("--mib", type=int, default=128, help="bytes copied, in MiB")
    p.add_argument("--rounds", type=int, default=9)
    return p


def cpu_ms(fn) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3


def main() -> None:
    args = setup_arg_parser().parse_args()
    n = args.mib * MiB
    src, dst = np.ones(n, np.uint8), np.ones(2 * n, np.uint8)  # touched: no faults
    ways = {"flat": lambda: np.copyto(dst[:n], src)}
    for size in args.sizes:
        pieces = src.reshape(n // size, size)
        into = dst.reshape(n // size, 2, size)[:, 0]  # every other piece: one call, strided
        ways[f"{size} B"] = lambda into=into, pieces=pieces: np.copyto(into, pieces)
    load = os.getloadavg()
    runs: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for i in range(args.rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            runs[name].append(cpu_ms(ways[name]))
    flat = statistics.median(runs["flat"])
    print(f"{args.mib} MiB, medians of {args.rounds} rounds (thread CPU time)")
    for name, times in runs.items():
        ms = statistics.median(times)
        print(f"  {name:>8s}  {ms:7.1f} ms  {ms / flat:.2f}x")
    end = os.getloadavg()
    print(f"load average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f} on {os.cpu_count()}")


if __name__ == "__main__":
    main()
