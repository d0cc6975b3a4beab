"""Hash + lookup cost per token (``PrefixCache.match``) and the floor under it.

``match`` turns the prompt into uint32 bytes, hashes its blocks into chain keys,
looks the chain up in the tiers and checks the stored token ids. Measured in
one run, per prompt token (best of ``--repeat`` rounds of ``--calls`` calls):

  list -> bytes    ``token_bytes`` of a Python list (array.array("I"): one C
                   conversion per int, the cost of any list input)
  numpy -> bytes   the same from an int32 numpy array (no per-int work)
  xxh3 whole       xxh3-128 of all the prompt's bytes at once (the hash floor)
  chain keys       the per-block chain hash of the spec (parent + block)
  match (list)     ``pc.match`` of a list, as a scheduler calls it
  match (numpy)    ``pc.match`` of a numpy array

    python tools/bench_match.py
    python tools/bench_match.py --tokens 8192 16384 --block-size 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import xxhash
from benchlib import shaped_model, synthetic_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import chain_keys, token_bytes


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=1, help="payload size does not matter here")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeat", type=int, default=5)
    return p


def per_token(fn, num_tokens: int, args) -> float:
    """Best ns per token of ``fn()`` over ``args.repeat`` rounds of ``args.calls`` calls."""
    best = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / args.calls)
    return best / num_tokens * 1e9


def run(args, model, num_tokens: int) -> dict[str, float]:
    tokens = np.random.default_rng(0).integers(0, 512, num_tokens).tolist()
    config = CacheConfig(block_size=args.block_size, hot_cache_only=True, hot_max_bytes=64 << 30)
    with PrefixCache(model, config, model_id="bench") as pc:
        pc.store(tokens, synthetic_cache(args, num_tokens))
        probe = [*tokens, 1]
        arr = np.asarray(probe, dtype=np.int32)
        data = token_bytes(probe)
        root = pc._root(None)
        n = len(probe)
        assert pc.match(probe) == pc.match(arr) == num_tokens
        return {
            "tokens": num_tokens,
            "list_bytes": per_token(lambda: token_bytes(probe), n, args),
            "numpy_bytes": per_token(lambda: token_bytes(arr), n, args),
            "xxh3": per_token(lambda: xxhash.xxh3_128_digest(data), n, args),
            "chain": per_token(lambda: chain_keys(root, data, args.block_size), n, args),
            "match_list": per_token(lambda: pc.match(probe), n, args),
            "match_numpy": per_token(lambda: pc.match(arr), n, args),
        }


COLUMNS = [
    ("tokens", "tokens", "{:.0f}"),
    ("list_bytes", "list -> bytes ns/tok", "{:.2f}"),
    ("numpy_bytes", "numpy -> bytes ns/tok", "{:.2f}"),
    ("xxh3", "xxh3 whole ns/tok", "{:.2f}"),
    ("chain", "chain keys ns/tok", "{:.2f}"),
    ("match_list", "match (list) ns/tok", "{:.2f}"),
    ("match_numpy", "match (numpy) ns/tok", "{:.2f}"),
]


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = shaped_model(args)
    rows = [run(args, model, n) for n in args.tokens]
    print("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(fmt.format(row[k]) for k, _, fmt in COLUMNS) + " |")
    print(f"\nblock_size {args.block_size}; best of {args.repeat} x {args.calls} calls")


if __name__ == "__main__":
    main()
