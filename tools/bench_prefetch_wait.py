"""What prefetch takes off a request's path, and what it costs a CPU-bound wait.

One model-shaped chain (default: 4 layers, 8 kv heads, head_dim 128, bf16;
2048 tokens = 32 MiB, block 64) lives only on the lower tier (``--tier ssd``:
the SSD tier, its files dropped from the page cache before each round;
``--tier remote``: a redis-server the tool starts, hot + remote only). Each
round opens a fresh cache (hot empty) and times, alternating:

  cold       ``fetch`` straight away: the restore a request pays today
  idle       ``prefetch``, then the request waits ``--wait-ms`` without using
             the CPU (as on a GPU or Metal host, where the prefill it queues
             behind runs on the accelerator), then ``fetch``
  busy       ``prefetch``, then the wait is CPU work (MLX matmuls on the
             calling thread: a CPU prefill it queues behind), then ``fetch``;
             the work's own time is compared with the same work run alone

Prints medians: fetch ms per mode, the idle fetch / cold fetch ratio, and the
busy work's slowdown (what the background load took from the CPU-bound wait).

    python tools/bench_prefetch_wait.py --tier ssd
    python tools/bench_prefetch_wait.py --tier remote
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_blocks import fetch
from bench_prefetch import _redis
from benchlib import drop_caches, shaped_model, synthetic_cache

from prefixcache import CacheConfig, PrefixCache


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tier", choices=("ssd", "remote"), default="ssd")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--wait-ms", type=float, default=0, help="0: 1.5x the first cold fetch")
    p.add_argument("--rounds", type=int, default=5)
    return p


def config(args, root: Path, url: str | None) -> CacheConfig:
    if url is not None:
        return CacheConfig(
            block_size=args.block_size, hot_cache_only=True, remote_url=url, hot_max_bytes=1 << 30
        )
    return CacheConfig(
        block_size=args.block_size,
        hot_max_bytes=1 << 30,
        ssd_dir=str(root / "ssd"),
        ssd_min_free_bytes=0,
        write_queue_bytes=1 << 30,
    )


def work(seconds: float, a: mx.array) -> float:
    """MLX matmuls on this thread for about ``seconds`` (calibrated alone); returns its time."""
    began = time.perf_counter()
    for _ in range(max(1, round(seconds / work.unit))):
        mx.eval(a @ a)
    return time.perf_counter() - began


def one(args, model, root: Path, url: str | None, mode: str, wait: float, a) -> tuple[float, float]:
    if url is None:
        drop_caches([str(p) for p in (root / "ssd").rglob("*") if p.is_file()], level=1)
    probe = [*range(args.tokens), 1]
    with PrefixCache(model, config(args, root, url), model_id="bench") as pc:
        spent = 0.0
        if mode != "cold":
            pc.prefetch(probe)
            if mode == "idle":
                time.sleep(wait)
            else:
                spent = work(wait, a)
        return fetch(pc, probe).wall, spent


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = shaped_model(args)
    a = mx.random.normal((512, 512))
    began = time.perf_counter()
    for _ in range(20):
        mx.eval(a @ a)
    work.unit = (time.perf_counter() - began) / 20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis: subprocess.Popen | None = None
        url = None
        if args.tier == "remote":
            redis, url = _redis(root)
        try:
            with PrefixCache(model, config(args, root, url), model_id="bench") as pc:
                pc.store(list(range(args.tokens)), synthetic_cache(args, args.tokens))
                pc.flush()
            first, _ = one(args, model, root, url, "cold", 0, a)
            wait = args.wait_ms / 1e3 or 1.5 * first
            times: dict[str, list[float]] = {"cold": [], "idle": [], "busy": []}
            alone, busy_work = [], []
            for _ in range(args.rounds):
                for mode in times:
                    took, spent = one(args, model, root, url, mode, wait, a)
                    times[mode].append(took)
                    if mode == "busy":
                        busy_work.append(spent)
                alone.append(work(wait, a))
        finally:
            if redis is not None:
                redis.terminate()
                redis.wait()
    _report(args, times, wait, alone, busy_work)


def _report(args, times, wait, alone, busy_work) -> None:
    mib = args.tokens * args.layers * 2 * args.kv_heads * args.head_dim * 2 / (1 << 20)
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    print(
        f"{args.tier}: {args.tokens} tokens, {mib:.0f} MiB, block {args.block_size}, "
        f"wait {wait * 1e3:.0f} ms, {args.rounds} rounds, load {os.getloadavg()}"
    )
    print("| mode | fetch ms (median) | range |")
    print("|---|---|---|")
    for m, v in times.items():
        print(f"| {m} | {med[m]:.1f} | {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} |")
    ratio = np.median([i / c for i, c in zip(times["idle"], times["cold"], strict=True)])
    slow = statistics.median(busy_work) / statistics.median(alone)
    print(f"\nidle wait: fetch after prefetch / cold fetch {ratio:.2f}")
    print(f"busy wait: fetch {med['busy']:.1f} ms; the wait's CPU work {slow:.2f}x its time alone")


if __name__ == "__main__":
    main()
