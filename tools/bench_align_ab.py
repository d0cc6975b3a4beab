"""SSD fetches with payload data and restore buffers on a 64-byte boundary, against not.

The kernel's copy of a warm read runs at about half speed where the destination
lies at another offset from a 64-byte boundary than the file's bytes
(tools/bench_read_align.py). A payload's data starts on one
(``payload.DATA_ALIGN``) and a restore buffer is used from its first element on one
(``restore_buffers.ALIGN``). This stores each preset's chain (tools/shapes.py) twice
in one process, once as now and once with both at 8 bytes (headers padded to 8, as
files were written before; buffers where MLX puts them), and fetches the two in turn
(hot empty, no promotion, MLX keeping freed buffers, ``--mx-cache-limit``), each mode
set before its fetch. Printed per shape and block: the median fetch ms of each and
the median paired ratio (aligned / 8 bytes) with its range.

    python tools/bench_align_ab.py [--shape all] [--blocks 16,256] [--repeat 11]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile

import mlx.core as mx
from bench_blocks import fetch
from benchlib import tier_config
from shapes import model_for, named, stored_chain

from prefixcache import PrefixCache
from prefixcache.memory import restore_buffers
from prefixcache.tiers.ssd import payload

ALIGNED, BEFORE = 64, 8


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["all"], help="presets, or all")
    p.add_argument("--blocks", default="16,256", help="block sizes, comma separated")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=11)
    p.add_argument("--mx-cache-limit", type=float, default=4.0, help="GiB of freed buffers kept")
    return p


def align(nbytes: int) -> None:
    payload.DATA_ALIGN = restore_buffers.ALIGN = nbytes


def run(args, shape, model, block_size: int, root: str) -> dict[str, object]:
    caches, probe = {}, None
    for mode in (BEFORE, ALIGNED):
        align(mode)
        cfg = tier_config("ssd", block_size, os.path.join(root, f"{block_size}-{mode}"))
        caches[mode] = pc = PrefixCache(model, cfg, model_id="bench")
        probe, _ = stored_chain(pc, shape, model, args.tokens)
        fetch(pc, probe)  # warm: the page cache, MLX's first allocations
    times: dict[int, list[float]] = {BEFORE: [], ALIGNED: []}
    try:
        for i in range(args.repeat):
            for mode in (BEFORE, ALIGNED) if i % 2 else (ALIGNED, BEFORE):
                align(mode)
                times[mode].append(fetch(caches[mode], probe).wall * 1e3)
    finally:
        align(ALIGNED)
        for pc in caches.values():
            pc.close()
    ratios = [a / b for a, b in zip(times[ALIGNED], times[BEFORE], strict=True)]
    return {
        "shape": shape.name,
        "block": block_size,
        "before_ms": statistics.median(times[BEFORE]),
        "aligned_ms": statistics.median(times[ALIGNED]),
        "ratio": statistics.median(ratios),
        "lo": min(ratios),
        "hi": max(ratios),
    }


def main() -> None:
    args = setup_arg_parser().parse_args()
    mx.set_cache_limit(int(args.mx_cache_limit * (1 << 30)))
    try:
        shapes = named(args.shape)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    blocks = [int(b) for b in args.blocks.split(",")]
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for shape in shapes:
            model = model_for(shape)
            for block_size in blocks:
                rows.append(run(args, shape, model, block_size, root))
                print(rows[-1], flush=True)
            del model
            gc.collect()
            mx.clear_cache()
    print("\n| shape | block | 8 bytes ms | aligned ms | aligned / 8 bytes (range) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['block']} | {r['before_ms']:.1f} | {r['aligned_ms']:.1f} "
            f"| {r['ratio']:.3f} ({r['lo']:.2f}-{r['hi']:.2f}) |"
        )
    end = os.getloadavg()[0]
    print(f"\nmedians of {args.repeat} paired rounds; load average {load:.2f} -> {end:.2f}.")


if __name__ == "__main__":
    main()
