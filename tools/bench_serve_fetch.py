"""A fetch of bench_serve's model from blocks, against mlx-lm's fetch of a whole entry.

At bench_serve's 5-8 MiB budgets both caches hold about the same tokens, and
the median request restores about as many from either: its TTFT differs only
by the fetch. mlx-lm's ``LRUPromptCache`` hands over a deep copy of the
entry it holds (lazy MLX copies: no bytes move until the batch merges them).
Ours keeps blocks that chains share and must gather them into one buffer per
layer and K/V (DESIGN.md: hot blocks are arrays of their own, not views into
a cache); at 16 MiB the budget leaves room for the whole sequences too, and a
fetch hands over views of one (``tiers/recent.py``).

Ways, for a chain of ``--tokens`` tokens of bench_serve's model (4 layers,
head_dim 32, float32), after a sweep of ``--sweep`` MiB through memory (as a
prefill leaves the CPU's caches), in rotating order each round:

  mlx-lm  ``LRUPromptCache.fetch_nearest_cache`` of the entry, evaluated
  gather  the least a gather costs with no prefixcache code: per layer and K/V,
          numpy ``empty``, ONE ``np.concatenate`` of the blocks' host bytes,
          ``mx.array`` of it (what ours does for small buffers), evaluated
  ours    ``PrefixCache.fetch`` of a hot-only cache holding the chain in
          blocks of ``--block-size``, evaluated

and, as the batch takes the fetched cache before the request's first token
(merged into a ``BatchKVCache`` per layer, then one update of ``--rest``
tokens' K/V, as its first prefill step writes them):

  mlx-lm + batch  the fetch, mlx-lm's merge (a copy) and the update (a copy
                  into a buffer with room for the step)
  ours + batch    ``PrefixCache.fetch`` with ``prefixcache serve``'s headroom
                  (room for the prompt's rest and its first token), the batch
                  taking its buffer (prefixcache/serve/batch.py), the update in place
  ours, copied    the same fetch with no headroom, merged and updated as mlx-lm's
                  (what a restore with no headroom costs the batch)

Prints medians in ms, each way's excess over mlx-lm's, and that as a share of
``--ttft-ms`` (bench_serve's TTFT p50 on this machine).

    python tools/bench_serve_fetch.py [--tokens 640] [--block-size 32] [--repeat 31]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from benchlib import chat_model_shape
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import KVCache, LRUPromptCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cli.serve import SERVE_HEADROOM
from prefixcache.memory.host import host_view
from prefixcache.serve.batch import batch_ready
from prefixcache.tiny.models import build_model

KEY = ("bench-llama", None, None)


def filled_cache(model, tokens: int) -> list[KVCache]:
    caches = []
    for layer in model.layers:
        attn = layer.self_attn
        shape = (1, attn.n_kv_heads, tokens, attn.head_dim)
        c = KVCache()
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=640)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128, help="bench_serve's model width")
    p.add_argument("--sweep", type=int, default=64, help="MiB written between ways")
    p.add_argument("--rest", type=int, default=48, help="prompt tokens after the cached ones")
    p.add_argument("--ttft-ms", type=float, default=44.0, help="bench_serve's TTFT p50")
    p.add_argument("--repeat", type=int, default=31)
    args = p.parse_args()
    model = build_model("llama", **chat_model_shape(args.hidden))
    tokens = np.random.default_rng(0).integers(1, 500, args.tokens).tolist()
    probe = [*tokens, 1]
    cache = filled_cache(model, args.tokens)
    prompt = [*tokens, *range(1, args.rest + 1)]
    step = filled_cache(model, args.rest)  # the first prefill step's K/V, per layer

    lru = LRUPromptCache(max_size=16)
    lru.insert_cache(KEY, tokens, cache)
    config = CacheConfig(block_size=args.block_size, hot_cache_only=True, restore_headroom=0)
    pc = PrefixCache(model, config, model_id="bench")
    pc.store(tokens, cache)
    served = PrefixCache(model, config.replace(restore_headroom=SERVE_HEADROOM), model_id="b")
    served.store(tokens, cache)
    held = args.tokens // args.block_size * args.block_size
    bs = args.block_size
    parts = [  # per layer and K/V: the blocks' host bytes, as the hot tier keeps them
        [host_view(mx.array(a[:, :, i : i + bs, :])).view(np.uint8) for i in range(0, held, bs)]
        for c in cache
        for a in (c.keys[..., : args.tokens, :], c.values[..., : args.tokens, :])
    ]

    def mlx_lm() -> None:
        restored, rest = lru.fetch_nearest_cache(KEY, probe)
        mx.eval([c.state for c in restored])
        assert len(rest) == 1

    def gather() -> None:
        out = []
        for blocks in parts:
            b, h, _, d = blocks[0].shape
            host = np.empty((b, h, held, d), np.uint8)
            np.concatenate(blocks, axis=2, out=host)
            out.append(mx.array(host.view(np.float32)))
        mx.eval(out)

    def ours() -> None:
        restored, num = pc.fetch(probe)
        mx.eval([c.state for c in restored])
        assert num == held, (num, held)

    def batched(restored: list) -> None:
        batch = _merge_caches([restored])
        for b, c in zip(batch, step, strict=True):
            b.update_and_fetch(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
        mx.eval([b.state for b in batch])

    def mlx_lm_batch() -> None:
        batched(lru.fetch_nearest_cache(KEY, prompt)[0])

    def ours_batch() -> None:
        restored, num = served.fetch(prompt)
        assert num == held, (num, held)
        batched(batch_ready(restored))

    def ours_copied() -> None:
        restored, num = pc.fetch(prompt)
        assert num == held, (num, held)
        batched(restored)

    ways = {
        "mlx-lm": mlx_lm,
        "gather": gather,
        "ours": ours,
        "mlx-lm + batch": mlx_lm_batch,
        "ours + batch": ours_batch,
        "ours, copied": ours_copied,
    }
    sweep = np.ones(args.sweep << 20, np.uint8)
    ms: dict[str, list[float]] = {n: [] for n in ways}
    names = list(ways)
    for fn in ways.values():
        fn()
    for r in range(args.repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sweep += 1  # the CPU's caches hold other bytes, as after a prefill
            start = time.perf_counter()
            ways[name]()
            ms[name].append((time.perf_counter() - start) * 1e3)
    pc.close()
    served.close()
    med = {n: statistics.median(v) for n, v in ms.items()}
    kib = sum(c.keys[..., :held, :].nbytes * 2 for c in cache) / 1024
    print(f"{held} tokens in {held // bs} blocks of {bs}, {kib:.0f} KiB, then {args.rest} "
          f"in the batch; medians of {args.repeat}")  # fmt: skip
    for n, v in med.items():
        ref = med["mlx-lm + batch" if "batch" in n or "copied" in n else "mlx-lm"]
        extra = v - ref
        print(f"  {n:15} {v:6.3f} ms  {extra:+.3f} ms = {extra / args.ttft_ms:+.1%} of a "
              f"{args.ttft_ms:.0f} ms TTFT")  # fmt: skip


if __name__ == "__main__":
    main()
