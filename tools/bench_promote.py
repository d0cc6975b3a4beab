"""What promotion costs a fetch that hits the SSD tier: ``promote`` on against off.

A model-shaped bf16 cache (``--layers`` x ``--kv-heads`` x ``--head-dim``) of
``--tokens`` tokens is stored on the SSD tier only and flushed. Each round opens
a fresh ``PrefixCache`` (hot tier empty, page cache warm) and times one ``fetch``
of the chain until its arrays are evaluated, with ``promote=False`` and
``promote=True`` in alternating order; with promotion on it then times
``flush()`` (which waits for the promotion under way) and checks that the
chain is in hot. Prints per block size the medians, their range and the
median of per-round ratios on / off.

    python tools/bench_promote.py [--block-sizes 16 64 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import mlx.core as mx
from benchlib import shaped_model, synthetic_cache

from prefixcache import CacheConfig, PrefixCache


def config(args, block_size: int, root: str, promote: bool) -> CacheConfig:
    return CacheConfig(
        block_size=block_size,
        hot_max_bytes=4 << 30,
        promote=promote,
        ssd_dir=root,
        ssd_min_free_bytes=0,
        write_queue_bytes=4 << 30,
        write_policy="write_through",
    )


def one_fetch(args, block_size: int, root: str, promote: bool) -> tuple[float, float, int]:
    """Seconds of the fetch, seconds of the flush after it, blocks in hot after."""
    tokens = [*range(args.tokens), 1]
    with PrefixCache(args.model, config(args, block_size, root, promote), model_id="b") as pc:
        gc.collect()
        start = time.perf_counter()
        cache, n = pc.fetch(tokens)
        mx.eval([c.state for c in cache])
        fetched = time.perf_counter() - start
        assert n == args.tokens, n
        pc.flush()
        flushed = time.perf_counter() - start - fetched
        in_hot = pc.stats()["hot"]["num_blocks"]
        del cache
    return fetched, flushed, in_hot


def run(args, block_size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_promote_") as root:
        return rounds(args, block_size, root)


def rounds(args, block_size: int, root: str) -> dict:
    with PrefixCache(args.model, config(args, block_size, root, False), model_id="b") as pc:
        pc.store(list(range(args.tokens)), synthetic_cache(args, args.tokens))
        pc.flush()
    off, on, flush, ratios, in_hot = [], [], [], [], 0
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {p: one_fetch(args, block_size, root, p) for p in order}
        off.append(got[False][0])
        on.append(got[True][0])
        flush.append(got[True][1])
        ratios.append(got[True][0] / got[False][0])
        in_hot = got[True][2]
    return {"off": off, "on": on, "flush": flush, "ratio": ratios, "in_hot": in_hot}


def ms(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    args.model = shaped_model(args)
    mib = args.tokens * args.layers * 2 * args.kv_heads * args.head_dim * 2 / (1 << 20)
    print(f"{args.tokens} tokens, {mib:.0f} MiB, {args.layers} layers, {args.rounds} rounds")
    head = ["block", "fetch ms, promote off", "fetch ms, promote on", "on / off"]
    print("| " + " | ".join([*head, "flush after ms", "blocks in hot after"]) + " |")
    print("|---|---|---|---|---|---|")
    for block_size in args.block_sizes:
        got = run(args, block_size)
        ratio = statistics.median(got["ratio"])
        spread = f"{min(got['ratio']):.2f}-{max(got['ratio']):.2f}"
        row = [str(block_size), ms(got["off"]), ms(got["on"]), f"{ratio:.2f} ({spread})"]
        print("| " + " | ".join([*row, ms(got["flush"]), str(got["in_hot"])]) + " |", flush=True)


if __name__ == "__main__":
    main()
