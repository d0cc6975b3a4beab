"""Pins: a pinned prompt survives 10x its tier's budget of other traffic, in hot and on
SSD, and a restart; a TTL ends the pin, not the blocks; caps refuse pins past them.

"Other traffic" is real blocks of a real model's cache stored under other prompts'
tokens (one prefilled cache reused: eviction only looks at keys and bytes).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import PinCapacityError

BLOCK = 16
BLOCK_BYTES = 8192  # tiny llama: 2 layers x K,V x 2 heads x 16 tokens x 16 dims x fp32
PINNED = 2048  # tokens of the pinned prompt (128 blocks, 1 MiB)
TRAFFIC = 256  # tokens per other prompt


def config(tmp_path, **changes) -> CacheConfig:
    base = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        counters_save_seconds=0,
    )
    return base.replace(**changes)


def filled(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    return cache


def traffic(pc, cache, nbytes: int, seed: int = 1000) -> None:
    """Store other prompts until ``nbytes`` of new blocks went in."""
    for i in range(nbytes // (TRAFFIC // BLOCK * BLOCK_BYTES) + 1):
        pc.store(prompt(seed + i, TRAFFIC), cache)


def restored_exactly(pc, tokens, live) -> tuple[int, int, int]:
    """(tokens restored, hot block hits, ssd block hits) of one fetch; the restored
    keys must equal the live cache's."""
    before = pc.stats()
    cache, n = pc.fetch(tokens)
    after = pc.stats()
    if n:
        want = np.array(live[0].keys[..., :n, :])
        assert np.array_equal(np.array(cache[0].keys[..., :n, :]), want)
    hits = [after[f"{t}_block_hits"] - before[f"{t}_block_hits"] for t in ("hot", "ssd")]
    return n, hits[0], hits[1]


@pytest.fixture(scope="module")
def pinned_prompt(llama):
    tokens = prompt(7, PINNED)
    return tokens, filled(llama, tokens), filled(llama, prompt(8, TRAFFIC))


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "control"])
def test_pinned_prompt_outlives_10x_hot_budget(tmp_path, llama, pinned_prompt, pin):
    tokens, live, other = pinned_prompt
    hot = 2 * PINNED // BLOCK * BLOCK_BYTES  # room for the pin and as much again
    # LRU: newer traffic takes the control's place (cost-aware eviction would keep a
    # deep 2k-token chain over shallower traffic on its own)
    settings = {"hot_cache_only": True, "hot_max_bytes": hot, "eviction": "lru"}
    with PrefixCache(llama, config(tmp_path, **settings)) as pc:
        pc.store(tokens, live)
        if pin:
            assert pc.pin(tokens) == PINNED
        traffic(pc, other, 10 * hot)
        assert pc.stats()["hot"]["num_evictions"] >= 10 * hot // BLOCK_BYTES - hot // BLOCK_BYTES
        n, hot_hits, ssd_hits = restored_exactly(pc, tokens, live)
        if pin:
            assert (n, hot_hits, ssd_hits) == (PINNED - 1, PINNED // BLOCK, 0)
            assert pc.stats()["hot"]["pinned_bytes"] == PINNED // BLOCK * BLOCK_BYTES
        else:
            assert n == 0  # the control: evicted by the traffic


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "control"])
def test_pinned_prompt_outlives_10x_ssd_cap_and_a_restart(tmp_path, llama, pinned_prompt, pin):
    tokens, live, other = pinned_prompt
    cap = 3 * PINNED // BLOCK * BLOCK_BYTES // 2  # the pin's file bytes fit, with headers
    hot = (PINNED // BLOCK + 8) * BLOCK_BYTES  # the pin and 8 blocks of traffic
    # a queue that takes all the traffic at once (the default follows the small hot
    # budget and would drop most of it): every spill reaches the cap
    cfg = config(tmp_path, hot_max_bytes=hot, ssd_max_bytes=cap, write_queue_bytes=64 << 20)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(tokens, live)
        if pin:
            assert pc.pin(tokens) == PINNED  # written to SSD now, pinned in its index
        pc.flush()
        traffic(pc, other, 10 * cap)
        pc.flush()
        ssd = pc.stats()["ssd"]
        offered = (ssd["num_writes"] + ssd["num_no_room"]) * BLOCK_BYTES  # traffic spilled
        assert offered > 9 * cap and ssd["num_evictions"] > 0 and ssd["nbytes"] <= cap
    with PrefixCache(llama, cfg, model_id="m") as pc:  # a restart: pins come from the index
        assert pc.stats()["num_pinned"] == (PINNED // BLOCK if pin else 0)
        n, hot_hits, ssd_hits = restored_exactly(pc, tokens, live)
        if pin:
            assert (n, hot_hits, ssd_hits) == (PINNED - 1, 0, PINNED // BLOCK)
        else:
            assert n < BLOCK  # the control: the SSD tier evicted it


def test_ttl_ends_the_pin_not_the_blocks(tmp_path, llama, pinned_prompt, monkeypatch):
    tokens, live, other = pinned_prompt
    now = [time.time()]
    monkeypatch.setattr(time, "time", lambda: now[0])
    cfg = config(tmp_path, hot_max_bytes=2 * PINNED // BLOCK * BLOCK_BYTES)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(tokens, live)
        assert pc.pin(tokens, ttl=60) == PINNED
        pc.flush()
        assert pc.ssd.stats()["num_pinned"] == PINNED // BLOCK
        now[0] += 61  # the pin has ended; the blocks are all still stored
        assert pc.stats()["num_pinned"] == 0 and pc.match(tokens) == PINNED - 1
        assert pc.ssd.stats()["num_pinned"] == 0
        traffic(pc, other, 4 * cfg.hot_max_bytes)  # now evictable like any block
        pc.flush()
        assert pc.hot.pinned_nbytes() == 0 and pc.stats()["hot"]["num_evictions"] > 0


def test_unpin_and_pin_past_a_cap(tmp_path, llama, pinned_prompt):
    tokens, live, _ = pinned_prompt
    small = PINNED // BLOCK * BLOCK_BYTES // 2  # half the pinned prompt
    with PrefixCache(llama, config(tmp_path, hot_max_bytes=small), model_id="m") as pc:
        pc.store(tokens, live)
        with pytest.raises(PinCapacityError, match="hot_max_bytes=524288"):
            pc.pin(tokens)
        assert pc.stats()["num_pinned"] == 0  # refused whole: nothing pinned
    cfg = config(tmp_path / "b", ssd_max_bytes=small)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(tokens, live)
        with pytest.raises(PinCapacityError, match="ssd_max_bytes=524288"):
            pc.pin(tokens)
        assert pc.stats()["num_pinned"] == 0 and pc.ssd.stats()["num_pinned"] == 0
        assert pc.pin(tokens[: 4 * BLOCK]) == 4 * BLOCK
        assert pc.unpin(tokens[: 4 * BLOCK]) == 4
        assert pc.stats()["num_pinned"] == 0 and pc.ssd.stats()["num_pinned"] == 0
        assert pc.match(tokens) == PINNED - 1  # nothing stored was lost


def test_pin_bad_input_names_the_value(tmp_path, llama):
    with PrefixCache(llama, config(tmp_path, hot_cache_only=True)) as pc:
        with pytest.raises(ValueError, match="empty prompt"):
            pc.pin([])
        with pytest.raises(ValueError, match=r"ttl must be .* got -5"):
            pc.pin([1, 2, 3], ttl=-5)
        assert pc.pin(prompt(3, 40)) == 0  # nothing stored: nothing pinned
