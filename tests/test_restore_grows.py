"""A restored chain grows like a live cache: prefill past its buffer, then decode.

A restore allocates every layer's buffers in one ``mx.load`` (``restore_buffers.
batched``), each its own allocation: a layer's next write lands in place, and
the chain, restored from the hot or the SSD tier, continues (a prefill past the
buffer's end, where mlx-lm grows it, then greedy decode steps) with the live
run's logits bit for bit. The controls: one restored block changed gives other
logits; caches that are views of one shared buffer are copied on their first
write (what separate allocations avoid).
"""

from __future__ import annotations

from itertools import pairwise

import mlx.core as mx
import numpy as np
import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import KVCache, make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory import restore_buffers

BLOCK = 32
WIDE = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8}
WIDE["head_dim"] = 128  # 4 KiB a token per K or V in float32: buffers past 1 MiB (batched)


def config(tier: str, tmp_path, headroom: int) -> CacheConfig:
    if tier == "hot":
        return CacheConfig(block_size=BLOCK, hot_cache_only=True, restore_headroom=headroom)
    return CacheConfig(
        block_size=BLOCK,
        restore_headroom=headroom,
        hot_max_bytes=1,  # every block on SSD only
        promote=False,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        write_queue_bytes=1 << 30,
    )


def address(a: mx.array) -> tuple[int, int]:
    """The memory range of an evaluated array's bytes."""
    view = np.asarray(memoryview(a).cast("B"))
    return view.ctypes.data, view.ctypes.data + view.nbytes


def grow(model, cache, rest: list[int], steps: int, step: int = BLOCK) -> list[mx.array]:
    """Prefill ``rest`` (chunks of ``step``), then ``steps`` greedy decode steps: the
    logits of the prefill's last token and of every decode step."""
    logits = prefill(model, rest, cache, step=step)
    out = [logits]
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        logits = model(token[:, None], cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
    return out


@pytest.mark.parametrize("headroom", [0, 256], ids=["past-its-end", "in-its-headroom"])
@pytest.mark.parametrize("tier", ["hot", "ssd"])
def test_restored_chain_grows_with_the_live_logits(tier, headroom, tmp_path):
    """Without headroom the buffers hold the restored blocks only and the prefill
    grows them (mlx-lm's 256-token steps); with it, they hold the prompt's rest."""
    model = tiny_model("llama", **WIDE)
    shared = prompt(1, 9 * BLOCK)  # 288 tokens: 1.1 MiB buffers, made in one batch
    stored_tokens, asked = shared + prompt(2, 20), shared + prompt(3, 300)
    with PrefixCache(model, config(tier, tmp_path, headroom), model_id="t") as pc:
        stored = make_prompt_cache(model)
        prefill(model, stored_tokens, stored, step=BLOCK)
        pc.store(stored_tokens, stored)
        pc.flush()
        del stored
        (cache, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == 9 * BLOCK
    assert all(type(c) is KVCache for c in cache)
    capacity = cache[0].keys.shape[2]
    assert (capacity < len(asked)) == (headroom == 0), capacity
    spans = sorted(address(a) for c in cache for a in (c.keys, c.values))
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))  # disjoint

    live_cache = make_prompt_cache(model)
    prefill(model, asked[:num], live_cache, step=BLOCK)
    want = grow(model, live_cache, asked[num:], 6)
    got = grow(model, cache, asked[num:], 6)
    assert cache[0].offset == len(asked) + 6
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 7

    # the control: block 2 of one layer's keys changed, the logits differ
    b = bad[1]
    b.keys[..., 2 * BLOCK : 3 * BLOCK, :] = b.keys[..., 2 * BLOCK : 3 * BLOCK, :] * 0.5
    wrong = grow(model, bad, asked[num:], 6)
    assert max_diff(wrong[0], want[0]) > 0.0


def test_a_layers_next_write_lands_in_its_restored_buffer():
    """Each restored buffer is its own allocation: a one-token update writes in
    place (same address). The control: caches that are views of one shared
    buffer (one allocation for every layer) are copied by their first write."""
    model = tiny_model("llama", **WIDE)
    tokens = prompt(4, 6 * BLOCK)
    cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True)
    with PrefixCache(model, cfg, model_id="t") as pc:
        stored = make_prompt_cache(model)
        prefill(model, tokens, stored, step=BLOCK)
        pc.store(tokens, stored)
        cache, num = pc.fetch([*tokens, 7])
    assert num == len(tokens)
    one = mx.ones((1, 8, 1, 128))
    before = [address(c.keys)[0] for c in cache]
    for c in cache:
        c.update_and_fetch(one, one)
    mx.eval([c.keys for c in cache])
    assert [address(c.keys)[0] for c in cache] == before

    shared = mx.zeros((len(cache), 1, 8, cache[0].keys.shape[2], 128))
    mx.eval(shared)
    views = []
    for i in range(len(cache)):
        c = KVCache()
        view = shared[i : i + 1].reshape(cache[0].keys.shape)  # a slice: no copy
        c.keys, c.values, c.offset = view, mx.zeros_like(view), num
        views.append(c)
    mx.eval([c.keys for c in views], [c.values for c in views])
    before = [address(c.keys)[0] for c in views]
    for c in views:
        c.update_and_fetch(one, one)
    mx.eval([c.keys for c in views])
    assert all(address(c.keys)[0] != b for c, b in zip(views, before, strict=True))


def test_a_batch_makes_separate_unwritten_buffers_in_one_load():
    shapes = [(1, 8, 300, 128), (1, 2, 64, 16), (4, 5)]
    with restore_buffers.batched(mx.cpu) as batch:
        slots = [batch.add(s, mx.bfloat16) for s in shapes]
        assert all(slot.array is None for slot in slots)  # made as the batch ends
    arrays = [restore_buffers.resolve(slot) for slot in slots]
    assert batch.arrays == arrays
    mx.eval(arrays)
    assert [a.shape for a in arrays] == shapes and {a.dtype for a in arrays} == {mx.bfloat16}
    spans = sorted(address(a) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))
    for i, a in enumerate(arrays):
        np.asarray(memoryview(a).cast("B"))[...] = i + 1
    assert [int(np.asarray(memoryview(a).cast("B")).max()) for a in arrays] == [1, 2, 3]
    assert restore_buffers.current() is None


def test_a_slot_used_before_its_batch_ends_is_refused():
    with restore_buffers.batched(mx.cpu) as batch:
        slot = batch.add((2, 2), mx.float32)
        with pytest.raises(RuntimeError, match="before its batch ended"):
            restore_buffers.resolve(slot)
