"""Sequences kept whole (tiers/recent.py): a cache handed over at store is fetched as
views of its arrays, bit-exact, never changed by later writes on either side, and
its bytes count in the hot tier and go before any block."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import live_logits, max_diff, prefill, prompt
from mlx_lm.models.cache import make_prompt_cache
from test_server import KEY, NoCache, conversations, serve_batched, serve_single

from prefixcache import PrefixCache
from prefixcache.config import CacheConfig
from prefixcache.serve.prompt_cache import TieredPromptCache

HOT = CacheConfig(block_size=16, hot_cache_only=True, restore_headroom=0)


def address(x: mx.array) -> int:
    """Where ``x``'s first element lies in memory (a view shares its base's)."""
    return np.asarray(memoryview(x)).__array_interface__["data"][0]


def filled(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    return cache


def hot(pc) -> dict:
    return pc.stats()["hot"]


def test_fetch_of_a_handed_over_sequence_is_views_and_live_run_exact(llama):
    tokens, rest = prompt(1, 72), prompt(2, 20)  # 4 full blocks and a tail of 8
    cache = filled(llama, tokens)
    with PrefixCache(llama, HOT) as pc, PrefixCache(llama, HOT) as blocks:
        pc.store(tokens, cache, hand_over=True)
        blocks.store(tokens, cache)  # the same cache, not handed over: copied from blocks
        got, n = pc.fetch(tokens + rest)
        ref, m = blocks.fetch(tokens + rest)
        assert n == m == 72
        assert hot(pc)["num_recent"] == 1 and hot(pc)["num_recent_hits"] == 1
        assert hot(blocks)["num_recent"] == 0 and hot(blocks)["num_recent_hits"] == 0
        assert address(got[0].keys) == address(cache[0].keys)  # no copy
        assert address(ref[0].keys) != address(cache[0].keys)  # control: a copy
        live = live_logits(llama, tokens + rest, 72)
        assert max_diff(prefill(llama, rest, got), live) == 0.0
        assert max_diff(prefill(llama, rest, ref), live) == 0.0
        # negative control: the same rest after another prefix gives other logits
        assert max_diff(live_logits(llama, prompt(3, 72) + rest, 72), live) > 0


def test_writes_on_either_side_never_reach_the_other(llama):
    tokens = prompt(4, 64)
    cache = filled(llama, tokens)
    before = [np.array(c.keys[..., :64, :]) for c in cache]
    with PrefixCache(llama, HOT) as pc:
        pc.store(tokens, cache, hand_over=True)
        for c in cache:  # the caller goes on writing into its cache, in place
            c.trim(c.offset - 40)
        prefill(llama, prompt(5, 8), cache)
        # control: the caller's cache did change where it wrote
        assert not np.array_equal(np.array(cache[0].keys[..., :64, :]), before[0])
        got, n = pc.fetch([*tokens, 1])
        assert n == 64 and hot(pc)["num_recent_hits"] == 1
        assert all(np.array_equal(np.array(g.keys), b) for g, b in zip(got, before, strict=True))
        for g in got:  # and the fetcher writes into what it got
            g.trim(30)
        prefill(llama, prompt(6, 8), got)
        again, _ = pc.fetch([*tokens, 1])
        assert hot(pc)["num_recent_hits"] == 2
        assert all(np.array_equal(np.array(a.keys), b) for a, b in zip(again, before, strict=True))


def test_kept_bytes_count_in_hot_and_go_before_any_block(llama):
    a, b = prompt(7, 48), prompt(8, 48)
    ca, cb = filled(llama, a), filled(llama, b)
    whole = sum(c.keys.nbytes + c.values.nbytes for c in ca)
    with PrefixCache(llama, HOT) as pc:
        pc.store(a, ca, hand_over=True)
        pc.store(b, cb, hand_over=True)
        stats = hot(pc)
        blocks_bytes = stats["nbytes"] - stats["recent_bytes"]
        assert stats["num_recent"] == 2 and stats["recent_bytes"] == 2 * whole
        pc.trim_hot(stats["nbytes"] - 1)  # one sequence goes (the older), no block
        assert hot(pc)["num_recent"] == 1 and hot(pc)["num_blocks"] == stats["num_blocks"]
        assert pc.fetch([*b, 1])[1] == 48 and hot(pc)["num_recent_hits"] == 1
        assert pc.fetch([*a, 1])[1] == 48 and hot(pc)["num_recent_hits"] == 1  # from blocks
        pc.trim_hot(blocks_bytes)
        assert hot(pc)["num_recent"] == 0 and hot(pc)["nbytes"] == blocks_bytes
        assert hot(pc)["num_evictions"] == 0 and hot(pc)["num_blocks"] == stats["num_blocks"]
        pc.trim_hot(blocks_bytes - 1)  # control: below that, blocks go
        assert hot(pc)["num_evictions"] > 0


def test_a_sequence_is_kept_only_in_the_room_blocks_leave(llama):
    tokens = prompt(9, 48)
    cache = filled(llama, tokens)
    with PrefixCache(llama, HOT) as probe:
        probe.store(tokens, cache)
        blocks_bytes = hot(probe)["nbytes"]
    with PrefixCache(llama, HOT.replace(hot_max_bytes=blocks_bytes + 1024)) as pc:
        pc.store(tokens, cache, hand_over=True)
        assert hot(pc)["num_recent"] == 0 and hot(pc)["num_evictions"] == 0
        assert hot(pc)["nbytes"] == blocks_bytes
    # control: room for the buffers (256 tokens each, from prefill's steps)
    with PrefixCache(llama, HOT.replace(hot_max_bytes=8 * blocks_bytes)) as pc:
        pc.store(tokens, cache, hand_over=True)
        assert hot(pc)["num_recent"] == 1


def test_leaving_blocks_take_their_sequence_with_them(llama):
    tokens = prompt(10, 48)
    cache = filled(llama, tokens)
    with PrefixCache(llama, HOT) as pc:
        pc.store(tokens, cache, hand_over=True, session="s")
        assert hot(pc)["num_recent"] == 1
        assert pc.end_session("s") > 0
        assert hot(pc)["num_recent"] == 0 and hot(pc)["nbytes"] == 0
        assert pc.fetch([*tokens, 1])[1] == 0


def test_a_longer_sequence_replaces_the_one_it_extends(llama):
    tokens = prompt(11, 80)
    with PrefixCache(llama, HOT) as pc:
        pc.store(tokens[:40], filled(llama, tokens[:40]), hand_over=True)
        pc.store(tokens, filled(llama, tokens), hand_over=True)
        assert hot(pc)["num_recent"] == 1
        pc.store(tokens[:40], filled(llama, tokens[:40]), hand_over=True)  # covered: not kept
        assert hot(pc)["num_recent"] == 1
        got, n = pc.fetch([*tokens[:40], 1])
        assert n == 40 and got[0].offset == 40 and hot(pc)["num_recent_hits"] == 1


@pytest.mark.parametrize("config", [HOT.replace(restore_headroom=256), HOT], ids=str)
def test_kept_only_when_handed_over_with_no_headroom(llama, config):
    tokens = prompt(12, 48)
    cache = filled(llama, tokens)
    with PrefixCache(llama, config) as pc:
        pc.store(tokens, cache)
        assert hot(pc)["num_recent"] == 0
        pc.store(tokens, cache, hand_over=True)
        assert hot(pc)["num_recent"] == (0 if config.restore_headroom else 1)


@pytest.mark.parametrize("serve", [serve_batched, serve_single])
def test_server_inserts_are_kept_and_fetched_exact(llama, serve):
    cold, _ = conversations(serve, NoCache(), llama)
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        ours, cached = conversations(serve, tiered, llama)
        stats = tiered.stats()["hot"]
    assert ours == cold
    assert stats["num_recent_hits"] >= 2 and sum(cached) > 0


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_a_shared_prefix_server_keeps_no_sequence(llama, shared):
    tokens = prompt(13, 48)
    with TieredPromptCache(lambda key: llama, HOT, shared=shared) as tiered:
        tiered.insert_cache(KEY, tokens, filled(llama, tokens))
        assert tiered.stats()["hot"]["num_recent"] == (0 if shared else 1)  # shared reads none
