"""Exactness matrix over every mlx-lm cache type, through the hot tier, the SSD tier
and a test-only tier written against the tier contract alone (dict_tier.py).

Each case stores one prompt with ``PrefixCache.prefill`` (one-block chunks,
a checkpoint at every boundary), then serves a second prompt sharing 3.5
blocks (longer than gemma3's 16-token window and llama4's 32-token chunk):
the restored and continued logits must equal a live run under the same
chunking bit for bit. The second prompt's prefill keeps the state where it
leaves the first (a checkpoint), so a third prompt sharing as much resumes
there on every layout: greedy decoding through mlx-lm's generate_step from
it must match a cold run, and a wrong prompt's window / recurrent / chunked
payload must change the logits.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import QUANT_LLAMA, QUANT_LLAMA4, max_diff, prompt, tiny_model
from dict_tier import DictTier
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache.capture import chunk_ends
from prefixcache.codecs import buffer, codec_for, round_up
from prefixcache.memory import restore_buffers

BLOCK = 16
STEP = 16  # one block per chunk: every boundary gets its recurrent snapshot
SHARED = 56  # 3 full blocks and 8 tokens of the 4th in common, then the prompts differ
CACHED = 48  # what a recurrent model reuses: its state exists at block boundaries only

CASES = {
    "llama": ("llama", {}, None),
    "qwen3": ("qwen3", {}, None),
    "gemma3_text": ("gemma3_text", {}, None),
    "qwen3_next": ("qwen3_next", {}, None),
    "lfm2": ("lfm2", {}, None),
    "mamba2": ("mamba2", {}, None),
    "llama4": ("llama4", {}, None),
    "falcon_h1": ("falcon_h1", {}, None),
    "llama-kv4": ("llama", QUANT_LLAMA, (4, 32, 40)),  # (bits, group size, start)
    "llama-kv8": ("llama", QUANT_LLAMA, (8, 32, 40)),
    "llama4-kv4": ("llama4", QUANT_LLAMA4, (4, 32, 40)),  # chunked and quantized layers
    "llama4-kv8": ("llama4", QUANT_LLAMA4, (8, 32, 40)),
}
STATEFUL = (RotatingKVCache, ArraysCache, ChunkedKVCache)


def make_pc(model, kv, tier: str, tmp_path) -> PrefixCache:
    quant = {} if kv is None else dict(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    quant["snapshot_interval"] = 1  # every boundary: the matrix restores at block 3
    if tier == "hot":
        config = CacheConfig(block_size=BLOCK, hot_cache_only=True, **quant)
    elif tier == "remote":  # the test-only tier under a 1-byte hot tier
        config = CacheConfig(block_size=BLOCK, hot_max_bytes=1, **quant)
        return PrefixCache(model, config, model_id="tiny", tiers=[DictTier()])
    else:  # a 1-byte hot tier: every block is written to and served from the SSD tier
        config = CacheConfig(
            block_size=BLOCK, hot_cache_only=False, ssd_dir=str(tmp_path), hot_max_bytes=1, **quant
        )
    return PrefixCache(model, config, model_id="tiny")


def live(model, tokens, *, kv=None, split: int = 0, cuts=()) -> mx.array:
    """Last logits of a cold run chunked as PrefixCache.prefill chunks it (``cuts``:
    its checkpoints)."""
    cache = make_prompt_cache(model)
    pos, logits = 0, None
    ends = {*chunk_ends(0, split, STEP), *chunk_ends(split, len(tokens), STEP), *cuts}
    for end in sorted(ends):
        logits = model(mx.array([tokens[pos:end]]), cache=cache)[:, -1, :]
        if kv is not None:
            maybe_quantize_kv_cache(cache, kv[2], kv[1], kv[0])
        mx.eval(logits, [c.state for c in cache])
        pos = end
    return logits


def live_prefill(model, tokens, cache, kv=None) -> None:
    """Prefill ``tokens`` cold in prefill's chunks (as the stored prompts were)."""
    continue_from(model, cache, tokens, 0, kv)


def continue_from(model, cache, tokens, start: int, kv=None) -> mx.array:
    logits = None
    for end in chunk_ends(start, len(tokens), STEP):
        logits = model(mx.array([tokens[start:end]]), cache=cache)[:, -1, :]
        if kv is not None:
            maybe_quantize_kv_cache(cache, kv[2], kv[1], kv[0])
        mx.eval(logits, [c.state for c in cache])
        start = end
    return logits


def greedy(model, tokens, cache, kv, n: int = 8) -> tuple[list[int], mx.array]:
    quant = {} if kv is None else dict(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    out, logprobs = [], []
    steps = generate_step(
        mx.array(tokens), model, prompt_cache=cache, prefill_step_size=STEP, max_tokens=n, **quant
    )
    for token, lp in steps:
        out.append(int(token))
        logprobs.append(lp)
    return out, mx.stack(logprobs)


def swap_stateful(cache, other) -> int:
    """Put ``other``'s window / recurrent / chunked layers into ``cache`` (all layers if none)."""
    swapped = 0
    for i, (mine, theirs) in enumerate(zip(cache, other, strict=True)):
        if isinstance(mine, CacheList):
            parts = list(mine.caches)
            for j, part in enumerate(parts):
                if isinstance(part, STATEFUL):
                    parts[j] = theirs.caches[j]
                    swapped += 1
            mine.caches = tuple(parts)
        elif isinstance(mine, STATEFUL):
            cache[i] = theirs
            swapped += 1
    if not swapped:
        cache[:] = other
    return swapped or len(cache)


@pytest.fixture(params=["hot", "hot-allocated", "ssd", "remote"])
def tier(request, monkeypatch):
    if request.param == "hot-allocated":  # every buffer made as a large restore's:
        monkeypatch.setattr(buffer, "SMALL", 0)  # allocated by MLX, written in place
        monkeypatch.setattr(restore_buffers, "SMALL", 0)
        return "hot"
    return request.param


@pytest.mark.parametrize("case", CASES)
def test_restore_continue_generate_exact(case, tier, tmp_path):
    arch, overrides, kv = CASES[case]
    model = tiny_model(arch, **overrides)
    shared = prompt(1, SHARED)
    a, b, c, wrong = (shared + prompt(s, 27 + s) for s in (2, 3, 4, 5))
    wrong = prompt(6, SHARED) + prompt(7, 20)
    # a trimmable cache reuses the shared part of a's block 3 (cut back) from any tier:
    # each lists the children of block 2 (DictTier too: the contract, not a built-in)
    recurrent = any(not x.is_trimmable() for x in make_prompt_cache(model))
    cached = CACHED if recurrent else SHARED
    with make_pc(model, kv, tier, tmp_path) as pc:
        pc.prefill(a, prefill_step_size=STEP)
        pc.prefill(wrong, prefill_step_size=STEP)
        pc.flush()
        cuts = pc.checkpoints(b, cached)  # where b's prefill will cut chunks and capture
        cache, logits = pc.prefill(b, prefill_step_size=STEP)
        stats = pc.stats()
        assert stats["cached_tokens"] == cached
        assert stats[f"{tier}_block_hits"] >= 1  # mamba2 needs only the last snapshot
        if kv is not None:
            assert any(isinstance(x, QuantizedKVCache) for x in cache)
        assert max_diff(logits, live(model, b, kv=kv, split=cached, cuts=cuts)) == 0.0

        # greedy decoding through mlx-lm's own loop, against a cold run chunked alike;
        # b's prefill kept the state where it left a (a checkpoint): c resumes there
        restored, num_cached = pc.fetch(c)
        assert num_cached == SHARED
        tokens, logprobs = greedy(model, c[num_cached:], restored, kv)
        cold = make_prompt_cache(model)
        if num_cached:
            live_prefill(model, c[:num_cached], cold, kv)
        cold_tokens, cold_logprobs = greedy(model, c[num_cached:], cold, kv)
        assert tokens == cold_tokens
        assert max_diff(logprobs, cold_logprobs) == 0.0

        # negative control: the other prompt's stateful payload changes the logits
        mine, _ = pc.fetch(b[: CACHED + 1])
        theirs, num_theirs = pc.fetch(wrong[: CACHED + 1])
        assert num_theirs == CACHED
        assert swap_stateful(mine, theirs) > 0
        assert max_diff(continue_from(model, mine, b, CACHED, kv), logits) > 0.0


def test_cached_layout_is_as_expected():
    """The presets really exercise the cache classes the matrix is about."""
    kinds = {
        arch: {type(c).__name__ for c in make_prompt_cache(tiny_model(arch, **ov))}
        for arch, ov, _ in CASES.values()
    }
    assert kinds["gemma3_text"] == {"RotatingKVCache", "KVCache"}
    assert kinds["qwen3_next"] == {"ArraysCache", "KVCache"}
    assert kinds["lfm2"] == {"ArraysCache", "KVCache"}
    assert kinds["mamba2"] == {"ArraysCache"}
    assert kinds["llama4"] == {"ChunkedKVCache", "KVCache"}
    assert kinds["falcon_h1"] == {"CacheList"}
    window = make_prompt_cache(tiny_model("gemma3_text"))[0]
    assert window.max_size < CACHED  # the window is smaller than the shared prefix
    assert isinstance(make_prompt_cache(tiny_model("llama"))[0], KVCache)


# -- cache-level properties, on arrays whose values are their token positions --


def positions(start: int, end: int, heads: int = 2, dim: int = 3) -> mx.array:
    """(1, heads, end - start, dim) K/V whose values encode (head, position)."""
    pos = mx.arange(start, end, dtype=mx.float32)[None, None, :, None]
    head = mx.arange(heads, dtype=mx.float32)[None, :, None, None] * 1000
    return mx.broadcast_to(pos + head, (1, heads, end - start, dim)) + 0


def capture_all(codec, cache, captured: dict, offset: int, block: int) -> None:
    for i in range(offset // block):
        if i not in captured:
            part = codec.cut(cache, i * block, (i + 1) * block, length=offset)
            if part.get("keys") is not None:
                assert mx.array_equal(part["keys"], positions(i * block, (i + 1) * block))
                captured[i] = part


def rebuild_layer(codec, fresh, captured: dict, num_tokens: int, block: int):
    needed = list(codec.blocks_needed(fresh, num_tokens, block))
    if any(i not in captured for i in needed):
        return None
    builder = codec.builder(fresh, num_tokens, round_up(num_tokens + 1), block)
    for i in needed:
        builder.add(i, captured[i])
    return builder.finish()


def present(cache: RotatingKVCache) -> set[int]:
    """Token positions the live ring holds, read through mlx-lm's own temporal order."""
    order = cache._temporal_order(cache.keys)
    return {int(p) for p in order[0, 0, :, 0].tolist()}


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(3, 40),
    keep=st.sampled_from([0, 0, 1, 4]),
    block=st.sampled_from([1, 2, 4, 8]),
    steps=st.lists(st.integers(1, 24), min_size=1, max_size=8),
    nxt=st.integers(1, 9),
)
def test_rotating_cut_and_rebuild(window, keep, block, steps, nxt):
    """Every block still in the ring is cut exactly; a rebuild updates like a live cache.

    Single-token steps rotate the ring in place; longer ones concatenate. The
    rebuilt cache (from the window's blocks) must return the same keys as a
    cache prefilled live to the same length, for a 1-token step too (the W-1
    trap) and for a longer one.
    """
    assume(keep < window)
    codec = codec_for(RotatingKVCache(window))
    ring, captured, offset = RotatingKVCache(window, keep), {}, 0
    for size in steps:
        ring.update_and_fetch(positions(offset, offset + size), positions(offset, offset + size))
        offset += size
        capture_all(codec, ring, captured, offset, block)
        held = present(ring)
        for i in range(offset // block):
            if set(range(i * block, (i + 1) * block)) <= held:
                assert i in captured  # still in the ring: was cut
    num_tokens = offset // block * block
    restored = rebuild_layer(codec, RotatingKVCache(window, keep), captured, num_tokens, block)
    assume(restored is not None and num_tokens > 0)
    reference = RotatingKVCache(window, keep)
    reference.update_and_fetch(positions(0, num_tokens), positions(0, num_tokens))
    assert restored.offset == reference.offset == num_tokens
    new = positions(num_tokens, num_tokens + nxt)
    k_ref, v_ref = reference.update_and_fetch(new, new)
    k_rest, v_rest = restored.update_and_fetch(new, new)
    assert mx.array_equal(k_ref, k_rest) and mx.array_equal(v_ref, v_rest)


@settings(max_examples=80, deadline=None)
@given(
    chunk=st.sampled_from([4, 8, 12, 32]),
    block=st.sampled_from([2, 4, 8]),
    steps=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    nxt=st.integers(1, 9),
)
def test_chunked_cut_and_rebuild(chunk, block, steps, nxt):
    """ChunkedKVCache: blocks cut while held; a rebuild trims and updates like a live one."""
    codec = codec_for(ChunkedKVCache(chunk))
    live_cache, captured, offset = ChunkedKVCache(chunk), {}, 0
    for size in steps:
        live_cache.maybe_trim_front()  # as llama4 does before every forward
        new = positions(offset, offset + size)
        live_cache.update_and_fetch(new, new)
        offset += size
        capture_all(codec, live_cache, captured, offset, block)
    num_tokens = offset // block * block
    restored = rebuild_layer(codec, ChunkedKVCache(chunk), captured, num_tokens, block)
    assume(restored is not None and num_tokens > 0)
    reference = ChunkedKVCache(chunk)
    reference.update_and_fetch(positions(0, num_tokens), positions(0, num_tokens))
    for c in (reference, restored):
        c.maybe_trim_front()
        c.update_and_fetch(
            positions(num_tokens, num_tokens + nxt), positions(num_tokens, num_tokens + nxt)
        )
    assert restored.start_position == reference.start_position
    for a, b in zip(reference.keys_and_values(), restored.keys_and_values(), strict=True):
        assert mx.array_equal(a, b)
