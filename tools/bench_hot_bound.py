"""The least a hot restore of many small blocks can cost, against one copy of its bytes.

Issue 19's hot target: a restore of a chain from the hot tier within 1.2x one
memcpy of its bytes into a fresh buffer, plus 1 ms, at every block size. The
hot tier keeps each block's tensors as arrays of their own (one per layer and
K/V, so a block is freed on its own), and mlx-lm's cache wants one
(1, heads, tokens, dim) buffer per layer and K/V: a restore gathers every
block's rows into place, 2 x layers x heads pieces of ``bs x dim`` elements per
block. This measures that gather with no prefixcache code, for the same 128 MiB
chain as ``tools/bench_blocks.py`` (8 layers, 8 KV heads, head_dim 128, bf16):

  memcpy   the reference: the chain's bytes copied into ONE fresh buffer
           (numpy ``empty`` + ``copyto``), as bench_blocks measures it
  gather   per layer and K/V: a fresh buffer and ONE ``np.concatenate`` of the
           blocks' arrays into it (numpy copies the pieces, releasing the GIL)
  gather2  the same, the buffers split between two threads

Rounds run the three back to back in rotating order; medians of per-round
times and ratios. The gathers' buffers come from numpy (8 MiB each, recycled by
malloc between rounds); a restore's come from MLX with huge pages asked for, so
``fetch`` can beat the one-thread column (bench_blocks: 40-43 ms at block 16).
"best / target": per round, the faster gather over 1.2 x memcpy + 1 ms (the
issue's target); over 1 would show the target out of reach at that block size
whatever runs around the copies.

    python tools/bench_hot_bound.py [--block-sizes 16 32 64 256] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial

import numpy as np
from benchlib import add_chain_args

MiB = 1 << 20


def blocks(args, bs: int) -> list[list[np.ndarray]]:
    """Per layer and K/V, the chain's blocks: (1, heads, bs, dim) bf16 as uint16."""
    rng = np.random.default_rng(bs)
    shape = (1, args.kv_heads, bs, args.head_dim)
    n = args.tokens // bs
    return [
        [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for _ in range(n)]
        for _ in range(2 * args.layers)
    ]


def gather(parts: list[list[np.ndarray]], out: list[np.ndarray | None], which: range) -> None:
    for i in which:
        first = parts[i][0]
        dest = np.empty((1, first.shape[1], sum(p.shape[2] for p in parts[i]), first.shape[3]),
                        first.dtype)  # fmt: skip
        np.concatenate(parts[i], axis=2, out=dest)
        out[i] = dest


def memcpy(source: np.ndarray) -> None:
    out = np.empty_like(source)
    np.copyto(out, source)


def gather_on(parts: list[list[np.ndarray]], threads: int) -> None:
    """Every buffer gathered, the buffers dealt among ``threads`` threads."""
    out: list[np.ndarray | None] = [None] * len(parts)
    others = [
        threading.Thread(target=gather, args=(parts, out, range(k, len(parts), threads)))
        for k in range(1, threads)
    ]
    for t in others:
        t.start()
    gather(parts, out, range(0, len(parts), threads))
    for t in others:
        t.join()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 32, 64, 256], 15)
    args = p.parse_args()
    nbytes = 2 * args.layers * args.kv_heads * args.tokens * args.head_dim * 2
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    print(f"chain: {args.tokens} tokens, {nbytes / MiB:.0f} MiB; medians of {args.repeat} rounds")
    print("block  memcpy ms  gather ms  gather2 ms  gather / memcpy  best / target")
    for bs in args.block_sizes:
        parts = blocks(args, bs)

        fns = [
            ("memcpy", partial(memcpy, source)),
            ("gather", partial(gather_on, parts, 1)),
            ("gather2", partial(gather_on, parts, 2)),
        ]
        runs: dict[str, list[float]] = {name: [] for name, _ in fns}
        for r in range(args.repeat + 1):
            for name, fn in fns[r % 3 :] + fns[: r % 3]:
                took = timed(fn)
                if r:  # the first round warms up
                    runs[name].append(took)
        ref = [statistics.median(runs[k]) * 1e3 for k in runs]
        best = statistics.median(
            min(g, h) / (1.2 * m + 1e-3)
            for m, g, h in zip(runs["memcpy"], runs["gather"], runs["gather2"], strict=True)
        )
        ratio = statistics.median(
            g / m for m, g in zip(runs["memcpy"], runs["gather"], strict=True)
        )
        print(f"{bs:5d}  {ref[0]:9.1f}  {ref[1]:9.1f}  {ref[2]:10.1f}  {ratio:15.2f}  {best:13.2f}")


if __name__ == "__main__":
    main()
