"""The restore benchmarks' model shapes (tools/shapes.py): each preset builds a model of
its layer kinds and a cache of its sizes, and a hot and an SSD restore of that cache
give back its bytes exactly (the control: another filling differs)."""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from benchlib import tier_config
from shapes import RESTORE_SHAPES, cache_bytes, filled_cache, model_for, named

from prefixcache import PrefixCache

BLOCK, TOKENS = 16, 64  # fewer than gpt-oss's 128-token window


def contents(cache, num_tokens: int) -> list[np.ndarray]:
    """Each layer's bytes: its tokens' K/V (fewer than a window: no ring wrapped yet),
    or its state."""
    out = []
    for c in cache:
        arrays = c.cache if type(c) is ArraysCache else (c.keys, c.values)
        for a in arrays:
            if type(c) is not ArraysCache:
                a = mx.contiguous(a[..., :num_tokens, :])
            out.append(np.asarray(memoryview(a.astype(mx.float32))))
    return out


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", RESTORE_SHAPES)
def test_a_shape_restores_its_cache_exactly(name, tmp_path):
    shape = named([name])[0]
    model = model_for(shape)
    tokens = list(range(1, TOKENS + 1))
    stored = filled_cache(shape, model, TOKENS)
    other = filled_cache(shape, model, TOKENS)  # new random values: the control
    assert cache_bytes(stored, TOKENS, BLOCK) > 0
    kinds = {type(c) for c in stored}
    assert kinds <= {KVCache, RotatingKVCache, ArraysCache}
    assert (RotatingKVCache in kinds) == bool(shape.window_layers)
    assert (ArraysCache in kinds) == bool(shape.recurrent_layers)
    want, control = contents(stored, TOKENS), contents(other, TOKENS)
    assert not same(want, control)
    for tier in ("hot", "ssd"):
        cfg = tier_config(tier, BLOCK, str(tmp_path / f"ssd-{tier}"))
        with PrefixCache(model, cfg, model_id="shapes") as pc:
            pc.store(tokens, stored)
            pc.flush()
            cache, num = pc.fetch([*tokens, 0])
        assert num == TOKENS, (tier, num)
        assert same(contents(cache, TOKENS), want), tier
