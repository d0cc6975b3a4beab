"""Restore cost against block count: the same prefix at several block sizes.

One model-shaped cache (default: 8 layers, 8 kv heads, head_dim 128, bf16:
32 KiB per token; 4096 tokens = 128 MiB) is stored at each ``--block-sizes``
and restored through ``PrefixCache.fetch``, from the hot tier and from the SSD
tier, alternating with the references, in one run:

  memcpy     the same bytes copied into ONE fresh buffer (numpy ``empty`` +
             ``copyto``: the page faults of fresh memory included), the hot
             restore's reference
  file       ONE file of the same bytes read into ONE fresh buffer
             (``readinto``), the SSD restore's reference

SSD modes: ``warm`` (page cache warm) and ``cold`` (the payload files, and the
reference file, evicted from the page cache before each read: only those files,
so other processes' caches are left alone). Each round runs the fetch and its
reference back to back, in alternating order.

Per block size: the medians of fetch time / reference time (per round) with
their range, the medians of both times, the fixed part of a fetch (its time
minus the reference's), and the median of the fetch's CPU time (this process,
every thread) / the reference's: on a loaded machine wall times follow the
share of the cores a process gets, its CPU time much less. Targets (issue 19):
hot <= 1.2x memcpy + 1 ms, SSD <= 1.5x file, at every block size. The load
average is printed: the ratios are only as steady as the machine.

    python tools/bench_blocks.py [--tokens 4096] [--block-sizes 16 32 64 256] [--repeat 5]
        [--tiers hot ssd] [--modes warm cold]
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
from benchlib import (
    add_chain_args,
    evict,
    minor_faults,
    read_into_fresh,
    shaped_model,
    synthetic_cache,
    tier_config,
)

from prefixcache import PrefixCache

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 32, 64, 256], 5)
    p.add_argument("--dir", default=None, help="parent directory of the SSD tiers")
    p.add_argument("--tiers", nargs="+", default=["hot", "ssd"], choices=["hot", "ssd"])
    p.add_argument("--modes", nargs="+", default=["warm"], choices=["warm", "cold"])
    return p


class Clock:
    """Wall time, this process's CPU time (all its threads) and page faults of a
    block of code."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.faults = minor_faults()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu
        self.faults = minor_faults() - self.faults


def memcpy(source: np.ndarray) -> Clock:
    with Clock() as clock:
        out = np.empty_like(source)
        np.copyto(out, source)
    del out
    return clock


def file_read(path: str, nbytes: int) -> Clock:
    with Clock() as clock:
        out = read_into_fresh(path, nbytes)
    del out
    return clock


def fetch(pc: PrefixCache, probe: list[int]) -> Clock:
    gc.collect()
    with Clock() as clock:
        cache, num = pc.fetch(probe)
        mx.eval([c.state for c in cache])
    assert num == len(probe) - 1, (num, len(probe))
    del cache
    return clock


def payload_files(ssd_dir: str) -> list[str]:
    blocks = os.path.join(ssd_dir, "blocks")
    return [os.path.join(d, f) for d, _, files in os.walk(blocks) for f in files]


def run(args, model, tier: str, mode: str, block_size: int, root: str) -> dict[str, object]:
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    probe = [*tokens, 1]
    cfg = tier_config(tier, block_size, os.path.join(root, f"ssd{block_size}"))
    with PrefixCache(model, cfg, model_id="bench") as pc:
        cache = synthetic_cache(args, args.tokens)
        pc.store(tokens, cache)
        pc.flush()
        nbytes = sum(c.keys[..., : args.tokens, :].nbytes * 2 for c in cache)
        source = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        path = os.path.join(root, "one.file")
        with open(path, "wb") as f:
            f.write(source.tobytes())
        del cache
        files = payload_files(cfg.ssd_path) if tier == "ssd" else []
        cold = mode == "cold"

        def reference() -> Clock:
            if tier == "hot":
                return memcpy(source)
            if cold:
                evict([path])
            return file_read(path, nbytes)

        def restore() -> Clock:
            if cold:
                evict(files)
            return fetch(pc, probe)

        fetch(pc, probe)  # warm: the page cache, MLX's first allocations
        ratios, fixed, fetch_ms, ref_ms, cpu_ratios, faults = [], [], [], [], [], []
        for i in range(args.repeat):
            if i % 2:
                took, ref = restore(), reference()
            else:
                ref, took = reference(), restore()
            ratios.append(took.wall / ref.wall)
            fixed.append((took.wall - ref.wall) * 1e3)
            fetch_ms.append(took.wall * 1e3)
            ref_ms.append(ref.wall * 1e3)
            cpu_ratios.append(took.cpu / max(ref.cpu, 1e-6))
            faults.append((took.faults, ref.faults))
        os.remove(path)
    return {
        "tier": tier,
        "mode": "-" if tier == "hot" else mode,
        "block": block_size,
        "mib": nbytes / MiB,
        "blocks": args.tokens // block_size,
        "fetch_ms": statistics.median(fetch_ms),
        "ref_ms": statistics.median(ref_ms),
        "ratio": statistics.median(ratios),
        "lo": min(ratios),
        "hi": max(ratios),
        "over_ms": statistics.median(fixed),
        "cpu_ratio": statistics.median(cpu_ratios),
        "faults": statistics.median(f for f, _ in faults),
        "ref_faults": statistics.median(r for _, r in faults),
    }


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = shaped_model(args)
    rows = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for tier in args.tiers:
            for mode in args.modes if tier == "ssd" else ["warm"]:
                for block_size in args.block_sizes:
                    row = run(args, model, tier, mode, block_size, root)
                    rows.append(row)
                    print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    print()
    head = ["tier", "mode", "block", "blocks", "MiB", "fetch ms", "ref ms", "fetch / ref"]
    print("| " + " | ".join([*head, "range", "over ms", "cpu / ref cpu", "faults / ref"]) + " |")
    print("|---" * (len(head) + 4) + "|")
    for r in rows:
        print(
            f"| {r['tier']} | {r['mode']} | {r['block']} | {r['blocks']} | {r['mib']:.0f} "
            f"| {r['fetch_ms']:.1f} | {r['ref_ms']:.1f} | {r['ratio']:.2f} "
            f"| {r['lo']:.2f}-{r['hi']:.2f} | {r['over_ms']:.1f} | {r['cpu_ratio']:.2f} "
            f"| {r['faults']:.0f} / {r['ref_faults']:.0f} |"
        )
    end = os.getloadavg()
    print(
        "\nreference: hot = one memcpy into one fresh buffer; ssd = one file read into one;"
        " over = fetch minus reference (medians); faults: page faults of each"
        " (a fresh 2 MiB huge page is one, a fresh 4 KiB page one; pages malloc"
        " recycled none), the medians."
        f"\nload average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f}"
        f" on {os.cpu_count()} cores."
    )


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
