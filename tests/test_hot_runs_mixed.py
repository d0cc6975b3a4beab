"""Hot runs on models with window or recurrent layers beside plain K/V ones.

A store cuts runs (memory/runs.py) of the layers whose codec ``cuts_runs``
(the attention layers' K/V); each block keeps its own arrays for the others (a
window layer's K/V near restore points, a recurrent layer's state snapshot). What
these show: the run holds exactly the K/V layers; a hot restore merges a run's
blocks for those layers only (one view per run segment) and grows (prefill and
decode past its length) with the live run's logits bit for bit, one changed K/V
block giving other logits; the tier is charged each run's buffer once plus every
block's own arrays, through evictions, compactions, dropped snapshots and upgrades,
and the budget holds.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import KVCache, make_prompt_cache
from test_restore_grows import grow

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache import restore
from prefixcache.hashing import token_bytes
from prefixcache.memory.runs import RunViews

BLOCK = 8
RUN = 4 * BLOCK  # runs of 4 blocks
STORED = 12 * BLOCK  # 3 runs; the window (16 tokens) reaches back two blocks
ARCHS = ["gemma3_text", "qwen3_next"]


def config(**over) -> CacheConfig:
    return CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_run_tokens=RUN, **over)


def live(model, tokens: list[int], step: int = STORED) -> list:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=step)  # one chunk: every block keeps its window
    return cache


def chain(pc: PrefixCache, tokens: list[int]):
    """The hot blocks of ``tokens``' full blocks, root-first (None where not held)."""
    return [pc.hot.get(k) for k in pc._keys(token_bytes(tokens), None)[: len(tokens) // BLOCK]]


def charged(pc: PrefixCache) -> int:
    """What the tier should count: each run held once, and every block's own arrays."""
    runs = {id(b.run): b.run.nbytes for b in pc.hot if b.run is not None}
    own = sum(b.nbytes - (b.run.block_nbytes if b.run is not None else 0) for b in pc.hot)
    return sum(runs.values()) + own


def kv_layers(model) -> frozenset[int]:
    return frozenset(i for i, c in enumerate(model.make_cache()) if type(c) is KVCache)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_restore_from_mixed_runs_grows_with_the_live_logits(arch, monkeypatch):
    model = tiny_model(arch)
    shared = prompt(1, STORED)
    asked = shared + prompt(3, 37)
    merged: list[list] = []
    coalesce = restore.coalesce

    def spy(blocks, layers=frozenset()):
        out = coalesce(blocks, layers)
        merged.append([layers, out])
        return out

    monkeypatch.setattr(restore, "coalesce", spy)
    with PrefixCache(model, config(restore_headroom=0), model_id="t") as pc:
        pc.store(shared, live(model, shared))
        blocks = chain(pc, shared)
        assert all(b is not None and b.run is not None for b in blocks)
        runs = list(dict.fromkeys(b.run for b in blocks))
        assert len(runs) == 3 and all(r.layers == kv_layers(model) for r in runs)
        # the last block keeps its window (gemma3) or its state snapshot (qwen3_next) itself
        outside = [n for n in blocks[-1].arrays if n not in runs[-1].arrays]
        assert outside and all(int(n.split(".")[0]) not in runs[-1].layers for n in outside)
        assert pc.hot.nbytes == charged(pc)
        (cache, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == STORED
    # the K/V layers took one view per run, spanning its 4 blocks
    whole = [out for layers, out in merged if layers == kv_layers(model)]
    assert whole
    heads = [v for _, v in whole[0] if type(v) is RunViews]
    assert [(v.lo, v.hi) for v in heads] == [(0, 4)] * 3
    want = grow(model, live(model, shared), asked[num:], 5, step=BLOCK)
    got = grow(model, cache, asked[num:], 5, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 6
    # the control: one block of a run's layer other
    layer = min(kv_layers(model))
    bad[layer].keys[..., 5 * BLOCK : 6 * BLOCK, :] = bad[layer].keys[..., :BLOCK, :]
    wrong = grow(model, bad, asked[num:], 5, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mixed_run_is_charged_its_buffer_and_each_blocks_own_arrays(arch):
    """Blocks removed from the chain's end one by one: after each, the tier counts
    the runs still held once and every block's own arrays; a run held by half its
    blocks is copied out (its blocks' own arrays kept as they are)."""
    model = tiny_model(arch)
    tokens = prompt(4, STORED)
    with PrefixCache(model, config(), model_id="t") as pc:
        pc.store(tokens, live(model, tokens))
        blocks = chain(pc, tokens)
        last = blocks[-1]
        own = {n: a for n, a in last.arrays.items() if n not in last.run.arrays}
        assert own and pc.hot.nbytes == charged(pc)
        pc.hot.remove([last.key])  # its own arrays freed, its run still held
        assert pc.hot.nbytes == charged(pc)
        assert pc.hot.runs.dead_bytes() == last.run.block_nbytes
        pc.hot.remove([blocks[-2].key])  # half the run left: copied out
        kept = chain(pc, tokens)[8:10]
        assert all(b.run is None for b in kept) and pc.hot.runs.num_compacted == 1
        assert all(
            mx.array_equal(k.arrays[n], b.arrays[n]).item()
            for k, b in zip(kept, blocks[8:10], strict=True)
            for n in b.arrays
        )
        for b in reversed(blocks[:10]):
            pc.hot.remove([b.key])
            assert pc.hot.nbytes == charged(pc)
        assert pc.hot.nbytes == 0 and pc.hot.runs.stats()["num_runs"] == 0


def test_dropped_snapshots_keep_their_blocks_in_the_run():
    """Over the budget, qwen3_next's interval snapshots inside the chain go first
    (``shed``): the lean blocks stay views of their run, the tier charged exactly,
    and the chain still restores exactly where a snapshot is left."""
    model = tiny_model("qwen3_next")
    tokens = prompt(6, STORED)
    with PrefixCache(model, config(snapshot_interval=4), model_id="t") as pc:
        stored, done = make_prompt_cache(model), 0
        for point in [*pc.checkpoints(tokens, 0), STORED]:  # each capture cuts one run
            prefill(model, tokens[done:point], stored, step=BLOCK)
            pc.capture(tokens[:point], stored)
            done = point
        pc.store(tokens, stored)
        before = chain(pc, tokens)
        states = [b for b in before if len(b.arrays) > len(b.run.arrays)]
        assert [b.index for b in states] == [3, 7, 11]
        pc.hot.evict_to(pc.hot.nbytes - 1)  # one snapshot dropped, no block evicted
        after = chain(pc, tokens)
        assert pc.hot.num_shed == 1 and all(b is not None for b in after)
        lean = [a for a, b in zip(after, before, strict=True) if a is not b]
        assert len(lean) == 1 and lean[0].run is not None
        assert pc.hot.nbytes == charged(pc)
        cache, num = pc.fetch(tokens + prompt(7, 3))
    assert num == STORED
    want = live(model, tokens, step=BLOCK)
    layer = min(kv_layers(model))
    assert mx.array_equal(cache[layer].keys[..., :num, :], want[layer].keys[..., :num, :]).item()


def test_an_upgraded_block_stays_its_runs():
    """A block first stored without its window payload (cut from a finished cache
    the window had left) gains it from a later capture: the fuller block is still a
    view of its run, and the tier charged exactly."""
    model = tiny_model("gemma3_text")
    tokens = prompt(8, STORED)
    with PrefixCache(model, config(), model_id="t") as pc:
        pc.store(tokens, live(model, tokens, step=BLOCK))  # the window moved on
        first = chain(pc, tokens)
        lean = [b.key for b in first if set(b.arrays) == set(b.run.arrays)]
        assert lean
        pc.store(tokens[: 6 * BLOCK], live(model, tokens[: 6 * BLOCK], step=BLOCK))
        upgraded = [b for b in chain(pc, tokens) if b.key in lean and len(b.arrays) > 4]
        assert upgraded and all(b.run is not None for b in upgraded)
        assert pc.hot.nbytes == charged(pc)
        cache, num = pc.fetch(tokens[: 6 * BLOCK] + prompt(9, 3))
    assert num == 6 * BLOCK
    want = live(model, tokens[:num], step=BLOCK)
    got = grow(model, cache, tokens[num : num + 9], 3, step=BLOCK)
    assert max_diff(got[-1], grow(model, want, tokens[num : num + 9], 3, step=BLOCK)[-1]) == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_budget_holds_with_mixed_runs(arch):
    model = tiny_model(arch)
    with PrefixCache(model, config(), model_id="t") as pc:
        pc.store(prompt(20, STORED), live(model, prompt(20, STORED)))
        budget = pc.hot.nbytes * 2 + pc.hot.nbytes // 3  # not a whole number of chains
        pc.hot.max_bytes = budget
        for seed in range(21, 26):
            tokens = prompt(seed, STORED)
            pc.store(tokens, live(model, tokens))
            assert pc.hot.nbytes <= budget and pc.hot.nbytes == charged(pc)
        assert pc.hot.num_evictions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_runs_spill_to_ssd_and_come_back_exactly(arch, tmp_path):
    """Blocks of mixed runs written through to the SSD tier (their run's views and
    their own arrays in one payload), then restored from hot, from hot and SSD
    (the last run evicted), and from SSD alone: each grows with the live logits."""
    model = tiny_model(arch)
    tokens = prompt(10, STORED)
    asked = tokens + prompt(11, 9)
    cfg = CacheConfig(
        block_size=BLOCK,
        hot_run_tokens=RUN,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        write_policy="write_through",
        promote=False,
        restore_headroom=0,
    )
    with PrefixCache(model, cfg, model_id="t") as pc:
        pc.store(tokens, live(model, tokens))
        pc.flush()
        assert all(b.run is not None for b in chain(pc, tokens))
        restored = [pc.fetch(asked)]
        keys = pc._keys(token_bytes(tokens), None)
        pc.hot.evict_chain(keys[: 8 - 1 : -1], 0)  # the last run's 4 blocks
        assert [b is not None for b in chain(pc, tokens)] == [True] * 8 + [False] * 4
        restored.append(pc.fetch(asked))
        pc.hot.evict_to(0)
        assert pc.hot.nbytes == 0
        restored.append(pc.fetch(asked))
        bad, _ = pc.fetch(asked)
    want = grow(model, live(model, tokens), asked[STORED:], 3, step=BLOCK)
    for cache, num in restored:
        assert num == STORED
        got = grow(model, cache, asked[STORED:], 3, step=BLOCK)
        assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 4
    # the control: one block of a run's layer other
    layer = min(kv_layers(model))
    bad[layer].values[..., 2 * BLOCK : 3 * BLOCK, :] = bad[layer].values[..., :BLOCK, :]
    wrong = grow(model, bad, asked[STORED:], 3, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0
