"""The architecture sweep's fast subset: one mlx-lm module per cache-type combination.

Each is built tiny from its ``ModelArgs`` by the sweep's own tables and must
restore a 96-token shared prefix on the hot and the SSD tier with the live
run's logits bit for bit (``tools/sweeplib/check.py``, whose control asks that
another prefix give other logits). The whole sweep is ``make arch-sweep``.
"""

from __future__ import annotations

import os
import sys
from itertools import accumulate

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from sweeplib import configs
from sweeplib.check import SHARED, Chunks, build, check, diff, live, prompt

from prefixcache import CacheConfig, PrefixCache
from prefixcache.codecs import UnusedKVCache
from prefixcache.codecs.arrays import ArraysCodec
from prefixcache.errors import LayoutMismatchError
from prefixcache.tiny.models import build_model

SUBSET = {  # module: the cache classes it makes
    "llama": "KVCache",
    "gemma3_text": "RotatingKVCache KVCache",
    "llama4": "ChunkedKVCache KVCache",
    "mamba2": "ArraysCache",
    "qwen3_next": "ArraysCache KVCache",
    "falcon_h1": "CacheList[ArraysCache,KVCache]",
    "baichuan_m1": "CacheList[ArraysCache,RotatingKVCache] CacheList[ArraysCache,KVCache]",
    "deepseek_v41": "LayerCache",
    "longcat_flash_ngram": "ArraysCache CacheList[KVCache,KVCache]",
    "nemotron-nas": "KVCache",  # a no-op attention layer: its KVCache is never written
}


@pytest.mark.parametrize("arch", SUBSET)
def test_architecture_restores_exactly(arch):
    result = check(arch, 2048)
    assert result.caches == SUBSET[arch]
    assert (result.outcome, result.reused_hot, result.reused_ssd) == ("pass", SHARED, SHARED)
    assert result.max_diff == 0.0


def test_a_state_heavy_hybrid_reuses_from_its_first_sighting():
    """bailing_moe_v3 (three recurrent layers to one attention layer): a snapshot
    (19 KB) outweighs 13 blocks of its K/V (96 bytes a token), so the budgeted
    interval puts no point inside the 96-token prefix; the early points (after 1,
    2, 4 blocks) do, and the second prompt resumes at 64 exactly. Control: the same
    interval set explicitly keeps no early point and reuses nothing. A budget 8
    times larger puts an interval point on the prefix's end."""
    default = check("bailing_moe_v3", 2048)
    assert (default.outcome, default.reused_hot, default.reused_ssd) == ("pass", 64, 64)
    assert default.max_diff == 0.0
    explicit = check("bailing_moe_v3", 2048, interval=13)
    assert (explicit.outcome, explicit.reused_hot, explicit.max_diff) == ("no reuse", 0, 0.0)
    larger = check("bailing_moe_v3", 2048, ratio=8.0)
    assert (larger.outcome, larger.reused_hot, larger.reused_ssd) == ("pass", SHARED, SHARED)
    assert larger.max_diff == 0.0


def test_every_model_module_is_swept():
    """The sweep lists each module that defines a model, and only those."""
    found = [m for m in configs.modules() if configs.has_model(m)]
    assert set(SUBSET) <= set(found)
    assert "cache" not in found and "switch_layers" not in found
    assert len(found) > 100


def test_a_token_history_keeps_its_layout_as_it_grows():
    """longcat_flash_ngram's first cache holds the last n - 1 token ids: 1 wide after
    one token, 3 after more. Its layout must not change with it (the layout is read
    from a one-token probe and checked on every store)."""
    model = build("longcat_flash_ngram")
    cache = model.make_cache()
    model(mx.array([[1]]), cache=cache)
    codec = ArraysCodec()
    short = codec.layout(cache[0])
    model(mx.array([[2, 3, 4, 5]]), cache=cache)
    assert isinstance(cache[0], ArraysCache) and cache[0][0].shape[-1] == 3
    assert codec.layout(cache[0]) == short
    # a recurrent state's width is still part of it
    state = ArraysCache(size=1)
    state[0] = mx.zeros((1, 3, 8))
    wider = ArraysCache(size=1)
    wider[0] = mx.zeros((1, 4, 8))
    assert codec.layout(state) != codec.layout(wider)


def test_a_layer_never_written_is_stored_as_nothing():
    """nemotron-nas's no-op attention layer keeps an empty KVCache: no block carries
    it, a restore gives it back empty. An empty cache in a layer the model writes is
    still refused."""
    model = build("nemotron-nas")
    tokens = list(range(1, 50))
    with PrefixCache(model, CacheConfig(block_size=16, hot_cache_only=True)) as pc:
        assert pc.layout.unused == (1,)
        pc.prefill(tokens)
        assert not any(name.startswith("1.") for block in pc.hot for name in block.arrays)
        cache, n = pc.fetch([*tokens, 7])
        assert n == 49 and isinstance(cache[1], UnusedKVCache) and cache[1].empty()
    llama = build_model("llama")
    with PrefixCache(llama, CacheConfig(block_size=16, hot_cache_only=True)) as pc:
        cache = make_prompt_cache(llama)
        llama(mx.array([tokens]), cache=cache)
        cache[0] = make_prompt_cache(llama)[0]  # a written layer left empty
        with pytest.raises(LayoutMismatchError):
            pc.store(tokens, cache)


@pytest.mark.parametrize(("arch", "step"), [("bailing_moe_v3", 2048), ("llama4", 16)])
def test_the_second_sighting_keeps_the_prefix_for_the_third(arch, step):
    """Where the first prefill keeps no point at the 96-token junction (an early
    point at 64 only), the second prompt keeps the state where it leaves the first,
    so a third prompt restores all 96 tokens, exactly; another prefix's restored
    state differs."""
    model = build(arch)
    shared = prompt(1, SHARED)
    with PrefixCache(model, CacheConfig(block_size=16, hot_cache_only=True)) as pc:
        chunks = Chunks(model)
        pc.model = chunks
        ends, starts = [], []
        for seed in (2, 3):
            chunks.sizes.clear()
            pc.prefill(shared + prompt(seed, 37), prefill_step_size=step)
            starts.append(len(shared) + 37 - sum(chunks.sizes))
            ends.append(list(accumulate(chunks.sizes, initial=starts[-1]))[1:])
        assert starts == [0, 64]  # the second resumed at the early point only
        third = shared + prompt(4, 29)
        chunks.sizes.clear()
        _, logits = pc.prefill(third, prefill_step_size=step)
        reused = len(third) - sum(chunks.sizes)
        assert reused == SHARED
        later = list(accumulate(chunks.sizes, initial=reused))[:-1]
        # the state at 96: the first prompt's chunks to 64, the second's from there
        alike = [e for e in ends[0] if e <= 64] + [e for e in ends[1] if e < SHARED] + later
        want = live(model, third, alike)
        assert diff(logits, want) == 0.0
        other = live(model, prompt(5, SHARED) + third[SHARED:], alike)
        assert diff(other, want) > 0.0
