"""RSS given back to the OS when the cache frees memory: trim_hot(0), then close().

Fills a hot-only cache to ``--fill`` bytes with big blocks of a synthetic shape
(a model of many wide K/V heads, its caches filled with random values, never
run), then ``trim_hot(0)``: the process's RSS before and after, and the bytes
the hot tier freed. The same once more, then ``close()``. The ratio (RSS that
fell / bytes freed) must be at least 0.9: freed cache memory leaves the
process (memory/give_back.py). ``--keep`` skips the give-back (the reference:
MLX's buffer cache and the C allocator keep what was freed).

    python tools/bench_give_back.py [--fill 1G] [--block-size 256] [--keep]
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.config import parse_bytes
from prefixcache.memory import give_back
from prefixcache.tiny.models import build_model

MiB = 1 << 20
SHAPE = {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8}
HEAD_DIM = 128


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def filled_cache(model, num_tokens: int, seed: int) -> list:
    """A cache of ``num_tokens`` random K/V per layer, as a prefill would leave it."""
    cache = make_prompt_cache(model)
    mx.random.seed(seed)
    for c in cache:
        shape = (1, SHAPE["num_key_value_heads"], num_tokens, HEAD_DIM)
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval(c.keys, c.values)
    return cache


def fill(pc: PrefixCache, model, nbytes: int, seq_tokens: int) -> None:
    seed = 0
    while pc.stats()["hot"]["nbytes"] + seq_tokens * token_bytes() <= nbytes:
        tokens = [(seed * 7919 + i) % 512 for i in range(seq_tokens)]
        pc.store(tokens, filled_cache(model, seq_tokens, seed))
        seed += 1
        gc.collect()


def token_bytes() -> int:
    return SHAPE["num_hidden_layers"] * 2 * SHAPE["num_key_value_heads"] * HEAD_DIM * 4


def measure(label: str, step) -> tuple[int, int, int]:
    gc.collect()
    before = rss()
    freed = step()
    gc.collect()
    after = rss()
    ratio = (before - after) / freed if freed else float("nan")
    print(
        f"{label:10s} RSS {before / MiB:8.1f} -> {after / MiB:8.1f} MiB "
        f"(fell {(before - after) / MiB:8.1f}), freed {freed / MiB:8.1f} MiB, ratio {ratio:.3f}",
        flush=True,
    )
    return before, after, freed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fill", default="1G", help="bytes to fill hot with")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--seq-tokens", type=int, default=2048)
    parser.add_argument("--keep", action="store_true", help="no give-back (the reference)")
    args = parser.parse_args()
    fill_bytes = parse_bytes(args.fill)
    if args.keep:
        give_back.set_enabled(False)
    model = build_model("llama", hidden_size=64, head_dim=HEAD_DIM, **SHAPE)
    config = CacheConfig(
        block_size=args.block_size, hot_cache_only=True, hot_max_bytes=2 * fill_bytes
    )
    pc = PrefixCache(model, config, model_id="give-back")
    print(
        f"policy: {'keep (reference)' if args.keep else 'give back'}; MLX cache limit "
        f"{give_back.cache_limit() / MiB:.0f} MiB; start RSS {rss() / MiB:.1f} MiB"
    )
    fill(pc, model, fill_bytes, args.seq_tokens)

    def trim() -> int:
        held = pc.stats()["hot"]["nbytes"]
        pc.trim_hot(0)
        return held - pc.stats()["hot"]["nbytes"]

    measure("trim_hot", trim)
    fill(pc, model, fill_bytes, args.seq_tokens)

    def close() -> int:
        held = pc.stats()["hot"]["nbytes"]
        pc.close()
        return held

    measure("close", close)


if __name__ == "__main__":
    main()
