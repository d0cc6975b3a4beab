"""deepseek_v41's LayerCache (window, compressed groups, open rows) through its codec.

The tiny preset has a window-only layer and layers compressing groups of 4 and
16 tokens, so a restore point off a group boundary needs the open group's rows
and every restore needs the compressed rows of all earlier blocks. Exactness
against a live run chunked alike, on the hot and the SSD tier, each with a
negative control.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import max_diff, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.deepseek_v41 import LayerCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.codecs import codec_for
from prefixcache.errors import LayoutMismatchError

BLOCK = 16
ATTRS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")


def run(model, tokens, cache) -> mx.array:
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return logits


def live(model, tokens, ends) -> mx.array:
    cache, start, logits = make_prompt_cache(model), 0, None
    for end in [*ends, len(tokens)]:
        logits = run(model, tokens[start:end], cache)
        start = end
    return logits


def make_pc(model, tier: str, tmp_path) -> PrefixCache:
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, snapshot_interval=4)
    if tier == "ssd":
        config = CacheConfig(
            block_size=BLOCK,
            ssd_dir=str(tmp_path),
            hot_max_bytes=1,
            write_policy="write_through",
            snapshot_interval=4,
        )
    return PrefixCache(model, config, model_id="tiny")


def test_the_preset_has_every_kind_of_layer():
    model = tiny_model("deepseek_v41")
    cache = make_prompt_cache(model)
    run(model, prompt(1, 37), cache)
    assert all(type(c) is LayerCache for c in cache)
    assert cache[0].compress_kv is None and cache[0].pending_kv is None  # window only
    assert cache[1].compress_kv.shape[1] == 9 and cache[1].pending_kv.shape[1] == 1  # r = 4
    assert cache[2].compress_kv.shape[1] == 2 and cache[2].pending_kv.shape[1] == 5  # r = 16
    assert cache[1].index_k.shape[1] == 9


def serve(pc: PrefixCache, model, tokens, junction: int) -> None:
    """A scheduler's loop: chunks of 32 up to ``junction``, a capture there, the rest,
    then ``store`` (the README's checkpoint protocol, with the scheduler's own cut)."""
    cache = make_prompt_cache(model)
    for start, end in zip(ENDS, [*ENDS[1:], junction], strict=True):
        run(model, tokens[start:end], cache)
    pc.capture(tokens[:junction], cache)
    run(model, tokens[junction:], cache)
    pc.store(tokens, cache)


ENDS = [0, 32, 64, 96, 128]  # chunk starts before the junction at 150


@pytest.mark.parametrize("tier", ["hot", "ssd"])
def test_a_prompt_resumes_off_every_group_boundary(tier, tmp_path):
    """150 = 37 groups of 4 and 2, 9 groups of 16 and 6: the open rows come back."""
    model = tiny_model("deepseek_v41")
    system = prompt(1, 150)
    with make_pc(model, tier, tmp_path) as pc:
        serve(pc, model, system + prompt(2, 40), 150)
        pc.flush()
        third = system + prompt(4, 30)
        cache, n = pc.fetch(third)
        assert n == 150
        if tier == "ssd":
            assert pc.stats()["ssd_block_hits"] > 0
        want = live(model, third, [*ENDS[1:], 150])
        assert max_diff(run(model, third[150:], cache), want) == 0.0
        # negative control: another prefix's state at 150, continued alike
        other = prompt(5, 150)
        serve(pc, model, other + prompt(6, 40), 150)
        pc.flush()
        theirs, m = pc.fetch(other + third[150:])
        assert m == 150
        assert max_diff(run(model, third[150:], theirs), want) > 0.0


def test_rebuilt_attributes_equal_the_live_cache():
    """Blocks cut where the cache stands rebuild every attribute bit for bit."""
    model = tiny_model("deepseek_v41")
    tokens = prompt(8, 40)
    cache = make_prompt_cache(model)
    run(model, tokens[:16], cache)
    run(model, tokens[16:40], cache)
    for layer in cache:
        codec = codec_for(layer)
        payloads = [codec.cut(layer, s, min(s + BLOCK, 40), length=40) for s in (0, 16, 32)]
        builder = codec.builder(LayerCache(layer.window_size), 40, 40, BLOCK)
        for index, arrays in enumerate(payloads):
            builder.add(index, arrays)
        rebuilt = builder.finish()
        assert rebuilt.offset == 40
        for name in ATTRS:
            a, b = getattr(layer, name), getattr(rebuilt, name)
            if a is None or a.shape[1] == 0:
                assert b is None or b.shape[1] == 0, name
            else:
                assert np.array_equal(np.array(a), np.array(b)), name


def test_rows_the_cache_let_go_are_refused_not_guessed():
    """Cut at 40, block 1 no longer holds the window or open rows a restore at 24
    needs (the 16-token window moved on, the group of 16 closed at 32)."""
    model = tiny_model("deepseek_v41")
    cache = make_prompt_cache(model)
    run(model, prompt(9, 40), cache)
    layer = cache[2]  # groups of 16
    codec = codec_for(layer)
    payloads = [codec.cut(layer, s, s + BLOCK, length=40) for s in (0, 16)]
    assert "w.pend.kv" not in payloads[1] and "w.keys" not in payloads[1]
    builder = codec.builder(LayerCache(layer.window_size), 24, 24, BLOCK)
    builder.add(0, payloads[0])
    with pytest.raises(LayoutMismatchError):
        builder.add(1, payloads[1])


def test_a_block_upgraded_by_a_later_cut_uses_its_whole_rows():
    """A block cut while the window held it whole (``w.keys``), then given a later
    cut's partial rows (``w.last.*``) too: its whole rows are read from its start."""
    model = tiny_model("deepseek_v41")
    tokens = prompt(10, 40)
    cache = make_prompt_cache(model)
    run(model, tokens[:32], cache)
    codec = codec_for(cache[0])  # the window-only layer: its 16 tokens are [16, 32)
    whole = codec.cut(cache[0], 16, 32, length=32)
    run(model, tokens[32:], cache)
    late = codec.cut(cache[0], 16, 32, length=40)  # the window moved on to [24, 40)
    assert "w.keys" in whole and "w.last.keys" in late
    payloads = [
        codec.cut(cache[0], 0, 16, length=40),
        {**late, **whole},
        codec.cut(cache[0], 32, 40, length=40),
    ]
    builder = codec.builder(LayerCache(cache[0].window_size), 40, 40, BLOCK)
    for index, arrays in enumerate(payloads):
        builder.add(index, arrays)
    rebuilt = builder.finish()
    assert np.array_equal(np.array(rebuilt.window), np.array(cache[0].window))
