"""Shared-prefix benchmark: N concurrent sequences on one long prefix, shared vs copies.

A llama-shaped model with real attention dimensions (8 KV heads x head_dim
128 by default, random weights, as many layers as ``--layers``); a prefix of
``--prefix-tokens`` is stored in the hot tier (its K/V are random arrays: a
real prefill of 8k tokens takes minutes here, and neither memory nor speed
depends on the values). Then, in one run, for each arm:

  - copies: ``pc.fetch(prompt)`` per sequence (today: a private copy each),
  - shared: ``pc.fetch(prompt, shared=True)`` (one copy of the prefix),

each sequence prefills its ``--suffix-tokens`` private suffix; MLX active
memory above the hot tier is read after 1, 2, 4, 8 sequences. Then N = 4 and
8 of them decode together through mlx-lm's BatchGenerator (which merges
copies into one batch buffer, and keeps a shared prefix shared), the two
arms' batches one step each in turn; tokens/s is N / median step time, and
the ratio is the median of the step-by-step ratios (each shared step against
the copies step just before it: the machine's load drifts). Also:
the fetch and suffix-prefill time of each sequence after the first (the
prefix is live: shared fetch copies nothing), and the exactness of shared vs
copies (last-token logits of every suffix prefill, greedy decode tokens).

    python tools/bench_shared.py                 # about 3-4 minutes on 2 cores
    python tools/bench_shared.py --layers 4 --decode-steps 48
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model

MiB = 1 << 20
COUNTS = (1, 2, 4, 8)
ARMS = ("copies", "shared")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix-tokens", type=int, default=8192)
    p.add_argument("--suffix-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=24)
    return p


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def setup(args):
    """The model, a hot-only PrefixCache holding the prefix, and 8 prompts on it."""
    model = build_model(
        "llama",
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.hidden,
        num_attention_heads=args.q_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=4 * (args.prefix_tokens + args.suffix_tokens),
    )
    cfg = CacheConfig(block_size=256, hot_cache_only=True, hot_max_bytes=64 << 30)
    pc = PrefixCache(model, cfg, model_id="bench-shared")
    prefix = tokens(0, args.prefix_tokens)
    cache = []
    for _ in range(args.layers):
        c, shape = KVCache(), (1, args.kv_heads, args.prefix_tokens, args.head_dim)
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        cache.append(c)
    mx.eval([c.state for c in cache])
    pc.store(prefix, cache)
    prompts = [prefix + tokens(100 + i, args.suffix_tokens) for i in range(max(COUNTS))]
    return model, pc, prompts


def active() -> int:
    gc.collect()
    return mx.get_active_memory()


def add(model, pc, prompt, *, shared: bool) -> tuple[list, mx.array, float, float, int]:
    """One more sequence: fetch, prefill its suffix. (cache, last logits, fetch s,
    prefill s, MLX active bytes it added)."""
    base = active()
    t0 = time.perf_counter()
    cache, num_cached = pc.fetch(prompt, shared=shared)
    mx.eval([c.state for c in cache])
    t1 = time.perf_counter()
    logits = model(mx.array([prompt[num_cached:]]), cache=cache)[0, -1]
    mx.eval(logits, [c.state for c in cache])
    t2 = time.perf_counter()
    assert num_cached == len(prompt) - len(prompt[num_cached:]) and num_cached > 0
    return cache, logits, t1 - t0, t2 - t1, active() - base


def grow(model, pc, prompts) -> dict:
    """Both arms, sequence by sequence (alternating, as the machine's load drifts)."""
    arms = {
        name: {"caches": [], "logits": [], "fetch_s": [], "prefill_s": [], "mem": {}}
        for name in ARMS
    }
    held = dict.fromkeys(ARMS, 0)
    for i, prompt in enumerate(prompts, 1):
        for name, arm in arms.items():
            cache, logits, fetch_s, prefill_s, added = add(
                model, pc, prompt, shared=name == "shared"
            )
            for key, value in zip(
                ("caches", "logits", "fetch_s", "prefill_s"),
                (cache, logits, fetch_s, prefill_s),
                strict=True,
            ):
                arm[key].append(value)
            held[name] += added
            if i in COUNTS:
                arm["mem"][i] = held[name]
        print(f"sequence {i}: prefilled in both arms", flush=True)
    return arms


def start(model, caches, firsts, steps: int) -> tuple[BatchGenerator, dict[int, list[int]]]:
    """A BatchGenerator decoding the sequences together, set up and past its first step."""
    gen = BatchGenerator(model, max_tokens=steps + 2, completion_batch_size=len(caches))
    got = {u: [] for u in gen.insert([[t] for t in firsts], caches=list(caches))}
    for _ in range(2):  # the first calls set the batch up and run the first step
        for r in gen.next_generated():
            got[r.uid].append(r.token)
    return gen, got


def decode(model, arms, n: int, steps: int) -> dict:
    """Both arms' batches decoding ``steps`` tokens, one step of each in turn (the
    machine's load drifts: a step's ratio compares neighbours). Per arm: tokens,
    step seconds, batch cache bytes as mlx-lm counts them."""
    runs = {}
    for name, arm in arms.items():
        firsts = [int(mx.argmax(x).item()) for x in arm["logits"][:n]]
        runs[name] = (*start(model, arm["caches"][:n], firsts, steps), [])
    held = {name: gen.prompt_cache_nbytes for name, (gen, _, _) in runs.items()}
    for _ in range(steps):
        for gen, got, times in runs.values():
            t0 = time.perf_counter()
            responses = gen.next_generated()
            # the step it started in the background too, so steps do not overlap
            mx.synchronize(gen.stream)
            times.append(time.perf_counter() - t0)
            for r in responses:
                got[r.uid].append(r.token)
    out = {}
    for name, (gen, got, times) in runs.items():
        gen.close()
        out[name] = {"tokens": [got[u] for u in sorted(got)], "times": times, "held": held[name]}
    return out


def run(args) -> dict:
    model, pc, prompts = setup(args)
    print("prefix stored; prefilling suffixes", flush=True)
    arms = grow(model, pc, prompts)
    speed = {}
    for n in (4, 8):
        speed[n] = decode(model, arms, n, args.decode_steps)
        print(f"decoded N = {n}", flush=True)
    kv_token = 2 * args.layers * args.kv_heads * args.head_dim * 4
    return {"arms": arms, "speed": speed, "kv_token": kv_token, "stats": pc.stats()["shared"]}


def table(header: list[str], rows: list[list[str]]) -> None:
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def report(args, res) -> None:
    arms, speed, kv_token = res["arms"], res["speed"], res["kv_token"]
    prefix_b, suffix_b = kv_token * args.prefix_tokens, kv_token * args.suffix_tokens
    print(
        f"\nprefix {args.prefix_tokens} tokens x {args.layers} layers x {args.kv_heads} KV heads "
        f"x head_dim {args.head_dim} (float32): {prefix_b / MiB:.0f} MiB of K/V; suffixes "
        f"{args.suffix_tokens} tokens ({suffix_b / MiB:.1f} MiB each)"
    )
    rows = []
    for n in COUNTS:
        c, s = arms["copies"]["mem"][n], arms["shared"]["mem"][n]
        target = prefix_b + n * suffix_b
        rows.append(
            [
                str(n),
                f"{c / MiB:.0f}",
                f"{s / MiB:.0f}",
                f"{s / c:.2f}",
                f"{target / MiB:.0f}",
                f"{s / target:.3f}",
            ]
        )
    table(
        [
            "sequences",
            "copies MiB",
            "shared MiB",
            "shared / copies",
            "prefix + suffixes MiB",
            "shared / (prefix + suffixes)",
        ],
        rows,
    )
    rows = []
    for n in (4, 8):
        c, s = speed[n]["copies"], speed[n]["shared"]
        ratios = sorted(a / b for a, b in zip(c["times"], s["times"], strict=True))
        q = len(ratios) // 4
        rows.append(
            [
                str(n),
                f"{n / statistics.median(c['times']):.2f}",
                f"{n / statistics.median(s['times']):.2f}",
                f"{statistics.median(ratios):.2f} ({ratios[q]:.2f}-{ratios[-1 - q]:.2f})",
                f"{c['held'] / MiB:.0f}",
                f"{s['held'] / MiB:.0f} + {prefix_b / MiB:.0f}",
            ]
        )
    table(
        [
            "decode N",
            "copies tok/s",
            "shared tok/s",
            "shared / copies: median of step-by-step ratios (quartiles)",
            "batch K/V MiB copies",
            "batch K/V MiB shared (+ prefix once)",
        ],
        rows,
    )
    later = slice(1, None)  # the first shared fetch loads the prefix
    fetch = {a: statistics.median(arms[a]["fetch_s"][later]) for a in ARMS}
    pre = {a: statistics.median(arms[a]["prefill_s"][later]) for a in ARMS}
    print(
        f"\nnew sequence on the live prefix (median of sequences 2-8): fetch copies "
        f"{fetch['copies'] * 1e3:.1f} ms, shared {fetch['shared'] * 1e3:.2f} ms; suffix "
        f"prefill ({args.suffix_tokens} of {args.prefix_tokens + args.suffix_tokens} tokens) "
        f"copies {pre['copies']:.2f} s, shared {pre['shared']:.2f} s (shared / copies "
        f"{pre['shared'] / pre['copies']:.2f}); first shared fetch (loads the prefix) "
        f"{arms['shared']['fetch_s'][0] * 1e3:.0f} ms"
    )
    pairs = zip(arms["copies"]["logits"], arms["shared"]["logits"], strict=True)
    diff = max(mx.abs(a - b).max().item() for a, b in pairs)
    same = all(speed[n]["copies"]["tokens"] == speed[n]["shared"]["tokens"] for n in (4, 8))
    print(
        f"exactness: max |logit diff| of the suffix prefills {diff:.2e}; greedy decode tokens "
        f"identical: {same}\nshared stats: {res['stats']}"
    )


def main() -> None:
    args = setup_arg_parser().parse_args()
    report(args, run(args))


if __name__ == "__main__":
    main()
