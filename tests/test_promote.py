"""Promotion off the request's path: a fetch restored from the SSD tier returns
without copying its blocks into hot; the prefetch thread loads them again and
keeps them in hot while it has room (evicting nothing), and the next fetch of
the prompt is served from hot, exactly."""

from __future__ import annotations

from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16
TOKENS = 8 * BLOCK
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4  # layers x (K, V) x kv heads x tokens x dim x f32


def config(tmp_path, **changes) -> CacheConfig:
    settings = {"block_size": BLOCK, "ssd_dir": str(tmp_path), "write_policy": "write_through"}
    return CacheConfig(**{**settings, **changes})


def on_ssd_only(pc: PrefixCache, model, tokens) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    pc.store(tokens, cache)
    pc.flush()
    pc.trim_hot(0)


def test_the_fetch_returns_before_its_blocks_are_promoted(tmp_path):
    """The test holds the cache's lock over the fetch: the prefetch thread cannot
    promote meanwhile, so hot is still empty when the fetch has returned (the old
    code copied every block into hot inside the fetch)."""
    model = tiny_model("llama")
    tokens = prompt(1, TOKENS)
    with PrefixCache(model, config(tmp_path), model_id="tiny") as pc:
        on_ssd_only(pc, model, tokens)
        with pc._lock:
            _, n = pc.fetch([*tokens, 5])
            assert n == TOKENS
            assert len(pc.hot) == 0
        pc.flush()  # waits for the promotion
        assert len(pc.hot) == TOKENS // BLOCK
        assert pc.stats()["num_promotions"] == TOKENS // BLOCK
        cache, n = pc.fetch([*tokens, 5])
        logits = prefill(model, [5], cache, step=BLOCK)
        stats = pc.stats()
    assert n == TOKENS and stats["hot_block_hits"] == TOKENS // BLOCK
    want = prefill(model, [*tokens, 5], make_prompt_cache(model), step=BLOCK)
    assert max_diff(logits, want) == 0.0


def test_promote_off_keeps_hot_empty(tmp_path):
    """The control: with ``promote=False`` nothing reaches hot and the second fetch
    reads the SSD tier again."""
    model = tiny_model("llama")
    tokens = prompt(2, TOKENS)
    with PrefixCache(model, config(tmp_path, promote=False), model_id="tiny") as pc:
        on_ssd_only(pc, model, tokens)
        pc.fetch(tokens)
        pc.flush()
        assert len(pc.hot) == 0
        pc.fetch(tokens)
        stats = pc.stats()
    assert stats["num_promotions"] == 0
    assert stats["ssd_block_hits"] == 2 * (TOKENS // BLOCK)  # both fetches read every block


def test_promotion_evicts_nothing(tmp_path):
    """Hot holds another chain and room for 3 blocks: 3 are promoted, the other
    chain stays whole."""
    model = tiny_model("llama")
    tokens, other = prompt(3, TOKENS), prompt(4, 4 * BLOCK)
    budget = (4 + 3) * BLOCK_BYTES
    with PrefixCache(model, config(tmp_path, hot_max_bytes=budget), model_id="tiny") as pc:
        on_ssd_only(pc, model, tokens)
        cache = make_prompt_cache(model)
        prefill(model, other, cache, step=BLOCK)
        pc.store(other, cache)
        kept = {b.key for b in pc.hot}
        pc.fetch([*tokens, 5])
        pc.flush()
        assert kept <= {b.key for b in pc.hot}
        assert len(pc.hot) == len(kept) + 3
        assert pc.stats()["num_promotions"] == 3
