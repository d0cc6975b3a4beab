"""Caller-side cost of ``SsdTier.put`` per block, at several block sizes.

The blocks of one model-shaped chain (default: 8 layers, 8 kv heads, head_dim
128, bf16, 4096 tokens = 128 MiB) are put on a fresh SSD tier, as a spill or a
``write_through`` store does, with the writer thread running (its disk writes
compete for the cores and the GIL, as they do in a server). Per block size, in
microseconds per block on the caller's thread (medians over the rounds of the
per-round medians): ``put`` (a new block: checks, zero-copy byte views,
queueing), ``again`` (a block already indexed: one index read), and the copy
of the block's bytes into fresh memory (``copy``: what cutting the block from
a live cache costs at least), measured in the same rounds.

    python tools/bench_put.py [--block-sizes 16 32 64 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np

from prefixcache import CacheConfig
from prefixcache.blocks import Block
from prefixcache.tiers.ssd.tier import SsdTier


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 256])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None)
    return p


def chain(args, block_size: int, seed: int) -> list[Block]:
    shape = (1, args.kv_heads, block_size, args.head_dim)
    rng = np.random.default_rng(seed)
    parent = root = bytes(16)
    blocks = []
    for i in range(args.tokens // block_size):
        names = [f"{layer}.{kv}" for layer in range(args.layers) for kv in ("keys", "values")]
        arrays = {n: mx.random.normal(shape).astype(mx.bfloat16) for n in names}
        mx.eval(arrays)
        key = rng.bytes(16)
        tokens = np.arange(i * block_size, (i + 1) * block_size, dtype=np.uint32).tobytes()
        blocks.append(Block.make(key, parent, root, i, tokens, arrays))
        parent = key
    return blocks


def one_round(blocks: list[Block], ssd_dir: str) -> dict[str, float]:
    config = CacheConfig(ssd_dir=ssd_dir, ssd_min_free_bytes=0, write_queue_bytes=4 << 30)
    puts, again, copies = [], [], []
    with SsdTier(config) as tier:
        for block in blocks:
            began = time.perf_counter()
            tier.put(block)
            puts.append(time.perf_counter() - began)
            views = [
                np.frombuffer(memoryview(a).cast("B"), np.uint8) for a in block.arrays.values()
            ]
            began = time.perf_counter()
            np.concatenate(views, out=np.empty(block.nbytes, np.uint8))
            copies.append(time.perf_counter() - began)
        tier.flush()
        for block in blocks:
            began = time.perf_counter()
            tier.put(block)
            again.append(time.perf_counter() - began)
    return {
        k: statistics.median(v) * 1e6
        for k, v in (("put", puts), ("again", again), ("copy", copies))
    }


def main() -> None:
    args = setup_arg_parser().parse_args()
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for block_size in args.block_sizes:
            blocks = chain(args, block_size, block_size)
            rounds = [
                one_round(blocks, os.path.join(root, f"{block_size}-{r}"))
                for r in range(args.rounds)
            ]
            row = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            row.update(block=block_size, mib=blocks[0].nbytes / (1 << 20))
            rows.append(row)
            print(
                f"block {block_size}: put {row['put']:.1f} us, again {row['again']:.1f} us, "
                f"copy {row['copy']:.1f} us",
                flush=True,
            )
    print("\n| block | block MiB | put us | put of an indexed block us | copy of its bytes us |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['block']} | {r['mib']:.2f} | {r['put']:.1f} | {r['again']:.1f} "
            f"| {r['copy']:.1f} |"
        )
    end = os.getloadavg()
    print(f"\nload average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f}")


if __name__ == "__main__":
    main()
