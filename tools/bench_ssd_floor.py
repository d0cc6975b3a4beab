"""What a verified SSD restore costs at least, against a read into memory already mapped.

A fetch's restore buffers mostly land in memory MLX recycled from an earlier
restore, pages already mapped (bench_blocks' fault column: 34-66 faults for
512 MiB). The fair reference is then a read into a buffer kept across rounds
(``bench_blocks --kept-ref``), not into a fresh one, whose page faults and
zeroing can make it 2-3x slower. Against that reference, with no prefixcache
code, warm (page cache), every restore writing into buffers kept across rounds
(made once as a fetch makes its own: ``benchlib.restore_like_buffers``):

  read         the reference: ONE file of the chain's bytes read into ONE buffer
  read+hash    the same, then one xxh3 pass over it: verification alone, no scatter
  block files  one file per block (a header, then 2 x layers tensors of
               (1, heads, bs, dim)) read straight into place, one ``readv`` per file
               with an iovec per tensor and head (pieces of bs x dim x 2 bytes), xxh3
               streamed over the placed rows: the least a restore of one verified
               file per block in mlx-lm's (B, heads, tokens, dim) layout does
  run files    the same with one file per ``--run-tokens`` tokens (a run of blocks
               laid out as one block of that size): pieces of run x dim x 2 bytes
  fetch        (``--fetch``) ``PrefixCache.fetch`` of the same chain from the SSD tier

Restores run on ``--threads`` threads (each a contiguous share of the files),
the best thread count kept. Each round runs every way back to back, in rotating
order; the table gives medians of the per-round ratios to ``read``, wall time and
(in brackets) CPU time of this process, every thread.

    python tools/bench_ssd_floor.py [--layers 32 --kv-heads 8 --head-dim 128]
        [--block-sizes 16 32 64 256] [--run-tokens 256] [--fetch]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile

import numpy as np
import xxhash
from bench_ssd_bound import place_files, timed, write_chain, write_random
from benchlib import (
    add_chain_args,
    chain_fetch,
    read_fresh,
    restore_like_buffers,
    shaped_model,
)

MiB = 1 << 20


def read_kept(ref: str, buf: np.ndarray, hashed: bool) -> None:
    with open(ref, "rb", buffering=0) as f:
        f.readinto(memoryview(buf))
    if hashed:
        xxhash.xxh3_64_intdigest(memoryview(buf))


def ways_for(ref, kept, bufs, blocks, runs, args, bs, fetch) -> dict:
    ways = {
        "read": lambda: read_kept(ref, kept, False),
        "read+hash": lambda: read_kept(ref, kept, True),
    }
    for n in args.threads:
        ways[f"block files/{n}"] = lambda n=n: place_files(blocks, bufs, args, bs, n)
        ways[f"run files/{n}"] = lambda n=n: place_files(
            runs, bufs, args, max(bs, args.run_tokens), n
        )
    if fetch is not None:
        ways["fetch"] = fetch
    return ways


def measure(ways: dict, repeat: int) -> dict[str, tuple[float, float, float]]:
    """Per way: median wall ms, median wall / read, median CPU / read's CPU."""
    names = list(ways)
    walls: dict[str, list[float]] = {k: [] for k in names}
    cpus: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, cpu = timed(ways[name])
            walls[name].append(wall)
            cpus[name].append(cpu)
    out = {}
    for k in names:
        ratio = statistics.median(w / f for w, f in zip(walls[k], walls["read"], strict=True))
        cpu = statistics.median(cpus[k]) / max(statistics.median(cpus["read"]), 1e-9)
        out[k] = (statistics.median(walls[k]) * 1e3, ratio, cpu)
    return out


def best(got: dict, prefix: str) -> str:
    """The way of ``prefix`` with the lowest median ratio, as 'ratio (cpu) [threads]'."""
    k = min((k for k in got if k.startswith(prefix)), key=lambda k: got[k][1])
    return f"{got[k][1]:.2f} ({got[k][2]:.2f}) [{k.rpartition('/')[2]}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 32, 64, 256], 7)
    cores = os.cpu_count() or 2
    p.add_argument("--threads", type=int, nargs="+", default=[1, cores, cores + 1])
    p.add_argument("--run-tokens", type=int, default=256)
    p.add_argument("--dir", default=None)
    p.add_argument("--fetch", action="store_true", help="time PrefixCache.fetch in the rounds")
    args = p.parse_args()
    model = shaped_model(args) if args.fetch else None
    nbytes = 2 * args.layers * args.kv_heads * args.tokens * args.head_dim * 2
    print(
        f"{nbytes / MiB:.0f} MiB chain ({args.layers} x {args.kv_heads} x {args.head_dim}), "
        f"warm; load average {os.getloadavg()[0]:.2f} on {cores} cores"
    )
    print(
        "| block | read ms | read+hash / read | block files / read | run files "
        f"({args.run_tokens} tokens) / read |" + (" fetch / read |" if args.fetch else "")
    )
    print("|---" * (5 + args.fetch) + "|")
    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    bufs = restore_like_buffers([shape] * (2 * args.layers))
    for buf in bufs:
        buf.fill(1)  # mapped once, kept: as MLX's recycled restore buffers are
    kept = np.ones(nbytes, np.uint8)
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        ref = os.path.join(work, "one")
        write_random(ref, nbytes)
        for bs in args.block_sizes:
            sub = os.path.join(work, f"b{bs}")
            os.makedirs(os.path.join(sub, "runs"))
            blocks = write_chain(sub, args, bs)
            runs = write_chain(os.path.join(sub, "runs"), args, max(bs, args.run_tokens))
            read_fresh([ref, *blocks, *runs])  # into the page cache
            pc, fetch = None, None
            if args.fetch:
                pc, fetch = chain_fetch(model, args, "ssd", bs, os.path.join(sub, "ssd"))
                fetch()  # MLX's first allocations
            try:
                got = measure(ways_for(ref, kept, bufs, blocks, runs, args, bs, fetch), args.repeat)
            finally:
                if pc is not None:
                    pc.close()
            row = (
                f"| {bs} | {got['read'][0]:.1f} | {got['read+hash'][1]:.2f} "
                f"({got['read+hash'][2]:.2f}) | {best(got, 'block files')} "
                f"| {best(got, 'run files')} |"
            )
            if args.fetch:
                row += f" {got['fetch'][1]:.2f} ({got['fetch'][2]:.2f}) |"
            print(row, flush=True)
            shutil.rmtree(sub)
    print("ratio (cpu ratio) [threads]; target: a restore <= 1.5x the read (issue 42)")


if __name__ == "__main__":
    main()
