"""Restored caches give the live run's logits bit for bit (CPU, same chunking)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import QUANT_LLAMA, live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.hashing import token_bytes

BLOCK = 16
CASES = {
    "llama": ("llama", {}, None),
    "qwen3": ("qwen3", {}, None),
    "llama-kv4": ("llama", QUANT_LLAMA, (4, 32, 0)),
    "llama-kv8": ("llama", QUANT_LLAMA, (8, 32, 0)),
    "llama-kv8-late": ("llama", QUANT_LLAMA, (8, 32, 40)),
    # the hot tier's runs (memory/runs.py): blocks of a store as views of one array
    "llama-runs": ("llama", {}, None),
    "qwen3-runs": ("qwen3", {}, None),
}


def make_pc(model, kv, case: str = "") -> PrefixCache:
    runs = 2 * BLOCK if case.endswith("-runs") else 0  # per block, or runs of 2 blocks
    cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_run_tokens=runs)
    if kv is not None:
        cfg = cfg.replace(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    return PrefixCache(model, cfg, model_id="tiny")


def stored_from(pc, model, tokens, kv) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK, kv=kv)
    pc.store(tokens, cache)


@pytest.mark.parametrize("case", list(CASES))
def test_restore_then_continue_equals_live(case):
    arch, overrides, kv = CASES[case]
    model = tiny_model(arch, **overrides)
    shared = prompt(1, 3 * BLOCK)
    a, b = shared + prompt(2, 21), shared + prompt(3, 13)
    with make_pc(model, kv, case) as pc:
        if kv is not None and kv[2]:
            stored_from(pc, model, shared[: 2 * BLOCK], kv)  # blocks 0-1 stored full precision
        stored_from(pc, model, a, kv)
        # the runs cases restore blocks that are views of runs (of 2 blocks)
        assert any(blk.run is not None for blk in pc.hot) == case.endswith("-runs")
        cache, num_cached = pc.fetch(b)
        assert num_cached == 3 * BLOCK
        if kv is not None:
            assert all(isinstance(c, QuantizedKVCache) for c in cache)
            assert all(c.keys[0].dtype == mx.uint32 for c in cache)  # packed, not dequantized
        else:
            assert all(isinstance(c, KVCache) for c in cache)
        restored = prefill(model, b[num_cached:], cache, step=BLOCK, kv=kv)
        live = live_logits(model, b, num_cached, step=BLOCK, kv=kv)
        assert max_diff(restored, live) == 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_identical(case):
    arch, overrides, kv = CASES[case]
    model = tiny_model(arch, **overrides)
    shared = prompt(4, 3 * BLOCK)
    a, b = shared + prompt(5, 7), shared + prompt(6, 11)
    gen = {"max_tokens": 12, "prefill_step_size": BLOCK}
    if kv is not None:
        gen.update(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    with make_pc(model, kv, case) as pc:
        stored_from(pc, model, a, kv)
        cache, num_cached = pc.fetch(b)
        warm = [
            t for t, _ in generate_step(mx.array(b[num_cached:]), model, prompt_cache=cache, **gen)
        ]
    cold_cache = make_prompt_cache(model)
    cold = [t for t, _ in generate_step(mx.array(b), model, prompt_cache=cold_cache, **gen)]
    assert num_cached == 3 * BLOCK
    assert warm == cold


@pytest.mark.parametrize("case", ["llama", "llama-kv4", "llama-runs"])
def test_negative_control_wrong_prefix_changes_logits(case):
    """Swap another prompt's payload under the right key: the test must notice."""
    arch, overrides, kv = CASES[case]
    model = tiny_model(arch, **overrides)
    shared, other = prompt(7, 3 * BLOCK), prompt(8, 3 * BLOCK)
    b = shared + prompt(9, 10)
    with make_pc(model, kv, case) as pc:
        stored_from(pc, model, shared + prompt(10, 5), kv)
        stored_from(pc, model, other + prompt(10, 5), kv)
        good, _ = pc.fetch(b)
        live = live_logits(model, b, 3 * BLOCK, step=BLOCK, kv=kv)
        assert max_diff(prefill(model, b[48:], good, step=BLOCK, kv=kv), live) == 0.0
        # Corrupt the chain: block 1 of `shared` now carries `other`'s block 1 payload.
        right = next(
            blk for blk in pc.hot if blk.index == 1 and blk.tokens == token_bytes(shared[16:32])
        )
        wrong = next(
            blk for blk in pc.hot if blk.index == 1 and blk.tokens == token_bytes(other[16:32])
        )
        swapped = Block.make(right.key, right.parent, right.root, 1, right.tokens, wrong.arrays)
        pc.hot._lru[right.key] = swapped
        bad, num_cached = pc.fetch(b)
        assert num_cached == 3 * BLOCK
        assert max_diff(prefill(model, b[48:], bad, step=BLOCK, kv=kv), live) > 0.0


def test_a_cache_filled_in_one_chunk_is_written_and_restored(tmp_path):
    """A first prefill chunk of 256 tokens (mlx-lm's buffer step) leaves the
    attention's transposed values as the cache's buffer itself: blocks cut from it
    are still row-major, so the SSD writer takes them and they restore exactly."""
    model = tiny_model("llama")
    tokens = prompt(11, 256)
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    assert not memoryview(cache[0].values).c_contiguous  # the case under test
    config = CacheConfig(
        block_size=BLOCK, ssd_dir=str(tmp_path), write_policy="write_through", hot_max_bytes=1
    )
    with PrefixCache(model, config, model_id="tiny") as pc:
        pc.store(tokens, cache)
        pc.flush()
        ssd = pc.stats()["ssd"]
        assert ssd["num_writes"] == 16 and ssd["num_write_failures"] == 0
        probe = [*tokens, 5, 6]
        restored, n = pc.fetch(probe)
        assert n == 256 and pc.stats()["ssd_block_hits"] == 16
        want = live_logits(model, probe, 256, step=256)
        assert max_diff(prefill(model, probe[256:], restored, step=256), want) == 0.0
