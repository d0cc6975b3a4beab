"""Warm start: after a restart, pinned blocks and recently used chains come back into hot
in the background (arrays evaluated on its own thread); requests are served meanwhile."""

from __future__ import annotations

import numpy as np
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16
BLOCK_BYTES = 8192


def test_warm_start_loads_pins_then_recent_chains(tmp_path, llama):
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        counters_save_seconds=0,
    )
    prompts = [prompt(i, 4 * BLOCK) for i in range(6)]
    caches = []
    with PrefixCache(llama, cfg, model_id="m") as pc:
        for tokens in prompts:
            cache = make_prompt_cache(llama)
            prefill(llama, tokens, cache, step=BLOCK)
            caches.append(cache)
            pc.store(tokens, cache)
        pc.pin(prompts[0])  # the oldest, but pinned
        pc.fetch(prompts[5][:-1])  # the most recently used
    warm = cfg.replace(warm_bytes=8 * BLOCK_BYTES)
    with PrefixCache(llama, warm, model_id="m") as pc:
        cache, n = pc.fetch(prompts[3])  # served while the warm start may still run
        assert n == len(prompts[3]) - 1
        assert np.array_equal(
            np.array(cache[0].keys[..., :n, :]), np.array(caches[3][0].keys[..., :n, :])
        )
        assert pc.services.warm.done.wait(30)
        st = pc.stats()["warm"]
        assert st["nbytes"] <= 8 * BLOCK_BYTES and st["num_blocks"] >= 4
        keys = {b.key for b in pc.hot}
        from prefixcache.hashing import chain_keys, token_bytes

        root = pc.namespace.root_key()
        pinned = set(chain_keys(root, token_bytes(prompts[0]), BLOCK))
        assert pinned <= keys  # pinned first
        before = pc.stats()
        pc.fetch(prompts[0])
        assert pc.stats()["hot_block_hits"] - before["hot_block_hits"] == 4
    with PrefixCache(llama, cfg, model_id="m") as pc:  # the control: no warm start
        assert len(pc.hot) == 0 and "warm" not in pc.stats()
