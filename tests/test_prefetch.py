"""Prefetch: a queued prompt's lower-tier blocks promoted into hot before its fetch.

A chain stored on the SSD tier (or the remote tier) only, hot emptied; ``prefetch``
brings it into hot on the prefetcher's thread; the fetch then takes every block
from hot and restores exactly what a fetch from the lower tier restores.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16
TOKENS = 8 * BLOCK


def stored(pc: PrefixCache, model, tokens) -> None:
    """``tokens`` stored, written to the lower tiers, hot emptied (as after a restart)."""
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    pc.store(tokens, cache)
    pc.flush()
    pc.trim_hot(0)
    assert len(pc.hot) == 0


def restored_logits(pc: PrefixCache, model, probe) -> tuple[int, mx.array]:
    cache, n = pc.fetch(probe)
    return n, prefill(model, probe[n:], cache, step=BLOCK)


@pytest.fixture
def llama():
    return tiny_model("llama")


def ssd_config(tmp_path, **changes) -> CacheConfig:
    settings = {"block_size": BLOCK, "ssd_dir": str(tmp_path), "write_policy": "write_through"}
    return CacheConfig(**{**settings, **changes})


@pytest.mark.parametrize("prefetched", [True, False], ids=["prefetch", "control"])
def test_a_prefetched_chain_is_restored_from_hot(tmp_path, llama, prefetched):
    tokens = prompt(1, TOKENS)
    probe = [*tokens, 3, 4]
    with PrefixCache(llama, ssd_config(tmp_path), model_id="tiny") as pc:
        stored(pc, llama, tokens)
        if prefetched:
            assert pc.prefetch(probe) == TOKENS // BLOCK
            assert pc.prefetcher.join(timeout=60)
            assert len(pc.hot) == TOKENS // BLOCK
        n, logits = restored_logits(pc, llama, probe)
        stats = pc.stats()
    assert n == TOKENS
    want = prefill(llama, probe, make_prompt_cache(llama), step=BLOCK)
    assert max_diff(logits, want) == 0.0
    hot, ssd = stats["hot_block_hits"], stats["ssd_block_hits"]
    if prefetched:
        assert (hot, ssd) == (TOKENS // BLOCK, 0)
        assert stats["prefetched_blocks"] == stats["prefetch_hits"] == TOKENS // BLOCK
    else:  # the control: the fetch read every block from the SSD tier
        assert (hot, ssd) == (0, TOKENS // BLOCK)
        assert stats["prefetched_blocks"] == 0


def test_a_fetch_cancels_what_is_still_queued_for_its_prompt(tmp_path, llama):
    """Served at once (the fetch comes before the prefetcher got to it): nothing is
    loaded twice. The test holds the cache's lock, so the prefetcher waits."""
    tokens = prompt(2, TOKENS)
    with PrefixCache(llama, ssd_config(tmp_path), model_id="tiny") as pc:
        stored(pc, llama, tokens)
        with pc._lock:
            assert pc.prefetch(tokens) == TOKENS // BLOCK
            _, n = pc.fetch(tokens)
        assert pc.prefetcher.join(timeout=60)
        stats = pc.stats()
    assert n == TOKENS - 1
    assert stats["prefetched_blocks"] == 0 and stats["ssd_block_hits"] == TOKENS // BLOCK


def test_prefetch_is_bounded_and_counts_what_it_wasted(tmp_path, llama):
    tokens = prompt(3, TOKENS)
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # layers x (K, V) x kv heads x tokens x dim x f32
    bound = 3 * block_bytes
    with PrefixCache(llama, ssd_config(tmp_path, prefetch_bytes=bound), model_id="tiny") as pc:
        stored(pc, llama, tokens)
        pc.prefetch(tokens)
        assert pc.prefetcher.join(timeout=60)
        assert pc.stats()["prefetched_blocks"] == 3  # the bound, in blocks
        pc.trim_hot(0)  # evicted before any fetch used them
        pc.fetch(tokens)
        stats = pc.stats()
    assert stats["prefetch_hits"] == 0
    assert stats["prefetch_wasted_bytes"] == bound


def test_nothing_to_prefetch_from_hot_or_for_a_new_prompt(tmp_path, llama):
    tokens = prompt(4, TOKENS)
    with PrefixCache(llama, ssd_config(tmp_path), model_id="tiny") as pc:
        assert pc.prefetch(tokens) == 0  # nothing stored
        cache = make_prompt_cache(llama)
        prefill(llama, tokens, cache, step=BLOCK)
        pc.store(tokens, cache)
        assert pc.prefetch(tokens) == 0  # all in hot already
        with pytest.raises(ValueError, match="tokens is empty"):
            pc.prefetch([])


def test_prefetch_from_the_remote_tier(tmp_path, llama, redis_server):
    tokens = prompt(5, TOKENS)
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=redis_server.url)
    with PrefixCache(llama, config, model_id="tiny") as pc:
        stored(pc, llama, tokens)
        assert pc.prefetch(tokens) == TOKENS // BLOCK
        assert pc.prefetcher.join(timeout=60)
        n, logits = restored_logits(pc, llama, [*tokens, 7])
        stats = pc.stats()
    assert n == TOKENS
    assert stats["hot_block_hits"] == TOKENS // BLOCK and stats["remote_block_hits"] == 0
    assert stats["prefetch_hits"] == TOKENS // BLOCK
    want = prefill(llama, [*tokens, 7], make_prompt_cache(llama), step=BLOCK)
    assert max_diff(logits, want) == 0.0
