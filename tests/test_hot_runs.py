"""Hot runs: the blocks of one store kept as one array per layer's K and V.

With ``hot_run_tokens``, a store of a plain K/V model cuts its new consecutive
blocks as runs (memory/runs.py): each block's arrays are views of its run's,
and a hot restore copies a run's blocks in one copy per array. What these show:
a restore from runs grows (prefill and decode past its length) with the live
run's logits bit for bit, one token changed gives other logits; the tier is
charged by buffer (a run's bytes until its last block goes; a mostly dead run
compacted), the budget holds, and blocks of runs spill to and come back from
the SSD tier exactly; quantized models keep per-block arrays.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_restore_grows import grow

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import token_bytes
from prefixcache.tiny.archs import VOCAB_SIZE

BLOCK = 16
RUN = 4 * BLOCK  # runs of 4 blocks
WIDE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def runs_config(**over) -> CacheConfig:
    return CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_run_tokens=RUN, **over)


def stored(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    return cache


def run_of(pc: PrefixCache, tokens: list[int]):
    """The hot blocks of ``tokens``' chain, root-first."""
    keys = pc._keys(token_bytes(tokens), None)
    return [pc.hot.get(k) for k in keys if pc.hot.get(k) is not None]


def test_a_restore_from_runs_grows_with_the_live_logits():
    model = tiny_model("llama", **WIDE)
    shared = prompt(1, 10 * BLOCK)  # 10 blocks: runs of 4, 4 and 2
    asked = shared + prompt(3, 3 * BLOCK + 5)
    with PrefixCache(model, runs_config(restore_headroom=0), model_id="t") as pc:
        pc.store(shared + prompt(2, 7), stored(model, shared + prompt(2, 7)))
        blocks = run_of(pc, shared)
        assert len(blocks) == 10
        runs = [b.run for b in blocks]
        assert all(r is not None for r in runs)
        assert [runs.index(r) for r in runs] == [0] * 4 + [4] * 4 + [8] * 2
        x = blocks[1].arrays["0.keys"]
        assert not memoryview(x).c_contiguous  # a view of its run (2 heads)
        tail = pc.hot.get(pc._keys(token_bytes(shared + prompt(2, 7)), None)[-1])
        assert tail.run is None  # a tail is never in a run
        # the runs and the tail: every buffer's bytes held, nothing dead
        assert pc.hot.nbytes == sum(b.nbytes for b in blocks) + tail.nbytes
        (cache, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == 10 * BLOCK
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK)
    want = grow(model, live, asked[num:], 5, step=BLOCK)
    got = grow(model, cache, asked[num:], 5, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 6
    # the control: one token of the restored chain other (its K/V as another run's)
    other = make_prompt_cache(model)
    changed = (asked[5 * BLOCK] + 1) % VOCAB_SIZE  # a token of the vocabulary: no gather past it
    prefill(model, [*asked[: 5 * BLOCK], changed, *asked[5 * BLOCK + 1 : num]], other, step=BLOCK)
    for layer, o in zip(bad, other, strict=True):
        layer.keys[..., :num, :] = o.keys[..., :num, :]
        layer.values[..., :num, :] = o.values[..., :num, :]
    wrong = grow(model, bad, asked[num:], 5, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0


def test_a_restore_merges_a_runs_blocks_into_one_copy():
    """What the builder is handed: one view per run segment, spanning its blocks."""
    from prefixcache.memory.runs import COVERED, RunViews, coalesce

    model = tiny_model("llama", **WIDE)
    tokens = prompt(4, 8 * BLOCK)
    with PrefixCache(model, runs_config(), model_id="t") as pc:
        pc.store(tokens, stored(model, tokens))
        blocks = run_of(pc, tokens)
        resident = [(b.arrays, pc.hot.views.of(b)) for b in blocks]
        merged = coalesce(resident[1:])  # blocks 1..7: runs [0, 4) and [4, 8)
        assert [type(v) for _, v in merged] == [RunViews, dict, dict, RunViews, dict, dict, dict]
        assert all(v is COVERED for _, v in merged if type(v) is not RunViews)
        head = merged[0][1]["1.values"]
        assert head.shape[2] == 3 * BLOCK
        whole = np.concatenate([v["1.values"] for _, v in resident[1:4]], axis=2)
        assert np.array_equal(head, whole)
        cache, num = pc.fetch(tokens)
    assert num == len(tokens) - 1  # a fully cached prompt: one token short
    live = stored(model, tokens)
    for c, lv in zip(cache, live, strict=True):
        assert mx.array_equal(c.keys[..., :num, :], lv.keys[..., :num, :]).item()


def test_the_tier_is_charged_a_runs_buffer_until_its_last_block_goes():
    model = tiny_model("llama", **WIDE)
    tokens = prompt(5, 8 * BLOCK)
    with PrefixCache(model, runs_config(), model_id="t") as pc:
        pc.store(tokens, stored(model, tokens))
        hot = pc.hot
        blocks = run_of(pc, tokens)
        per = blocks[0].nbytes
        run = blocks[4].run
        assert run.nbytes == 4 * per and hot.nbytes == 8 * per
        hot.remove([blocks[7].key])  # a leaf of the second run: nothing freed
        assert hot.nbytes == 8 * per
        assert hot.runs.stats()["run_dead_bytes"] == per
        hot.remove([blocks[6].key])  # half of it dead: the rest copied out, run freed
        assert hot.nbytes == 6 * per
        assert hot.runs.stats() == {
            "num_runs": 1,
            "run_bytes": 4 * per,
            "run_dead_bytes": 0,
            "num_runs_compacted": 1,
        }
        kept = [hot.get(b.key) for b in blocks[4:6]]
        assert all(k.run is None and memoryview(k.arrays["0.keys"]).c_contiguous for k in kept)
        assert all(
            mx.array_equal(k.arrays[n], b.arrays[n]).item()
            for k, b in zip(kept, blocks[4:6], strict=True)
            for n in b.arrays
        )
        hot.remove([b.key for b in reversed(blocks[:6])])
        assert hot.nbytes == 0 and hot.runs.stats()["num_runs"] == 0


def test_the_budget_holds_with_runs():
    """Stores past the budget (21 blocks: not a whole number of runs of 4): the
    tier's bytes, dead ones included, stay under it and are the buffers its
    blocks hold."""
    model = tiny_model("llama", **WIDE)
    per = 2 * 2 * (2 * BLOCK * 16 * 4)  # layers x (K, V) x (heads x tokens x dim x f32)
    budget = 21 * per
    with PrefixCache(model, runs_config(hot_max_bytes=budget * 16), model_id="t") as pc:
        pc.hot.max_bytes = budget  # runs sized for a larger budget: 4 blocks each
        for seed in range(6):
            tokens = prompt(10 + seed, 8 * BLOCK)
            pc.store(tokens, stored(model, tokens))
            hot = pc.hot
            assert hot.nbytes <= budget
            held: dict[int, int] = {}
            for b in hot:
                key = id(b.run) if b.run is not None else id(b)
                held[key] = b.run.nbytes if b.run is not None else b.nbytes
            assert hot.nbytes == sum(held.values())
        # runs taken apart by eviction: their last blocks copied out, not left dead
        assert hot.num_evictions > 0 and hot.runs.num_compacted > 0


def test_blocks_of_runs_spill_to_ssd_and_come_back_exactly(tmp_path):
    model = tiny_model("llama", **WIDE)
    tokens = prompt(7, 8 * BLOCK)
    asked = tokens + prompt(8, 9)
    cfg = CacheConfig(
        block_size=BLOCK,
        hot_run_tokens=RUN,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        write_policy="write_through",
        promote=False,
    )
    live = stored(model, tokens)
    with PrefixCache(model, cfg, model_id="t") as pc:
        pc.store(tokens, stored(model, tokens))
        pc.flush()
        assert all(b.run is not None for b in run_of(pc, tokens))
        keys = pc._keys(token_bytes(tokens), None)
        pc.hot.evict_chain(keys[:4:-1], 0)  # blocks 7, 6, 5: the second run compacted
        assert [b.run is not None for b in run_of(pc, tokens)] == [True] * 4 + [False]
        mixed, num_mixed = pc.fetch(asked)  # blocks 0-4 from hot, 5-7 from the SSD tier
        pc.hot.evict_to(0)  # everything out of hot: served from the SSD tier
        assert pc.hot.nbytes == 0
        cache, num = pc.fetch(asked)
    assert num == num_mixed == len(tokens)
    for restored in (mixed, cache):
        for c, lv in zip(restored, live, strict=True):
            assert mx.array_equal(c.keys[..., :num, :], lv.keys[..., :num, :]).item()
            assert mx.array_equal(c.values[..., :num, :], lv.values[..., :num, :]).item()


def test_quantized_models_keep_per_block_arrays_windowed_ones_run_their_kv():
    """Runs are cut of the layers whose codec cuts them (plain K/V): a quantized cache
    keeps each block's own arrays, a model with sliding-window layers runs its
    global layers only (tests/test_hot_runs_mixed.py)."""
    model = tiny_model("llama", **WIDE, head_dim=32)
    tokens = prompt(9, 8 * BLOCK)
    with PrefixCache(model, runs_config(kv_bits=8, kv_group_size=32), model_id="t") as pc:
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache, step=BLOCK, kv=(8, 32, 0))
        pc.store(tokens, cache)
        blocks = run_of(pc, tokens)
        assert len(blocks) == 8 and all(b.run is None for b in blocks)
    model = tiny_model("gemma3_text")
    with PrefixCache(model, runs_config(), model_id="t") as pc:
        pc.store(tokens, stored(model, tokens))
        blocks = run_of(pc, tokens)
        kv = [i for i, c in enumerate(model.make_cache()) if type(c).__name__ == "KVCache"]
        assert blocks and all(b.run is not None and b.run.layers == set(kv) for b in blocks)
        assert len(kv) < len(model.layers)
    model = tiny_model("llama", **WIDE)  # the same store of a plain K/V model: runs
    with PrefixCache(model, runs_config(), model_id="t") as pc:
        pc.store(tokens, stored(model, tokens))
        assert all(b.run is not None for b in run_of(pc, tokens))


def test_a_pinned_block_keeps_its_own_bytes_not_its_runs():
    """Everything evicted but a pinned prefix: the runs go, the pinned blocks of the
    first run are copied out (the run held at most half), the tier holds their
    bytes only, and they still restore exactly."""
    model = tiny_model("llama", **WIDE)
    tokens = prompt(11, 8 * BLOCK)
    with PrefixCache(model, runs_config(), model_id="t") as pc:
        pc.store(tokens, stored(model, tokens))
        per = run_of(pc, tokens)[0].nbytes
        pc.pin(tokens[:BLOCK])  # block 0 of the first run
        pc.hot.evict_to(0)
        held = run_of(pc, tokens)
        assert len(held) == 1 and held[0].run is None
        assert pc.hot.nbytes == per and pc.hot.runs.stats()["num_runs"] == 0
        cache, num = pc.fetch(tokens[: BLOCK + 3])
    assert num == BLOCK
    live = stored(model, tokens[:BLOCK])
    for c, lv in zip(cache, live, strict=True):
        assert mx.array_equal(c.keys[..., :num, :], lv.keys[..., :num, :]).item()


def test_a_tenants_cap_holds_with_runs():
    """A tenant over its cap loses its own blocks from the chain's end; it is charged
    its blocks' own bytes, the tier the buffers it holds (the run it broke copied out)."""
    model = tiny_model("llama", **WIDE)
    tokens = prompt(12, 8 * BLOCK)
    per = 2 * 2 * (2 * BLOCK * 16 * 4)  # one block: layers x (K, V) x heads x tokens x dim x f32
    with PrefixCache(model, runs_config(hot_tenant_caps=f"a={6 * per}"), model_id="t") as pc:
        pc.store(tokens, stored(model, tokens), tenant="a")
        held = run_of(pc, tokens)
        assert [b.run is not None for b in held] == [True] * 4 + [False] * 2
        assert pc.hot.tenants.stats()["a"]["nbytes"] == 6 * per
        assert pc.hot.nbytes == 6 * per and pc.hot.runs.num_compacted == 1
