"""A small restore's fixed cost: a 1024-token hot restore of bench_hybrid's models.

The two hybrid models of ``tools/bench_hybrid.py`` (gemma3-like 5:1 sliding
windows, qwen3-next-like 3:1 gated delta net) and a falcon-h1-like one of 24
layers (each a CacheList of a mamba state and attention K/V), block 64: the prompt is stored
through ``pc.prefill`` in a hot-only cache, then fetched ``--repeat`` times
(until its arrays are evaluated). At a few MiB the restore's bytes cost little:
what is left is the per-request work (lookup, buffers, per-layer copies).
Prints the first fetch and the median and minimum of the rest.

    python tools/bench_small_restore.py [--tokens 1024] [--repeat 30]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import mlx.core as mx
from bench_hybrid import MODELS, tokens

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=30)
    args = p.parse_args()
    models = {**MODELS, "falcon-h1 24 layers": ("falcon_h1", {"num_hidden_layers": 24})}
    for name, (arch, overrides) in models.items():
        model = build_model(arch, **overrides)
        prompt = tokens(0, args.tokens)
        config = CacheConfig(block_size=64, hot_cache_only=True, hot_max_bytes=8 << 30)
        with PrefixCache(model, config, model_id="bench") as pc:
            pc.prefill(prompt, prefill_step_size=64 * 8)
            probe = [*prompt, 1]
            times = []
            for _ in range(args.repeat + 1):
                gc.collect()
                start = time.perf_counter()
                cache, n = pc.fetch(probe)
                mx.eval([c.state for c in cache])
                times.append((time.perf_counter() - start) * 1e3)
                del cache
            rest = times[1:]
            print(
                f"{name}: {n} tokens restored; first {times[0]:.2f} ms, "
                f"median {statistics.median(rest):.2f} ms, min {min(rest):.2f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
