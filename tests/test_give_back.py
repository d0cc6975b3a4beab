"""Freed cache memory leaves the process (memory/give_back.py): after a large
``trim_hot``, ``end_session`` or ``close``, MLX's buffer cache holds none of
the freed buffers; the control, with the give-back off, keeps them. RSS itself
is measured by tools/bench_give_back.py."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory import give_back

HEADS, DIM, LAYERS = 8, 128, 2
TOKENS = 2048  # 2 layers x K/V x 8 heads x 2048 x 128 x 4 bytes = 32 MiB per sequence


@pytest.fixture
def model():
    from prefixcache.tiny.models import build_model

    return build_model(
        "llama",
        hidden_size=64,
        head_dim=DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
    )


@pytest.fixture(params=[True, False], ids=["give_back", "control"])
def enabled(request, keep_freed_buffers):
    give_back.set_enabled(request.param)
    yield request.param
    give_back.set_enabled(True)


def fill(pc: PrefixCache, model, num: int, *, session: str | None = None) -> None:
    for seed in range(num):
        cache = make_prompt_cache(model)
        shape = (1, HEADS, TOKENS, DIM)
        for c in cache:
            c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval([c.state for c in cache])
        pc.store([(seed * 31 + i) % 512 for i in range(TOKENS)], cache, session=session)
    gc.collect()


def config() -> CacheConfig:
    return CacheConfig(block_size=256, hot_cache_only=True, hot_max_bytes=1 << 30)


def test_trim_hot_gives_the_freed_buffers_back(model, enabled):
    with PrefixCache(model, config(), model_id="g") as pc:
        fill(pc, model, 4)  # 128 MiB: over the give-back threshold
        mx.clear_cache()
        assert pc.trim_hot(0) > 0
        gc.collect()
        kept = mx.get_cache_memory()
    assert (kept == 0) if enabled else (kept >= give_back.THRESHOLD), kept


def test_end_session_gives_the_freed_buffers_back(model, enabled):
    with PrefixCache(model, config(), model_id="g") as pc:
        fill(pc, model, 4, session="s")
        mx.clear_cache()
        assert pc.end_session("s") > 0
        gc.collect()
        kept = mx.get_cache_memory()
    assert (kept == 0) if enabled else (kept >= give_back.THRESHOLD), kept


def test_close_lets_go_of_hot_and_gives_it_back(model, enabled):
    pc = PrefixCache(model, config(), model_id="g")
    fill(pc, model, 2)
    mx.clear_cache()
    before = mx.get_active_memory()
    pc.close()
    gc.collect()
    assert len(pc.hot) == 0 and pc.stats()["hot"]["nbytes"] > 0  # stats: as at close
    assert mx.get_active_memory() <= before - 60 * (1 << 20)  # the 64 MiB left hot
    kept = mx.get_cache_memory()
    assert (kept == 0) if enabled else (kept > 0), kept
