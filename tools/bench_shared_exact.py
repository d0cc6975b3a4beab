"""Shared-prefix exactness per model family: shared vs unshared runs, and the fallback.

Tiny random-weight models (prefixcache.tiny.models), one stored 64-token system
prompt, three sequences on it (suffixes of 5-27 tokens). Per family, the
sequences run twice from the same PrefixCache: ``fetch(shared=True)`` and the
plain ``fetch``; each prefills its suffix in 16-token chunks and decodes 8
greedy tokens alone (the shared run fed the unshared run's tokens, so every
step compares the same inputs), then the three decode 8 tokens together
through mlx-lm's BatchGenerator. Reported: max |logit diff| over every step
(alone) and max |log-prob diff| (batched), whether the greedy tokens are
identical (alone: argmax at every step; batched: the tokens generated), the
negative control (the same suffix on a wrong prefix), and for bf16 how far
each run is from a float32 run of the same weights. gemma2 computes its own
attention (not hookable): its shared fetches must fall back, counted. mlx-lm
0.32.2 batches neither quantized K/V, chunked attention (llama4) nor gemma2
(its GQA mask fails to broadcast in a batch): those rows have no batched figure.

    python tools/bench_shared_exact.py          # about 30 s on 2 cores
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model

BLOCK, STEPS = 16, 8
QUANT = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
CASES = [  # name, arch, dtype, overrides, kv_bits
    ("llama", "llama", mx.float32, {}, None),
    ("qwen3", "qwen3", mx.float32, {}, None),
    ("gemma3 (sliding windows)", "gemma3_text", mx.float32, {}, None),
    ("qwen3_next (attention layers)", "qwen3_next", mx.float32, {}, None),
    ("lfm2 (attention layer)", "lfm2", mx.float32, {}, None),
    ("llama4 (global layer)", "llama4", mx.float32, {}, None),
    ("llama, 8-bit K/V", "llama", mx.float32, QUANT, 8),
    ("llama bf16", "llama", mx.bfloat16, {}, None),
    ("qwen3 bf16", "qwen3", mx.bfloat16, {}, None),
    ("gemma3 bf16", "gemma3_text", mx.bfloat16, {}, None),
    ("gemma2 (not hookable)", "gemma2", mx.float32, {}, None),
]


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def prefill(model, toks, cache) -> mx.array:
    for start in range(0, len(toks), BLOCK):
        logits = model(mx.array([toks[start : start + BLOCK]]), cache=cache)[:, -1]
        mx.eval(logits, [c.state for c in cache])
    return logits.astype(mx.float32)


def alone(model, cache, toks, fed=None) -> tuple[list[int], list[mx.array]]:
    """Prefill, then decode: (greedy tokens, logits of every step); ``fed``: the
    tokens to feed instead of its own (so two runs see the same inputs)."""
    logits = [prefill(model, toks, cache)]
    out = []
    for i in range(STEPS):
        out.append(int(mx.argmax(logits[-1]).item()))
        token = out[-1] if fed is None else fed[i]
        logits.append(model(mx.array([[token]]), cache=cache)[:, -1].astype(mx.float32))
    return out, logits


def together(model, items) -> tuple[list[list[int]], list[mx.array]]:
    gen = BatchGenerator(model, max_tokens=STEPS, prefill_step_size=BLOCK)
    uids = gen.insert([rest for _, rest in items], caches=[cache for cache, _ in items])
    out: dict[int, list] = {u: [] for u in uids}
    for _ in range(4 * STEPS):
        for r in gen.next_generated():
            out[r.uid].append((r.token, r.logprobs.astype(mx.float32)))
        if all(len(v) == STEPS for v in out.values()):
            break
    gen.close()
    return [[t for t, _ in out[u]] for u in uids], [mx.stack([p for _, p in out[u]]) for u in uids]


def _rest(fetched: tuple[list, int], user: list[int]) -> tuple[list, list[int]]:
    cache, num_cached = fetched
    return cache, user[num_cached:]


def diff(a: list[mx.array], b: list[mx.array]) -> float:
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b, strict=True))


def case(arch, dtype, overrides, kv_bits) -> dict:
    model = build_model(arch, dtype=dtype, **overrides)
    cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True)
    if kv_bits:
        cfg = cfg.replace(kv_bits=kv_bits, kv_group_size=32, quantized_kv_start=0)
    system = tokens(1, 4 * BLOCK)
    users = [system + tokens(10 + i, 5 + 11 * i) for i in range(3)]
    row = {"alone": 0.0, "batch": None, "same": True, "batch_same": None, "control": 0.0}
    row["f32"] = None
    with PrefixCache(model, cfg, model_id="exact") as pc:
        cache = make_prompt_cache(model)
        prefill(model, system, cache)
        pc.store(system, cache)
        results = {False: [alone(model, *_rest(pc.fetch(u), u)) for u in users]}
        held = [pc.fetch(u, shared=True) for u in users]  # live together: one prefix
        results[True] = [  # fed the unshared run's tokens: logits compared step by step
            alone(model, *_rest(fetched, u), fed=want[0])
            for u, fetched, want in zip(users, held, results[False], strict=True)
        ]
        del held
        for got, want in zip(results[True], results[False], strict=True):
            row["alone"] = max(row["alone"], diff(got[1], want[1]))
            row["same"] &= got[0] == want[0]
        other = make_prompt_cache(model)
        prefill(model, tokens(99, len(system)), other)
        row["control"] = diff(alone(model, other, users[0][len(system) :])[1], results[False][0][1])
        # as mlx-lm's server decides (every cache has merge); its gemma2 batch mask fails
        if all(hasattr(c, "merge") for c in cache) and not kv_bits and arch != "gemma2":
            fresh = {s: [pc.fetch(u, shared=s) for u in users] for s in (True, False)}
            batched = {
                s: together(model, [(c, u[n:]) for u, (c, n) in zip(users, f, strict=True)])
                for s, f in fresh.items()
            }
            same = batched[True][0] == batched[False][0]
            # once greedy tokens differ, the runs decode different inputs
            row["batch"] = diff(batched[True][1], batched[False][1]) if same else None
            row["batch_same"] = same
        row["stats"] = pc.stats()["shared"]
    if dtype != mx.float32:
        row["f32"] = _against_float32(arch, overrides, system, users, results)
    return row


def _against_float32(arch, overrides, system, users, results) -> tuple[float, float]:
    """(shared, unshared) max |logit diff| from a float32 run of the same bf16 weights."""
    wide = build_model(arch, dtype=mx.bfloat16, **overrides)
    wide.set_dtype(mx.float32)
    err = {True: 0.0, False: 0.0}
    for i, user in enumerate(users):
        cache = make_prompt_cache(wide)
        prefill(wide, system, cache)
        want = prefill(wide, user[len(system) :], cache)
        for shared in (True, False):
            err[shared] = max(err[shared], mx.abs(results[shared][i][1][0] - want).max().item())
    return err[True], err[False]


def main() -> None:
    print(
        "| family | max abs logit diff, alone | max abs log-prob diff, batched | greedy "
        "identical: alone, batched | wrong prefix (control) | bf16: shared / unshared vs "
        "float32 | shared fetches: loads, reuses, fallbacks |"
    )
    print("|" + "---|" * 7)
    for name, arch, dtype, overrides, kv_bits in CASES:
        row = case(arch, dtype, overrides, kv_bits)
        s = row["stats"]
        f32 = "" if row["f32"] is None else f"{row['f32'][0]:.3f} / {row['f32'][1]:.3f}"
        if row["batch_same"] is None:
            batch = "(mlx-lm: no batch)"
        else:
            batch = f"{row['batch']:.1e}" if row["batch_same"] else "(tokens differ)"
        print(
            f"| {name} | {row['alone']:.1e} | {batch} | {row['same']}, {row['batch_same']} | "
            f"{row['control']:.2f} | {f32} | {s['num_loads']}, {s['num_reuses']}, "
            f"{s['num_fallbacks']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
