"""Caller-side cost of ``store`` against the prefill it follows, in one run.

For a small local model, prefill N tokens (block-aligned chunks), then time
``PrefixCache.store`` of the same tokens on the caller's thread: cutting the
new blocks (one copy each), placing them in the hot tier, and, with
``write_through``, queueing them for the SSD writer (the disk write itself
runs on the writer thread and is not counted).

    python tools/bench_store.py --tokens 1024 4096
"""

from __future__ import annotations

import argparse
import tempfile
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cli.demo import DEMO_MODEL
from prefixcache.tiny.models import build_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--block-size", type=int, default=256)
    return p


def prefill(model, tokens, cache, step=512) -> None:
    for start in range(0, len(tokens), step):
        mx.eval(model(mx.array([tokens[start : start + step]]), cache=cache))


def run(model, n: int, block_size: int, policy: str, ssd_dir: str) -> dict[str, float]:
    tokens = np.random.default_rng(n).integers(3, 512, n).tolist()
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    prefill(model, tokens, cache)
    t_prefill = time.perf_counter() - t0
    hot_only = policy == "hot"
    cfg = CacheConfig(block_size=block_size, hot_cache_only=hot_only, ssd_dir=ssd_dir)
    if not hot_only:
        cfg = cfg.replace(write_policy=policy)
    with PrefixCache(model, cfg, model_id=f"bench-{n}-{policy}") as pc:
        t0 = time.perf_counter()
        pc.store(tokens, cache)
        t_store = time.perf_counter() - t0
    return {
        "tokens": n,
        "policy": policy,
        "prefill_ms": t_prefill * 1e3,
        "store_ms": t_store * 1e3,
        "ratio": t_store / t_prefill,
    }


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = build_model("llama", **DEMO_MODEL)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tokens:
            for policy in ("hot", "write_back", "write_through"):
                row = run(model, n, args.block_size, policy, f"{tmp}/{n}-{policy}")
                rows.append(row)
                print(
                    " ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()
                    ),
                    flush=True,
                )
    print("\n| tokens | policy | prefill ms | store ms (caller) | store / prefill |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['policy']} | {r['prefill_ms']:.0f} | {r['store_ms']:.1f} | "
            f"{r['ratio']:.2%} |"
        )


if __name__ == "__main__":
    main()
