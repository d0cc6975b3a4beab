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
  gather   per layer and K/V: a fresh buffer made as a restore makes its own
           (``restore_buffers.empty``, huge pages asked for), and ONE
           ``np.concatenate`` of the blocks' arrays into it (numpy copies the
           pieces, releasing the GIL)
  gather2  the same, the buffers split between two threads

Rounds run the ways back to back in rotating order; medians of per-round
times and ratios, and of each way's page faults. malloc hands freed pages
back to the next allocation of a like size (MLX's buffers too), and a buffer
of recycled pages costs far less to fill than fresh ones (128 MiB on two
threads: 14 ms with 17 faults, against 24-30 ms with about a thousand), so
the faults tell which way wrote fresh memory in a run.
"best / target": per round, the faster gather over 1.2 x memcpy + 1 ms (the
issue's target); over 1 would show the target out of reach at that block size
whatever runs around the copies.

With ``--fetch``, ``PrefixCache.fetch`` of a hot-only cache holding a chain of
the same shape and block size joins the same rounds: the fetch against the
memcpy, the target and the faster gather, measured in one run.

With ``--packed``, two more ways show what a hot tier keeping each block's
layers as ONE array, and a restore making ONE buffer for every layer, would
cost (a storage layout the package does not have; issue 19's small-head
models): ``packed`` one ``np.concatenate`` of the packed blocks into one
(2 x layers, heads, tokens, dim) buffer, ``packed2`` the same split by layers
between two threads. Rows add packed / memcpy and the faster of the two over
the target.

    python tools/bench_hot_bound.py [--block-sizes 16 32 64 256] [--repeat 15] [--fetch]
        [--packed] [--mx-cache-limit 4G]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial

import mlx.core as mx
import numpy as np
from benchlib import (
    add_chain_args,
    chain_fetch,
    minor_faults,
    restore_like_buffers,
    shaped_model,
)

from prefixcache.config import parse_bytes

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


def gather(parts: list[list[np.ndarray]], out: list[np.ndarray], which: range) -> None:
    for i in which:
        np.concatenate(parts[i], axis=2, out=out[i])


def fresh(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    """A buffer per layer and K/V, made as a restore makes its own (the allocation is
    timed, as a fetch pays it)."""
    return restore_like_buffers(
        [(1, p[0].shape[1], sum(b.shape[2] for b in p), p[0].shape[3]) for p in parts]
    )


def packed_blocks(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The same blocks with every layer's K/V in one array: (2 x layers, heads, bs, dim)."""
    return [np.concatenate([p[i] for p in parts], axis=0) for i in range(len(parts[0]))]


def gather_packed(packed: list[np.ndarray], threads: int) -> None:
    """ONE buffer for every layer and K/V, filled by one concatenate per thread (the
    layers split between ``threads``)."""
    n, h, _, d = packed[0].shape
    out = restore_like_buffers([(n, h, sum(b.shape[2] for b in packed), d)])[0]
    cuts = [n * k // threads for k in range(threads + 1)]

    def part(lo: int, hi: int) -> None:
        np.concatenate([b[lo:hi] for b in packed], axis=2, out=out[lo:hi])

    others = [threading.Thread(target=part, args=cuts[k : k + 2]) for k in range(1, threads)]
    for t in others:
        t.start()
    part(cuts[0], cuts[1])
    for t in others:
        t.join()


def memcpy(source: np.ndarray) -> None:
    out = np.empty_like(source)
    np.copyto(out, source)


def gather_on(parts: list[list[np.ndarray]], threads: int) -> None:
    """Every buffer made, then gathered, the buffers dealt among ``threads`` threads."""
    out = fresh(parts)
    others = [
        threading.Thread(target=gather, args=(parts, out, range(k, len(parts), threads)))
        for k in range(1, threads)
    ]
    for t in others:
        t.start()
    gather(parts, out, range(0, len(parts), threads))
    for t in others:
        t.join()


def timed(fn) -> tuple[float, int]:
    """(seconds, page faults) of ``fn()``."""
    faults, start = minor_faults(), time.perf_counter()
    fn()
    return time.perf_counter() - start, minor_faults() - faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 32, 64, 256], 15)
    p.add_argument("--fetch", action="store_true", help="time PrefixCache.fetch in the rounds")
    p.add_argument("--packed", action="store_true", help="time gathers of packed blocks")
    p.add_argument("--mx-cache-limit", type=parse_bytes, help="MLX's buffer cache limit, e.g. 4G")
    args = p.parse_args()
    if args.mx_cache_limit is not None:
        mx.set_cache_limit(args.mx_cache_limit)
    args.model = shaped_model(args) if args.fetch else None
    nbytes = 2 * args.layers * args.kv_heads * args.tokens * args.head_dim * 2
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    print(f"chain: {args.tokens} tokens, {nbytes / MiB:.0f} MiB; medians of {args.repeat} rounds")
    extra = "  fetch ms  fetch / memcpy  fetch / target  fetch / best gather" if args.fetch else ""
    print("block  memcpy ms  gather ms  gather2 ms  gather / memcpy  best / target" + extra)
    for bs in args.block_sizes:
        parts = blocks(args, bs)

        fns = [
            ("memcpy", partial(memcpy, source)),
            ("gather", partial(gather_on, parts, 1)),
            ("gather2", partial(gather_on, parts, 2)),
        ]
        if args.packed:
            packed = packed_blocks(parts)
            fns += [(f"packed{t}", partial(gather_packed, packed, t)) for t in (1, 2)]
        pc, fetch = chain_fetch(args.model, args, "hot", bs) if args.fetch else (None, None)
        if fetch is not None:
            fns.append(("fetch", fetch))
        runs: dict[str, list[float]] = {name: [] for name, _ in fns}
        faults: dict[str, list[int]] = {name: [] for name, _ in fns}
        try:
            for r in range(args.repeat + 1):
                for name, fn in fns[r % len(fns) :] + fns[: r % len(fns)]:
                    took, faulted = timed(fn)
                    if r:  # the first round warms up
                        runs[name].append(took)
                        faults[name].append(faulted)
        finally:
            if pc is not None:
                pc.close()
        ref = [statistics.median(runs[k]) * 1e3 for k in runs]
        best = statistics.median(
            min(g, h) / (1.2 * m + 1e-3)
            for m, g, h in zip(runs["memcpy"], runs["gather"], runs["gather2"], strict=True)
        )
        ratio = statistics.median(
            g / m for m, g in zip(runs["memcpy"], runs["gather"], strict=True)
        )
        row = f"{bs:5d}  {ref[0]:9.1f}  {ref[1]:9.1f}  {ref[2]:10.1f}  {ratio:15.2f}  {best:13.2f}"
        if fetch is not None:
            ways = (runs["fetch"], runs["memcpy"], runs["gather"], runs["gather2"])
            per_round = list(zip(*ways, strict=True))
            over_copy = statistics.median(f / m for f, m, _, _ in per_round)
            over_target = statistics.median(f / (1.2 * m + 1e-3) for f, m, _, _ in per_round)
            over_gather = statistics.median(f / min(g, h) for f, _, g, h in per_round)
            fetch_ms = statistics.median(runs["fetch"]) * 1e3
            row += f"  {fetch_ms:8.1f}  {over_copy:13.2f}  {over_target:14.2f}  {over_gather:19.2f}"
        if args.packed:
            rounds = list(zip(runs["memcpy"], runs["packed1"], runs["packed2"], strict=True))
            packed_copy = statistics.median(p / m for m, p, _ in rounds)
            packed_best = statistics.median(min(p, q) / (1.2 * m + 1e-3) for m, p, q in rounds)
            row += f"  packed / memcpy {packed_copy:.2f}  best packed / target {packed_best:.2f}"
        print(row, flush=True)
        print("       page faults (medians): " + ", ".join(
            f"{k} {statistics.median(v):.0f}" for k, v in faults.items()
        ))  # fmt: skip


if __name__ == "__main__":
    main()
