"""Hybrid-model memory benchmark: bytes per cached token, restore peak, no growth.

Two model-shaped tiny models (random weights, offline):
  - gemma3-like: 5 sliding-window layers per global layer (RotatingKVCache + KVCache),
  - qwen3-next-like: 3 gated-delta-net layers per attention layer (ArraysCache + KVCache).

For each, in one run:
  - bytes stored per cached token (the hot tier after ``prefill``), against the
    bytes per token of the live cache (windows hold only their last tokens),
  - the peak MLX memory of a restore above what is held before it (the hot
    blocks), against the restored cache's bytes plus one block,
  - MLX active memory (and RSS) after 10 and after ``--requests`` prefill/store
    requests with a bounded hot tier: flat means no leaked snapshots.

    python tools/bench_hybrid.py --requests 1000
"""

from __future__ import annotations

import argparse
import gc
import time

import mlx.core as mx
import numpy as np
from benchlib import rss
from mlx.utils import tree_flatten

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny import build_model

MiB = 1 << 20
KiB = 1 << 10

MODELS = {
    "gemma3 5:1": (
        "gemma3_text",
        dict(
            num_hidden_layers=12, sliding_window=128, sliding_window_pattern=6,
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=128,
        ),
    ),
    "qwen3-next 3:1": (
        "qwen3_next",
        dict(
            num_hidden_layers=8, full_attention_interval=4, hidden_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_value_heads=8, linear_num_key_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64,
        ),
    ),
}  # fmt: skip


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", type=int, default=1024, help="prompt length of the restore test")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--request-tokens", type=int, default=72)
    p.add_argument("--hot-mib", type=int, default=4, help="hot tier budget of the request loop")
    p.add_argument("--snapshot-interval", type=int, default=1)
    return p


def nbytes(cache) -> int:
    leaves = tree_flatten([c.state for c in cache])
    return sum(x.nbytes for _, x in leaves if isinstance(x, mx.array))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def restore_row(model, args) -> dict[str, float]:
    bs = args.block_size
    cfg = CacheConfig(
        block_size=bs,
        hot_cache_only=True,
        hot_max_bytes=8 << 30,
        snapshot_interval=args.snapshot_interval,
    )
    prompt = tokens(0, args.tokens)
    with PrefixCache(model, cfg, model_id="bench") as pc:
        live, _ = pc.prefill(prompt, prefill_step_size=bs * args.snapshot_interval)
        live_bytes = nbytes(live)  # includes mlx-lm's 256-token buffer steps
        del live
        cached = args.tokens // bs * bs
        hot_bytes = pc.hot.nbytes
        block_bytes = hot_bytes // (cached // bs)
        probe = [*prompt[:cached], 1]
        gc.collect()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        cache, num_cached = pc.fetch(probe)
        mx.eval([c.state for c in cache])
        fetch_s = time.perf_counter() - t0
        peak = mx.get_peak_memory() - base
        restored = nbytes(cache)
        assert num_cached == cached, (num_cached, cached)
    return {
        "stored_b_token": hot_bytes / cached,
        "live_b_token": live_bytes / args.tokens,
        "hot_mib": hot_bytes / MiB,
        "restored_mib": restored / MiB,
        "peak_mib": peak / MiB,
        "bound_mib": (restored + block_bytes) / MiB,
        "fetch_ms": fetch_s * 1e3,
    }


def growth_row(model, args) -> dict[str, float]:
    """Memory after 10 and after ``--requests`` prefill requests (shared system prefix)."""
    cfg = CacheConfig(
        block_size=args.block_size,
        hot_cache_only=True,
        hot_max_bytes=args.hot_mib * MiB,
        snapshot_interval=args.snapshot_interval,
    )
    system = tokens(1, args.block_size * 2)
    marks: dict[int, tuple[int, int, int]] = {}
    with PrefixCache(model, cfg, model_id="bench") as pc:
        t0 = time.perf_counter()
        for i in range(1, args.requests + 1):
            cache, logits = pc.prefill([*system, *tokens(100 + i, args.request_tokens)])
            del cache, logits
            if i in (10, args.requests):
                gc.collect()
                marks[i] = (mx.get_active_memory(), pc.hot.nbytes, rss())
        per_request = (time.perf_counter() - t0) / args.requests
        hits = pc.stats()["num_hits"]
    (a10, h10, r10), (an, hn, rn) = marks[10], marks[args.requests]
    return {
        "hot_10_mib": h10 / MiB,
        "hot_n_mib": hn / MiB,
        "other_10_kib": (a10 - h10) / KiB,
        "other_n_kib": (an - hn) / KiB,
        "rss_10_mib": r10 / MiB,
        "rss_n_mib": rn / MiB,
        "hits": hits,
        "ms_request": per_request * 1e3,
    }


COLUMNS = [
    ("model", "model", "{}"),
    ("stored_b_token", "stored B/token", "{:.0f}"),
    ("live_b_token", "live cache B/token", "{:.0f}"),
    ("restored_mib", "restored MiB", "{:.2f}"),
    ("peak_mib", "restore peak MiB", "{:.2f}"),
    ("bound_mib", "restored+1 block MiB", "{:.2f}"),
    ("hot_10_mib", "hot MiB @10", "{:.1f}"),
    ("hot_n_mib", "hot MiB @N", "{:.1f}"),
    ("other_10_kib", "non-hot KiB @10", "{:.0f}"),
    ("other_n_kib", "non-hot KiB @N", "{:.0f}"),
    ("rss_10_mib", "RSS MiB @10", "{:.0f}"),
    ("rss_n_mib", "RSS MiB @N", "{:.0f}"),
]


def main() -> None:
    args = setup_arg_parser().parse_args()
    rows = []
    for name in args.models:
        arch, overrides = MODELS[name]
        model = build_model(arch, **overrides)
        row = {"model": name, **restore_row(model, args), **growth_row(model, args)}
        rows.append(row)
        print(
            " ".join(f"{k}={fmt.format(row[k])}" for k, _, fmt in COLUMNS),
            f"fetch_ms={row['fetch_ms']:.1f} hits={row['hits']} ms/request={row['ms_request']:.1f}",
            flush=True,
        )
    print(
        f"\nN = {args.requests} requests; block_size {args.block_size}; restore of "
        f"{args.tokens} tokens; snapshot_interval {args.snapshot_interval}"
    )
    print("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(fmt.format(row[k]) for k, _, fmt in COLUMNS) + " |")
    print(
        "\nstored B/token counts every layer's payload per block (window K/V and state "
        "snapshots included); restore peak = peak MLX memory above what was held before "
        "fetch (the hot blocks); non-hot = MLX active memory minus the hot tier."
    )


if __name__ == "__main__":
    main()
