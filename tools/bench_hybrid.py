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
    requests with a bounded hot tier: flat means no leaked snapshots,
  - cached / reusable tokens on an interleaved multi-turn chat trace (shared
    system prompts, growing histories) served the way a scheduler with its own
    prefill loop serves it: ``fetch``, prefill the rest, ``store(tokens, cache)``
    (reusable = the longest prefix any stored sequence shares, one token left).

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
from prefixcache.tiny.models import build_model

MiB = 1 << 20
KiB = 1 << 10

MODELS = {
    "gemma3 5:1": (
        "gemma3_text",
        dict(
            num_hidden_layers=12,
            sliding_window=128,
            sliding_window_pattern=6,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=128,
        ),
    ),
    "qwen3-next 3:1": (
        "qwen3_next",
        dict(
            num_hidden_layers=8,
            full_attention_interval=4,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_value_heads=8,
            linear_num_key_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        ),
    ),
}


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", type=int, default=1024, help="prompt length of the restore test")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--request-tokens", type=int, default=72)
    p.add_argument("--hot-mib", type=int, default=4, help="hot tier budget of the request loop")
    p.add_argument(
        "--snapshot-interval", type=int, default=0, help="0: from the config's snapshot_ratio"
    )
    p.add_argument("--conversations", type=int, default=8, help="of the chat trace")
    p.add_argument("--turns", type=int, default=4, help="of the chat trace")
    p.add_argument("--trace-only", action="store_true", help="only the chat trace")
    return p


def nbytes(cache) -> int:
    leaves = tree_flatten([c.state for c in cache])
    return sum(x.nbytes for _, x in leaves if isinstance(x, mx.array))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def interval_setting(args) -> dict[str, int]:
    """The config's snapshot_interval when given (0: the config's default picks it)."""
    return {"snapshot_interval": args.snapshot_interval} if args.snapshot_interval else {}


def trace_row(model, args) -> dict[str, float]:
    """cached / reusable tokens of an interleaved chat trace through fetch + plain store."""
    bs = args.block_size
    rng = np.random.default_rng(7)
    systems = [tokens(200 + s, 2 * bs + 17) for s in range(3)]
    history = [list(systems[c % 3]) for c in range(args.conversations)]
    order = [c for _ in range(args.turns) for c in rng.permutation(args.conversations)]
    stored: list[list[int]] = []
    cached = reusable = 0
    cfg = CacheConfig(block_size=bs, hot_cache_only=True, hot_max_bytes=8 << 30)
    with PrefixCache(model, cfg, model_id="bench") as pc:
        for c in order:
            prompt = history[c] + tokens(int(rng.integers(1 << 30)), 40)
            reply = tokens(int(rng.integers(1 << 30)), 24)
            reusable += min(len(prompt) - 1, max((shared(prompt, s) for s in stored), default=0))
            cache, num_cached = pc.fetch(prompt)
            cached += num_cached
            full = prompt + reply  # the reply is fed as decoding would feed it
            for start in range(num_cached, len(full), 256):
                model(mx.array([full[start : start + 256]]), cache=cache)
                mx.eval([x.state for x in cache])
            pc.store(full, cache)
            stored.append(full)
            history[c] = full
        reasons = {k: v for k, v in pc.stats()["miss_reasons"].items() if v}
    return {"trace_cached": cached, "trace_reusable": reusable, "trace_reasons": reasons}


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def restore_row(model, args) -> dict[str, float]:
    bs = args.block_size
    cfg = CacheConfig(
        block_size=bs,
        hot_cache_only=True,
        hot_max_bytes=8 << 30,
        **interval_setting(args),
    )
    prompt = tokens(0, args.tokens)
    with PrefixCache(model, cfg, model_id="bench") as pc:
        interval = args.snapshot_interval or pc.layout.snapshot_interval
        live, _ = pc.prefill(prompt, prefill_step_size=bs * interval)
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
        "interval": interval,
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
        **interval_setting(args),
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
    ("interval", "snapshot interval", "{}"),
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
        trace = trace_row(model, args)
        print(
            f"{name}: chat trace through fetch + store: cached {trace['trace_cached']} / "
            f"reusable {trace['trace_reusable']} = "
            f"{trace['trace_cached'] / max(1, trace['trace_reusable']):.2f}; "
            f"miss reasons {trace['trace_reasons']}",
            flush=True,
        )
        if args.trace_only:
            continue
        row = {"model": name, **restore_row(model, args), **growth_row(model, args)}
        rows.append(row)
        print(
            " ".join(f"{k}={fmt.format(row[k])}" for k, _, fmt in COLUMNS),
            f"fetch_ms={row['fetch_ms']:.1f} hits={row['hits']} ms/request={row['ms_request']:.1f}",
            flush=True,
        )
    print(
        f"\nN = {args.requests} requests; block_size {args.block_size}; restore of "
        f"{args.tokens} tokens"
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
