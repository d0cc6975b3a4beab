"""Split attention (shared prefix + private suffix, merged by log-sum-exp) equals
mlx-lm's attention over the joined keys: masks, GQA, windows, packed K/V, sinks,
batches of several prefixes; and the attention hook comes off exactly."""

from __future__ import annotations

import importlib
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from prefixcache.shared import SharedBatchKVCache, SharedKVCache, hook
from prefixcache.shared.attention import Quant
from prefixcache.shared.prefix import LayerKind, LayerPrefix

HQ, HKV, D = 4, 2, 32
SCALE = D**-0.5
TOL = 1e-5


def rand(*shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def prefix_of(n, *, seed, window=None, quant=None, start=0):
    kind = LayerKind(window, quant, ("KVCache", "float32", HKV, D, D), HKV)
    k, v = rand(1, HKV, n, D, seed=seed), rand(1, HKV, n, D, seed=seed + 1)
    if quant is not None:
        k = tuple(mx.quantize(k, group_size=quant.group_size, bits=quant.bits))
        v = tuple(mx.quantize(v, group_size=quant.group_size, bits=quant.bits))
    return LayerPrefix(kind, k, v, start)


def step(cache, n, seed):
    """One attention call as a model makes it: mask, update_and_fetch, attention."""
    b = cache.offset.shape[0] if isinstance(cache.offset, mx.array) else 1
    q = rand(b, HQ, n, D, seed=seed)
    mask = cache.make_mask(n)
    keys, values = cache.update_and_fetch(
        rand(b, HKV, n, D, seed=seed + 1), rand(b, HKV, n, D, seed=seed + 2)
    )
    with hook.hooked():
        out = hook.shared_sdpa(q, keys, values, cache, SCALE, mask)
    return q, keys, values, mask, out


def reference(q, keys, values, mask):
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE, mask=mask)


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("end", [40, 23])  # the whole prefix, or a view of its head
def test_single_equals_joined_keys(n, end):
    prefix = prefix_of(40, seed=1)
    cache = SharedKVCache(prefix.kind, prefix, end, None)
    step(cache, 7, seed=10)  # a suffix already there
    q, keys, values, mask, out = step(cache, n, seed=20)
    assert keys.shape[2] == end + 7 + n  # the lazy joined keys an unshared cache would hold
    assert cache.num_attends == 2 and cache.num_dense == 0
    assert mx.abs(out - reference(q, keys, values, mask)).max().item() < TOL
    # negative control: another prefix gives another attention
    wrong = mx.concatenate([rand(1, HKV, end, D, seed=99), keys[..., end:, :]], axis=2)
    assert mx.abs(out - reference(q, wrong, values, mask)).max().item() > 100 * TOL


@pytest.mark.parametrize("n", [1, 6])
def test_window_layer_masks_by_position(n):
    window = 8
    prefix = prefix_of(window - 1, seed=2, window=window, start=33)  # positions 33..39
    cache = SharedKVCache(prefix.kind, prefix, 40, None)
    step(cache, 3, seed=30)
    q, keys, values, mask, out = step(cache, n, seed=40)
    assert mask.shape == (n, window - 1 + 3 + n)
    assert not mask[:, 0].any().item()  # the oldest prefix key has left the window
    assert mx.abs(out - reference(q, keys, values, mask)).max().item() < TOL
    unmasked = reference(q, keys, values, None)
    assert mx.abs(out - unmasked).max().item() > 100 * TOL  # the window mask matters


def test_quantized_equals_mlx_lm_quantized_attention():
    quant = Quant(group_size=32, bits=8)
    prefix = prefix_of(32, seed=3, quant=quant)
    cache = SharedKVCache(prefix.kind, prefix, 32, None, QuantizedKVCache(32, 8))
    step(cache, 5, seed=50)
    q, keys, values, mask, out = step(cache, 1, seed=60)
    assert isinstance(keys, tuple) and keys[0].dtype == mx.uint32  # packed, never dequantized
    want = quantized_scaled_dot_product_attention(q, keys, values, SCALE, mask, 32, 8)
    assert mx.abs(out - want).max().item() < TOL


def test_sinks():
    prefix = prefix_of(24, seed=4)
    cache = SharedKVCache(prefix.kind, prefix, 24, None)
    step(cache, 4, seed=70)
    q = rand(1, HQ, 1, D, seed=80)
    mask = cache.make_mask(1)
    keys, values = cache.update_and_fetch(rand(1, HKV, 1, D, seed=81), rand(1, HKV, 1, D, seed=82))
    sinks = rand(HQ, seed=83)
    out = hook.shared_sdpa(q, keys, values, cache, SCALE, mask, sinks)
    want = mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=SCALE, mask=mask, sinks=sinks
    )
    assert mx.abs(out - want).max().item() < TOL
    assert mx.abs(out - reference(q, keys, values, mask)).max().item() > 100 * TOL


def test_batch_of_two_prefixes_and_a_row_without():
    a, b = prefix_of(30, seed=5), prefix_of(18, seed=6)
    rows = [
        SharedKVCache(a.kind, a, 30, None),
        SharedKVCache(b.kind, b, 12, None),  # a view of b's head
        SharedKVCache(a.kind, a, 30, None),
        SharedKVCache(a.kind, None, 0, None),  # a sequence with no shared prefix
    ]
    for i, row in enumerate(rows):
        step(row, 2 + 3 * i, seed=100 + i)  # suffixes of different lengths
    batch = SharedKVCache.merge(rows)
    assert isinstance(batch, SharedBatchKVCache)
    q, keys, values, mask, out = step(batch, 3, seed=200)
    assert batch.num_attends == 1 and batch.num_dense == 0
    for i in range(4):  # each row against its own joined keys (those its last query sees)
        seen = mx.array(np.flatnonzero(np.array(mask[i, 0, -1])))
        row_keys, row_values = keys[i : i + 1][..., seen, :], values[i : i + 1][..., seen, :]
        want = reference(q[i : i + 1], row_keys, row_values, "causal")
        assert mx.abs(out[i : i + 1] - want).max().item() < TOL
    # extract gives each row back, its prefix still shared
    single = batch.extract(1)
    assert single.prefix is b and single.offset == 12 + 5 + 3


def test_hook_bypassed_model_still_exact():
    """A model that transforms the fetched keys is left to mlx-lm (counted), from the
    lazily joined keys: still the unshared attention."""
    prefix = prefix_of(20, seed=7)
    cache = SharedKVCache(prefix.kind, prefix, 20, None)
    q = rand(1, HQ, 1, D, seed=300)
    keys, values = cache.update_and_fetch(
        rand(1, HKV, 1, D, seed=301), rand(1, HKV, 1, D, seed=302)
    )
    changed = keys * 1.5
    with hook.hooked():
        out = base.scaled_dot_product_attention(q, changed, values, cache, scale=SCALE, mask=None)
    assert cache.num_dense == 1 and cache.num_attends == 0
    assert mx.abs(out - reference(q, changed, values, None)).max().item() < TOL


def bindings() -> dict[str, object]:
    return {
        name: vars(m)[hook.NAME]
        for name, m in list(sys.modules.items())
        if isinstance(getattr(m, "__dict__", None), dict) and hook.NAME in vars(m)
    }


def test_install_uninstall_restores_every_binding():
    importlib.import_module("mlx_lm.models.llama")
    before = bindings()
    assert before["mlx_lm.models.llama"] is hook.ORIGINAL
    hook.install()
    hook.install()  # a second holder
    try:
        assert vars(sys.modules["mlx_lm.models.llama"])[hook.NAME] is hook.shared_sdpa
        assert base.scaled_dot_product_attention is hook.shared_sdpa
        sys.modules.pop("mlx_lm.models.starcoder2", None)
        late = importlib.import_module("mlx_lm.models.starcoder2")  # binds it while installed
        assert vars(late)[hook.NAME] is hook.shared_sdpa
        hook.uninstall()
        assert hook.installed()  # one holder left
    finally:
        hook.uninstall()
    assert not hook.installed()
    after = bindings()
    assert vars(late)[hook.NAME] is hook.ORIGINAL
    assert {k: v for k, v in after.items() if k != "mlx_lm.models.starcoder2"} == before
    assert all(v is not hook.shared_sdpa for v in after.values())
    with pytest.raises(RuntimeError, match="without a matching install"):
        hook.uninstall()


def test_plain_caches_pass_through_unchanged():
    cache = KVCache()
    q = rand(1, HQ, 3, D, seed=400)
    keys, values = cache.update_and_fetch(
        rand(1, HKV, 3, D, seed=401), rand(1, HKV, 3, D, seed=402)
    )
    with hook.hooked():
        out = base.scaled_dot_product_attention(q, keys, values, cache, scale=SCALE, mask="causal")
    want = reference(q, keys, values, "causal")
    assert mx.array_equal(out, want).item()
