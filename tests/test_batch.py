"""Batch caches: store sequences of a batch via extract(i), restore caches merged into one.

mlx-lm batches with BatchKVCache / BatchRotatingKVCache (and batched
ArraysCache / CacheList); its BatchGenerator merges per-sequence caches on
insert and extracts them on finish. Restored caches go through that code, and
the batched results must equal single-sequence ones bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import max_diff, prompt, tiny_model
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache.capture import chunk_ends

BLOCK = 16


def hot_pc(model) -> PrefixCache:
    return PrefixCache(model, CacheConfig(block_size=BLOCK, hot_cache_only=True), model_id="tiny")


def merge(caches: list[list]) -> list:
    """A batch cache list from per-sequence ones, as mlx-lm's BatchGenerator builds it."""
    return [layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)]


def single_continue(model, cache, tokens: list[int]) -> mx.array:
    return model(mx.array([tokens]), cache=cache)[:, -1, :]


def cold(model, tokens: list[int]) -> list:
    cache, pos = make_prompt_cache(model), 0
    for end in chunk_ends(0, len(tokens), BLOCK):
        model(mx.array([tokens[pos:end]]), cache=cache)
        mx.eval([c.state for c in cache])
        pos = end
    return cache


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "falcon_h1"])
def test_batched_prefill_is_stored_per_sequence_via_extract(arch):
    model = tiny_model(arch)
    prompts = [prompt(1, 64), prompt(2, 64)]
    batch = merge([make_prompt_cache(model) for _ in prompts])
    if arch != "falcon_h1":
        assert {type(c) for c in batch} <= {BatchKVCache, BatchRotatingKVCache}
    with hot_pc(model) as pc:
        pos = 0
        for end in chunk_ends(0, 64, BLOCK):
            model(mx.array([p[pos:end] for p in prompts]), cache=batch)
            mx.eval([c.state for c in batch])
            for i, p in enumerate(prompts):
                pc.capture(p[:end], [c.extract(i) for c in batch])
            pos = end
        for p in prompts:
            cache, num_cached = pc.fetch([*p, 7, 8, 9])
            assert num_cached == 64
            restored = single_continue(model, cache, [7, 8, 9])
            assert max_diff(restored, single_continue(model, cold(model, p), [7, 8, 9])) == 0.0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mamba2"])
def test_restored_caches_merge_into_a_batch(arch):
    """One batched step over merged restored caches equals each single-sequence step."""
    model = tiny_model(arch)
    a, b = prompt(1, 70), prompt(2, 60)
    with hot_pc(model) as pc:
        for p in (a, b):
            pc.prefill(p, prefill_step_size=BLOCK)
        # restore points of both (64: an interval point; 49: b's end minus 11)
        caches = [pc.fetch([*a[:64], 3]), pc.fetch([*b[:49], 4])]
        assert [n for _, n in caches] == [64, 49]  # different lengths: left padding
        batched = model(mx.array([[5], [6]]), cache=merge([c for c, _ in caches]))[:, -1, :]
        for row, (p, n, tok) in enumerate([(a, 64, 5), (b, 49, 6)]):
            single, _ = pc.fetch([*p[:n], 0])
            assert max_diff(batched[row], single_continue(model, single, [tok])[0]) == 0.0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "falcon_h1"])
def test_batch_generator_with_restored_caches_equals_single(arch):
    """mlx-lm's BatchGenerator merges restored caches: same tokens and logprobs as alone."""
    model = tiny_model(arch)
    a, b = prompt(1, 70), prompt(2, 60)
    full = [a[:64] + prompt(3, 12), b[:49] + prompt(4, 5)]  # at restore points of a and b
    with hot_pc(model) as pc:
        for p in (a, b):
            pc.prefill(p, prefill_step_size=BLOCK)
        restored = [pc.fetch(p) for p in full]
        gen = BatchGenerator(model, max_tokens=6, prefill_step_size=BLOCK)
        uids = gen.insert(
            [p[n:] for p, (_, n) in zip(full, restored, strict=True)],
            caches=[c for c, _ in restored],
        )
        tokens = {u: [] for u in uids}
        logprobs = {u: [] for u in uids}
        finished = {}
        while len(finished) < len(uids):
            for r in gen.next_generated():
                tokens[r.uid].append(r.token)
                logprobs[r.uid].append(r.logprobs)
                if r.finish_reason is not None:
                    finished[r.uid] = r.prompt_cache
        gen.close()
        for uid, p in zip(uids, full, strict=True):
            cache, num_cached = pc.fetch(p)
            alone = list(
                generate_step(
                    mx.array(p[num_cached:]),
                    model,
                    prompt_cache=cache,
                    prefill_step_size=BLOCK,
                    max_tokens=6,
                )
            )
            assert tokens[uid] == [int(t) for t, _ in alone]
            assert max_diff(mx.stack(logprobs[uid]), mx.stack([lp for _, lp in alone])) == 0.0

        # a finished sequence's cache (extracted from the batch) is stored too
        uid, p = uids[0], full[0]
        done = [*p, *tokens[uid]]  # 64 + 12 + 6: a fifth full block
        finished_cache = finished[uid]
        assert pc.store(done, finished_cache) == 1
        # ... with its tail and every layer's state at its end (window, recurrent state)
        cache, num_cached = pc.fetch([*done, 1])
        assert num_cached == len(done) == 82
        live = single_continue(model, finished_cache, [1])
        assert max_diff(single_continue(model, cache, [1]), live) == 0.0
        # negative control: the other sequence's end state gives other logits
        other, _ = pc.fetch([*full[1], 1])
        assert max_diff(single_continue(model, other, [1]), live) > 0.0
