"""PrefixCache facade: dedup, bad input, isolation, private restores, threads, stats."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    QUANT_LLAMA,
    live_logits,
    max_diff,
    prefill,
    prompt,
    store_fetch_in_threads,
    tiny_model,
)
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, make_prompt_cache

from prefixcache import (
    CacheConfig,
    LayoutMismatchError,
    PrefixCache,
    UnsupportedCacheError,
    prometheus_text,
)

BLOCK = 16


def hot_pc(model, **cfg) -> PrefixCache:
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True).replace(**cfg)
    return PrefixCache(model, config, model_id="tiny")


def filled(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    return cache


def snapshot(pc) -> dict[bytes, list[np.ndarray]]:
    return {b.key: [np.array(a) for a in b.arrays.values()] for b in pc.hot}


def test_store_keeps_only_new_full_blocks(llama):
    shared = prompt(1, 2 * BLOCK)
    a, b = shared + prompt(2, 20), shared + prompt(3, 40)
    with hot_pc(llama) as pc:
        assert pc.store(a, filled(llama, a)) == 3  # 52 tokens -> 3 full blocks (+ a tail)
        assert pc.store(a, filled(llama, a)) == 0  # idempotent
        assert pc.store(b, filled(llama, b)) == 2  # 2 shared blocks deduplicated
        st = pc.stats()
        assert st["stored_blocks"] == 7 and st["hot"]["num_blocks"] == 7  # 5 blocks, 2 tails
        assert pc.match(a) == 51 and pc.match(b) == 71  # tails: one token left to prefill
        assert pc.match(shared + prompt(9, 5)) == 2 * BLOCK
        assert pc.match(prompt(9, 40)) == 0


def test_fully_cached_prompt_leaves_one_token(llama):
    tokens = prompt(4, 3 * BLOCK)
    with hot_pc(llama) as pc:
        pc.store(tokens, filled(llama, tokens))
        cache, num_cached = pc.fetch(tokens)
        assert num_cached == len(tokens) - 1 == cache[0].offset
        assert pc.match(tokens) == len(tokens) - 1
        restored = prefill(llama, tokens[num_cached:], cache)
    live = live_logits(llama, tokens, 0, step=BLOCK)
    assert max_diff(restored, live) < 1e-4  # other chunking: close, not bitwise
    assert max_diff(restored, live_logits(llama, tokens, num_cached, step=BLOCK)) == 0.0


def test_miss_gives_fresh_cache(llama):
    with hot_pc(llama) as pc:
        cache, num_cached = pc.fetch(prompt(5, 40))
        assert num_cached == 0 and all(c.empty() for c in cache)
        st = pc.stats()
        assert st["num_misses"] == 1 and st["miss_reasons"]["no_prefix"] == 1


def test_restored_cache_is_private_and_suffix_writes_in_place(llama):
    tokens = prompt(6, 3 * BLOCK + 5)
    with hot_pc(llama) as pc:
        pc.store(tokens, filled(llama, tokens))
        before = snapshot(pc)
        hot_ids = {id(a) for b in pc.hot for a in b.arrays.values()}
        cache, num_cached = pc.fetch(tokens)
        assert {id(c.keys) for c in cache}.isdisjoint(hot_ids)
        capacity = cache[0].keys.shape[2]
        assert capacity == len(tokens) + CacheConfig().restore_headroom
        prefill(llama, tokens[num_cached:], cache)
        assert cache[0].keys.shape[2] == capacity  # no re-allocation
        cache[0].trim(20)  # trim into the restored blocks, then overwrite them
        prefill(llama, prompt(7, 30), cache)
        after = snapshot(pc)
        assert before.keys() == after.keys()
        for key, arrays in before.items():
            assert all(np.array_equal(x, y) for x, y in zip(arrays, after[key], strict=True))


def test_bad_input_is_refused_and_nothing_stored_changes(llama):
    tokens = prompt(8, 40)
    other = tiny_model("llama", **QUANT_LLAMA)
    with hot_pc(llama) as pc:
        pc.store(tokens, filled(llama, tokens))
        before = snapshot(pc)
        with pytest.raises(ValueError, match="empty"):
            pc.fetch([])
        with pytest.raises(ValueError, match="-3"):
            pc.fetch([1, -3])
        with pytest.raises(TypeError, match=r"0\.5"):
            pc.store([0.5] * 40, filled(llama, tokens))
        with pytest.raises(ValueError, match="holds 40 tokens but 39"):
            pc.store(tokens[:39], filled(llama, tokens))
        with pytest.raises(LayoutMismatchError, match="layout"):
            pc.store(tokens, filled(other, tokens))
        with pytest.raises(LayoutMismatchError, match="1 layers"):
            pc.store(tokens, filled(llama, tokens)[:1])
        with pytest.raises(UnsupportedCacheError, match="ConcatenateKVCache"):
            pc.store(tokens, [ConcatenateKVCache(), KVCache()])
        assert pc.store([], make_prompt_cache(llama)) == 0
        after = snapshot(pc)
        assert before.keys() == after.keys()
        for key, arrays in before.items():
            assert all(np.array_equal(x, y) for x, y in zip(arrays, after[key], strict=True))
        cache, num_cached = pc.fetch(tokens)
        assert num_cached == 39  # 2 blocks + 7 of the tail's 8 tokens
        assert max_diff(prefill(llama, tokens[39:], cache), live_logits(llama, tokens, 39)) == 0


def test_namespaces_isolate(llama):
    tokens = prompt(9, 40)
    with hot_pc(llama) as pc:
        pc.store(tokens, filled(llama, tokens), extra={"adapter": "a"})
        assert pc.match(tokens) == 0
        assert pc.match(tokens, extra={"adapter": "b"}) == 0
        assert pc.match(tokens, extra={"adapter": "a"}) == 39
    other = PrefixCache(llama, CacheConfig(block_size=BLOCK, hot_cache_only=True), model_id="x")
    assert other.namespace.root_key() != hot_pc(llama).namespace.root_key()
    # The default model id fingerprints the weights: other weights, other namespace.
    a = PrefixCache(llama, CacheConfig(hot_cache_only=True))
    b = PrefixCache(tiny_model("llama", seed=1), CacheConfig(hot_cache_only=True))
    assert a.namespace.model_id.startswith("fp:") and a.namespace.model_id != b.namespace.model_id
    assert (
        a.namespace.model_id
        == PrefixCache(llama, CacheConfig(hot_cache_only=True)).namespace.model_id
    )


def test_hot_budget_is_enforced_and_evictions_explained(llama):
    prompts = [prompt(100 + i, 4 * BLOCK) for i in range(6)]
    caches = [filled(llama, p) for p in prompts]
    with hot_pc(llama, hot_max_bytes=6 * 8192) as pc:  # 6 blocks of 8 KiB
        for p, c in zip(prompts, caches, strict=True):
            pc.store(p, c)
            assert pc.stats()["hot"]["nbytes"] <= 6 * 8192
        st = pc.stats()
        assert st["hot"]["num_evictions"] == st["num_discarded"] == 24 - 6
        assert pc.match(prompts[-1]) == 4 * BLOCK - 1
        assert pc.fetch(prompts[0])[1] == 0
        assert pc.stats()["miss_reasons"]["evicted"] == 1


def test_threads_fetch_and_store_concurrently(llama):
    system = prompt(11, 2 * BLOCK)
    users = [system + prompt(20 + i, 2 * BLOCK + 3) for i in range(4)]
    caches = [filled(llama, u) for u in users]
    with hot_pc(llama, hot_max_bytes=10 * 8192) as pc:
        store_fetch_in_threads(pc, users, caches, rounds=15)
        assert pc.stats()["hot"]["nbytes"] <= 10 * 8192


def test_stats_and_prometheus(llama):
    tokens = prompt(12, 40)
    with hot_pc(llama) as pc:
        pc.store(tokens, filled(llama, tokens))
        pc.fetch(tokens)
        pc.fetch(prompt(13, 20))
        st = pc.stats()
        text = prometheus_text(st)
    assert st["num_hits"] == 1 and st["num_misses"] == 1 and st["cached_tokens"] == 39
    assert "prefixcache_hits_total 1" in text
    assert 'prefixcache_misses_by_reason_total{reason="no_prefix"} 1' in text
    assert "prefixcache_hot_bytes " in text


def test_closed_cache_refuses(llama):
    """Every verb of a closed cache raises, the operator controls too."""
    pc = hot_pc(llama)
    pc.close()
    pc.close()  # idempotent
    tokens = [1, 2, 3]
    verbs = {
        "fetch": lambda: pc.fetch(tokens),
        "fetch shared": lambda: pc.fetch(tokens, shared=True),
        "match": lambda: pc.match(tokens),
        "prefetch": lambda: pc.prefetch(tokens),
        "store": lambda: pc.store(tokens, make_prompt_cache(llama)),
        "stored_prefix": lambda: pc.stored_prefix(tokens),
        "capture": lambda: pc.capture(tokens, make_prompt_cache(llama)),
        "pin": lambda: pc.pin(tokens),
        "unpin": lambda: pc.unpin(tokens),
        "end_session": lambda: pc.end_session("s"),
        "trim_hot": lambda: pc.trim_hot(0),
    }
    for name, call in verbs.items():
        with pytest.raises(RuntimeError, match="closed"):
            call()
            pytest.fail(f"{name} ran on a closed cache")


def test_stats_after_close_are_those_at_close(llama, tmp_path):
    """``with PrefixCache(...) as pc: ...`` then ``pc.stats()``: the counters at close,
    the SSD tier's included (its LMDB environment is closed by then)."""
    tokens = prompt(5, 40)
    with PrefixCache(llama, CacheConfig(block_size=BLOCK, ssd_dir=str(tmp_path))) as pc:
        pc.store(tokens, filled(llama, tokens))
        pc.fetch(tokens)
        live = pc.stats()
    after = pc.stats()
    assert after["num_hits"] == live["num_hits"] == 1
    assert after["ssd"]["nbytes"] > 0  # flushed at close
    pc.close()
    assert pc.stats() == after


def test_hot_restore_reads_no_view_of_the_live_cache(llama):
    """Blocks own their memory: dropping the live cache frees it."""
    tokens = prompt(14, 8 * BLOCK)
    with hot_pc(llama) as pc:
        cache = filled(llama, tokens)
        mx.eval([c.state for c in cache])
        pc.store(tokens, cache)
        held = mx.get_active_memory()
        del cache
        import gc

        gc.collect()
        freed = held - mx.get_active_memory()
        assert freed >= 2 * 2 * 256 * 2 * 16 * 4  # the live buffers (256-step) are gone


def test_quantized_cache_must_match_kv_bits():
    model = tiny_model("llama", **QUANT_LLAMA)
    tokens = prompt(15, 40)
    quant = [c.to_quantized(group_size=32, bits=8) for c in filled(model, tokens)]
    with hot_pc(model) as pc, pytest.raises(LayoutMismatchError, match="bits=8"):
        pc.store(tokens, quant)
    with hot_pc(model, kv_bits=4, kv_group_size=32) as pc:
        with pytest.raises(LayoutMismatchError, match="kv_bits=4"):
            pc.store(tokens, quant)
        assert (
            pc.store(tokens, [c.to_quantized(group_size=32, bits=4) for c in filled(model, tokens)])
            == 2
        )


def test_a_prompt_longer_than_the_hot_budget_keeps_its_first_blocks(llama):
    tokens = prompt(16, 6 * BLOCK)
    with hot_pc(llama, hot_max_bytes=2 * 8192) as pc:
        pc.store(tokens, filled(llama, tokens))
        st = pc.stats()
        assert st["hot"]["num_blocks"] == 2 and st["num_discarded"] == 4
        assert pc.match(tokens) == 2 * BLOCK  # the kept blocks are reachable
