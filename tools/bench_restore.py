"""Hot-tier restore benchmark: fetch vs a plain copy of the same bytes, peak memory.

Builds a model-shaped cache (default: 32 layers, 8 kv heads, head_dim 128, bf16)
synthetically, stores it, and measures in one run:
  - a plain copy of the same bytes into fresh buffers (the reference),
  - PrefixCache.fetch from the hot tier (time, throughput, peak memory, and the
    resident memory a fetch held adds),
  - a naive rebuild (concatenate blocks at exact length, then append one token),
  - hash + lookup cost per token (PrefixCache.match).

    python tools/bench_restore.py --tokens 4096 8192 16384
"""

from __future__ import annotations

import argparse
import functools
import gc
import time

import mlx.core as mx
import numpy as np
from benchlib import shaped_model, synthetic_cache
from mlx_lm.models.cache import KVCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory import give_back

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--run-tokens", type=int, default=0, help="hot_run_tokens (0: per block)")
    return p


def timed(fn, repeat: int) -> tuple[float, float]:
    """Best wall time of ``fn`` and its peak memory above the start, in bytes."""
    best, peak = float("inf"), 0
    for _ in range(repeat):
        gc.collect()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, mx.get_peak_memory() - base)
        del out
    return best, peak


def rss() -> int:
    """This process's resident memory, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def plain_copy(arrays):
    return [mx.array(x) for x in arrays]


def naive_rebuild(hot_blocks, args):
    """Concatenate at exact length, then append one token (what peers do)."""
    out = []
    for layer in range(args.layers):
        c = KVCache()
        keys = mx.concatenate([b.arrays[f"{layer}.keys"] for b in hot_blocks], axis=2)
        values = mx.concatenate([b.arrays[f"{layer}.values"] for b in hot_blocks], axis=2)
        c.keys, c.values, c.offset = keys, values, keys.shape[2]
        one = mx.zeros((1, args.kv_heads, 1, args.head_dim), mx.bfloat16)
        c.update_and_fetch(one, one)
        out += [c.keys, c.values]
    return out


def run(args, model, num_tokens: int) -> dict[str, float]:
    cfg = CacheConfig(block_size=args.block_size, hot_cache_only=True, hot_max_bytes=64 << 30)
    cfg = cfg.replace(hot_run_tokens=args.run_tokens)
    tokens = np.random.default_rng(0).integers(0, 512, num_tokens).tolist()
    with PrefixCache(model, cfg, model_id="bench") as pc:
        cache = synthetic_cache(args, num_tokens)
        pc.store(tokens, cache)
        hot_bytes = pc.stats()["hot"]["nbytes"]
        block_bytes = hot_bytes // (num_tokens // args.block_size)
        # The reference copies the same bytes, one layer's K or V at a time, into
        # fresh buffers of the size fetch allocates: a memcpy with the same faults.
        sources = [a for c in cache for a in (c.keys, c.values)]
        t_copy, _ = timed(functools.partial(plain_copy, sources), args.repeat)
        del cache, sources
        gc.collect()
        probe = [*tokens, 1]  # one token to prefill after the hit
        t_fetch, peak_fetch = timed(lambda: [c.state for c in pc.fetch(probe)[0]], args.repeat)
        give_back.now()  # from a cleared buffer cache and trimmed heap: fresh memory
        gc.collect()
        rss_before = rss()
        restored = pc.fetch(probe)[0]
        mx.eval([c.state for c in restored])
        rss_grown = rss() - rss_before
        restored_bytes = sum(c.keys.nbytes + c.values.nbytes for c in restored)
        del restored
        blocks = sorted(pc.hot, key=lambda b: b.index)
        t_naive, peak_naive = timed(lambda: naive_rebuild(blocks, args), args.repeat)
        ns_token = float("inf")  # best of ``repeat`` rounds of 50 calls, as the timings above
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for _ in range(50):
                pc.match(probe)
            ns_token = min(ns_token, (time.perf_counter() - t0) / 50 / len(probe) * 1e9)
    return {
        "tokens": num_tokens,
        "hot_mib": hot_bytes / MiB,
        "copy_gbs": hot_bytes / t_copy / 1e9,
        "fetch_ms": t_fetch * 1e3,
        "fetch_gbs": hot_bytes / t_fetch / 1e9,
        "vs_copy": t_copy / t_fetch,
        "peak_mib": peak_fetch / MiB,
        "bound_mib": (restored_bytes + block_bytes) * 1.05 / MiB,
        "rss_ratio": rss_grown / restored_bytes,
        "naive_ms": t_naive * 1e3,
        "naive_peak_mib": peak_naive / MiB,
        "ns_token": ns_token,
    }


COLUMNS = [
    ("tokens", "tokens", "{:.0f}"),
    ("hot_mib", "hot MiB", "{:.0f}"),
    ("copy_gbs", "plain copy GB/s", "{:.2f}"),
    ("fetch_ms", "fetch ms", "{:.0f}"),
    ("fetch_gbs", "fetch GB/s", "{:.2f}"),
    ("vs_copy", "fetch/copy", "{:.2f}"),
    ("peak_mib", "fetch peak MiB", "{:.0f}"),
    ("bound_mib", "bound MiB", "{:.0f}"),
    ("rss_ratio", "fetch RSS / bytes", "{:.3f}"),
    ("naive_ms", "naive ms", "{:.0f}"),
    ("naive_peak_mib", "naive peak MiB", "{:.0f}"),
    ("ns_token", "match ns/token", "{:.1f}"),
]


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = shaped_model(args)
    rows = []
    for n in args.tokens:
        row = run(args, model, n)
        rows.append(row)
        print(" ".join(f"{k}={fmt.format(row[k])}" for k, _, fmt in COLUMNS), flush=True)
    print()
    print("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(fmt.format(row[k]) for k, _, fmt in COLUMNS) + " |")
    print(
        "\nbound = (restored buffer + one block) x 1.05; peak = peak MLX memory above "
        "the memory held before the call (hot blocks are held before it); fetch RSS /"
        " bytes = the process's resident memory grown by a fetch held, over the restored"
        " buffers' bytes (from a cleared buffer cache and trimmed heap)."
    )


if __name__ == "__main__":
    main()
