"""A restored cache mlx-lm's batch takes as it is (prefixcache/serve/batch.py).

A batch of one restored cache uses the restore's buffer and the prefill writes
into it in place; several caches merge as mlx-lm merges them. Either way the
batch gives the same tokens and logits as mlx-lm's own merge, bit for bit,
whatever the unwritten headroom holds.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import max_diff, prompt, tiny_model
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from test_batch import merge as merged  # as mlx-lm's BatchGenerator merges

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory.host import host_view
from prefixcache.serve.batch import batch_ready
from prefixcache.serve.prompt_cache import TieredPromptCache

BLOCK = 16


def restored(pc: PrefixCache, tokens: list[int], cached: int, *, ready: bool) -> list:
    cache, num_cached = pc.fetch(tokens)
    assert num_cached == cached
    if ready:
        batch_ready(cache)
    return cache


def address(x: mx.array) -> int:
    return host_view(x).ctypes.data


def poison_headroom(cache: list, num_tokens: int) -> None:
    """NaN in every restored buffer past its tokens: a read of the headroom shows."""
    for layer in cache:
        for x in (layer.keys, layer.values):
            assert x.shape[2] > num_tokens  # there is headroom to poison
            host_view(x)[:, :, num_tokens:, :] = 0xFF  # NaN in float32, float16, bfloat16


@pytest.fixture
def pc():
    model = tiny_model("llama")
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, restore_headroom=1)
    with PrefixCache(model, config, model_id="tiny") as pc:
        pc.prefill(prompt(1, 64), prefill_step_size=BLOCK)
        pc.prefill(prompt(2, 48), prefill_step_size=BLOCK)
        yield pc


def test_one_restored_cache_is_the_batch_and_the_prefill_writes_in_place(pc):
    model = pc.layout.model
    tokens = [*prompt(1, 64), *prompt(3, 20)]
    for ready in (True, False):  # False: mlx-lm's merge, the negative control
        cache = restored(pc, tokens, 64, ready=ready)
        assert all(type(c) is KVCache for c in cache)  # still mlx-lm's class
        buffers = [address(c.keys) for c in cache]
        batch = merged([cache])
        assert all(type(b) is BatchKVCache for b in batch)
        model(mx.array([tokens[64:]]), cache=batch)
        mx.eval([b.state for b in batch])
        same = [address(b.keys) == a for b, a in zip(batch, buffers, strict=True)]
        assert all(same) if ready else not any(same)
        assert [b._idx for b in batch] == [84] * len(batch)


def generate(model, caches: list[list], rests: list[list[int]]) -> tuple[list, list]:
    gen = BatchGenerator(model, max_tokens=6, prefill_step_size=BLOCK)
    uids = gen.insert(rests, caches=caches)
    tokens = {u: [] for u in uids}
    logprobs = {u: [] for u in uids}
    done = 0
    while done < len(uids):
        for r in gen.next_generated():
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
            done += r.finish_reason is not None
    gen.close()
    return [tokens[u] for u in uids], [mx.stack(logprobs[u]) for u in uids]


@pytest.mark.parametrize("count", [1, 2])
def test_batch_gives_mlx_lm_merges_tokens_and_logits(pc, count):
    """One cache (taken as is) or two (merged with left padding): the same replies
    and logprobs as with mlx-lm's merge, with NaN in the restored headroom."""
    model = pc.layout.model
    prompts = [[*prompt(1, 64), *prompt(4, 21)], [*prompt(2, 48), *prompt(5, 9)]][:count]
    cached = [64, 48][:count]
    rests = [p[n:] for p, n in zip(prompts, cached, strict=True)]
    ours = [restored(pc, p, n, ready=True) for p, n in zip(prompts, cached, strict=True)]
    for cache, n in zip(ours, cached, strict=True):
        poison_headroom(cache, n)
    theirs = [restored(pc, p, n, ready=False) for p, n in zip(prompts, cached, strict=True)]
    got, expected = generate(model, ours, rests), generate(model, theirs, rests)
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1], strict=True):
        assert max_diff(a, b) == 0.0


def test_a_batch_that_read_the_headroom_would_show(pc):
    """Negative control: a batch of one counting one token more reads a NaN."""
    model = pc.layout.model
    tokens = [*prompt(1, 64), *prompt(3, 5)]
    cache = restored(pc, tokens, 64, ready=True)
    poison_headroom(cache, 64)
    batch = merged([cache])
    for b in batch:
        b._idx += 1
        b.offset = b.offset + 1
    logits = model(mx.array([tokens[64:]]), cache=batch)
    assert mx.isnan(logits).any().item()


def test_two_caches_merge_as_mlx_lm_merges_them(pc):
    a = restored(pc, [*prompt(1, 64), 1], 64, ready=True)
    b = restored(pc, [*prompt(2, 48), 2], 48, ready=True)
    ours = merged([a, b])
    theirs = [BatchKVCache.merge([x, y]) for x, y in zip(a, b, strict=True)]
    for x, y in zip(ours, theirs, strict=True):
        assert x._idx == y._idx == 64
        assert x.left_padding.tolist() == y.left_padding.tolist() == [0, 16]
        assert mx.array_equal(x.keys, y.keys).item() and mx.array_equal(x.values, y.values).item()


def test_the_server_adapter_hands_the_batch_its_buffer():
    model = tiny_model("llama")
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, restore_headroom=1)
    first, tokens = prompt(1, 64), [*prompt(1, 64), *prompt(3, 7)]
    key = ("/models/tiny", None, None)
    with TieredPromptCache(lambda key: model, config) as tiered:
        assert tiered.fetch_nearest_cache(key, first) == (None, first)  # a miss
        live = make_prompt_cache(model)
        model(mx.array([first]), cache=live)
        tiered.insert_cache(key, first, live)
        cache, rest = tiered.fetch_nearest_cache(key, tokens)
        assert rest == tokens[64:]
        buffers = [address(c.keys) for c in cache]
        batch = merged([cache])
        model(mx.array([rest]), cache=batch)
        mx.eval([b.state for b in batch])
        assert [address(b.keys) for b in batch] == buffers


def staggered(model, caches: list[list], rests: list[list[int]]) -> list[list[int]]:
    """The second prompt joins after the first's third token: its batch extends the
    one decoding (``BatchKVCache.extend``). Tokens and logprobs per prompt."""
    gen = BatchGenerator(model, max_tokens=6, prefill_step_size=BLOCK)
    uids = gen.insert(rests[:1], caches=caches[:1])
    out = {}
    while sum(len(v) for v in out.values()) < 3:
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append((r.token, r.logprobs))
    uids += gen.insert(rests[1:], caches=caches[1:])
    done = 0
    while done < 2:
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append((r.token, r.logprobs))
            done += r.finish_reason is not None
    gen.close()
    return [out[u] for u in uids]


def test_a_restored_prompt_joining_a_decoding_batch_gives_mlx_lm_merges_replies(pc):
    model = pc.layout.model
    prompts = [[*prompt(1, 64), *prompt(4, 21)], [*prompt(2, 48), *prompt(5, 9)]]
    rests = [prompts[0][64:], prompts[1][48:]]
    ours = [restored(pc, p, n, ready=True) for p, n in zip(prompts, (64, 48), strict=True)]
    for cache, n in zip(ours, (64, 48), strict=True):
        poison_headroom(cache, n)
    theirs = [restored(pc, p, n, ready=False) for p, n in zip(prompts, (64, 48), strict=True)]
    got, expected = staggered(model, ours, rests), staggered(model, theirs, rests)
    for a, b in zip(got, expected, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b] and len(a) == 6
        assert max_diff(mx.stack([lp for _, lp in a]), mx.stack([lp for _, lp in b])) == 0.0
