"""Restore cost against block count: the same prefix at several block sizes.

One model-shaped cache (default: 8 layers, 8 kv heads, head_dim 128, bf16:
32 KiB per token; 4096 tokens = 128 MiB) is stored at each ``--block-sizes``
and restored through ``PrefixCache.fetch``, from the hot tier and from the SSD
tier (page cache warm), alternating with the references, in one run:

  memcpy     the same bytes copied into ONE fresh buffer (numpy ``empty`` +
             ``copyto``: the page faults of fresh memory included), the hot
             restore's reference
  file       ONE file of the same bytes read into ONE fresh buffer
             (``readinto``), the SSD restore's reference

Per block size: the medians of fetch time / reference time (per round), and the
fixed part of a hot fetch (its time minus the memcpy's). Targets (issue 19): hot
<= 1.2x memcpy + 1 ms, SSD <= 1.5x file, at every block size.

    python tools/bench_blocks.py [--tokens 4096] [--block-sizes 16 32 64 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
from benchlib import shaped_model, synthetic_cache

from prefixcache import CacheConfig, PrefixCache

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 256])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="parent directory of the SSD tiers")
    p.add_argument("--tiers", nargs="+", default=["hot", "ssd"], choices=["hot", "ssd"])
    return p


def memcpy(source: np.ndarray) -> float:
    began = time.perf_counter()
    out = np.empty_like(source)
    np.copyto(out, source)
    took = time.perf_counter() - began
    del out
    return took


def file_read(path: str, nbytes: int) -> float:
    began = time.perf_counter()
    out = np.empty(nbytes, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(out))
    took = time.perf_counter() - began
    del out
    return took


def fetch(pc: PrefixCache, probe: list[int]) -> float:
    gc.collect()
    began = time.perf_counter()
    cache, _ = pc.fetch(probe)
    mx.eval([c.state for c in cache])
    took = time.perf_counter() - began
    del cache
    return took


def config(args, block_size: int, tier: str, root: str) -> CacheConfig:
    if tier == "hot":
        return CacheConfig(block_size=block_size, hot_cache_only=True, hot_max_bytes=64 << 30)
    return CacheConfig(
        block_size=block_size,
        hot_max_bytes=1,
        promote=False,
        ssd_dir=os.path.join(root, f"ssd{block_size}"),
        ssd_min_free_bytes=0,
        write_queue_bytes=1 << 30,
    )


def run(args, model, tier: str, block_size: int, root: str) -> dict[str, float]:
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    probe = [*tokens, 1]
    with PrefixCache(model, config(args, block_size, tier, root), model_id="bench") as pc:
        cache = synthetic_cache(args, args.tokens)
        pc.store(tokens, cache)
        pc.flush()
        nbytes = sum(c.keys[..., : args.tokens, :].nbytes * 2 for c in cache)
        source = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        path = os.path.join(root, "one.file")
        with open(path, "wb") as f:
            f.write(source.tobytes())
        del cache
        fetch(pc, probe)  # warm: the page cache, MLX's first allocations
        ratios, fixed, fetch_ms = [], [], []
        for _ in range(args.repeat):
            ref = memcpy(source) if tier == "hot" else file_read(path, nbytes)
            took = fetch(pc, probe)
            ratios.append(took / ref)
            fixed.append((took - ref) * 1e3)
            fetch_ms.append(took * 1e3)
        os.remove(path)
    return {
        "tier": tier,
        "block": block_size,
        "mib": nbytes / MiB,
        "blocks": args.tokens // block_size,
        "fetch_ms": statistics.median(fetch_ms),
        "ratio": statistics.median(ratios),
        "lo": min(ratios),
        "hi": max(ratios),
        "over_ms": statistics.median(fixed),
    }


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = shaped_model(args)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for tier in args.tiers:
            for block_size in args.block_sizes:
                row = run(args, model, tier, block_size, root)
                rows.append(row)
                print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    print()
    print("| tier | block | blocks | MiB | fetch ms | fetch / reference | range | over ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tier']} | {r['block']} | {r['blocks']} | {r['mib']:.0f} | {r['fetch_ms']:.1f} "
            f"| {r['ratio']:.2f} | {r['lo']:.2f}-{r['hi']:.2f} | {r['over_ms']:.1f} |"
        )
    print(
        "\nreference: hot = one memcpy into one fresh buffer; ssd = one file read into one;"
        " over = fetch minus reference (medians)."
    )


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
