"""Sliding-window payloads are kept only around restore points (window.py).

Tiny gemma3_text: 2 sliding-window layers (window 16, keep 0) and 2 global
ones; 8-token blocks, so a restore at L needs the window layers' blocks of
tokens ``[L - 16, L)``. With ``snapshot_interval=6`` the restore points of a
100-token prompt are 48, 96 and its end (100); every restore there equals the
live run, and one needing a window that was not kept falls back to the deepest
point every layer covers.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import RotatingKVCache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 8


def hot_pc(model, **settings) -> PrefixCache:
    """Restore points: the interval's and each sequence's end (no checkpoint before
    the end: ``checkpoint_tail`` 0 unless given)."""
    settings = {"checkpoint_tail": 0, **settings}
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, **settings)
    return PrefixCache(model, config, model_id="tiny")


def windowed(pc: PrefixCache) -> list[int]:
    """Chain indices of the hot full blocks holding window-layer payloads."""
    prefixes = pc.layout.window_prefixes
    return sorted(
        b.index
        for b in pc.hot
        if b.num_tokens == BLOCK and any(n.startswith(prefixes) for n in b.arrays)
    )


def reasons(pc: PrefixCache) -> dict[str, int]:
    return {k: v for k, v in pc.stats()["miss_reasons"].items() if v}


def continued(model, cache, tokens) -> mx.array:
    return prefill(model, tokens, cache, step=BLOCK)


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3_text")


def test_the_tiny_model_has_the_windows_the_tests_assume(gemma):
    with hot_pc(gemma) as pc:
        assert pc.layout.window_prefixes == ("0.", "2.")
        assert (pc.layout.window, pc.layout.window_keep) == (16, 0)


@pytest.mark.parametrize("step", [BLOCK, None])
def test_window_payloads_only_around_restore_points(gemma, step):
    """Restores in [40, 48] need blocks 3-5 ([24, 48)); in [88, 96] and [92, 100]
    blocks 9-11 ([72, 96)); blocks 0-2 and 6-8 keep only the global layers."""
    tokens = prompt(1, 100)
    with hot_pc(gemma, snapshot_interval=6) as pc:
        pc.prefill(tokens, prefill_step_size=step)
        assert sorted(b.index for b in pc.hot if b.num_tokens == BLOCK) == list(range(12))
        assert windowed(pc) == [3, 4, 5, 9, 10, 11]
        tail = next(b for b in pc.hot if b.num_tokens == 4)
        assert any(n.startswith(pc.layout.window_prefixes) for n in tail.arrays)
        # a block without window payload still holds every global layer's K/V
        lean = next(b for b in pc.hot if b.index == 0)
        assert {n.split(".")[0] for n in lean.arrays} == {"1", "3"}


@pytest.mark.parametrize(("probe_len", "cached"), [(48, 48), (96, 96), (100, 100)])
def test_restores_at_restore_points_equal_the_live_run(gemma, probe_len, cached):
    a = prompt(1, 100)
    probe = a[:probe_len] + prompt(5, 6)
    with hot_pc(gemma, snapshot_interval=6) as pc:
        pc.prefill(a, prefill_step_size=BLOCK)
        cache, num_cached = pc.fetch(probe)
        assert num_cached == cached
        want = live_logits(gemma, probe, cached, step=BLOCK)
        assert max_diff(continued(gemma, cache, probe[cached:]), want) == 0.0
        assert "window_not_covered" not in reasons(pc)
        # the whole stored sequence: restored one token short, from the end's window
        again, num_again = pc.fetch(a)
        assert num_again == 99
        want = live_logits(gemma, a, 99, step=BLOCK)
        assert max_diff(continued(gemma, again, a[99:]), want) == 0.0


def test_another_prompts_window_payload_changes_the_logits(gemma):
    """Negative control: the global layers from the right prompt, the window layers'
    K/V from another prompt's restore at the same point."""
    a, b = prompt(1, 100), prompt(2, 100)
    probe = a[:48] + prompt(5, 6)
    with hot_pc(gemma, snapshot_interval=6) as pc:
        pc.prefill(a, prefill_step_size=BLOCK)
        pc.prefill(b, prefill_step_size=BLOCK)
        want = live_logits(gemma, probe, 48, step=BLOCK)
        ours, n = pc.fetch(probe)
        assert n == 48
        assert max_diff(continued(gemma, ours, probe[48:]), want) == 0.0
        ours, n = pc.fetch(probe)  # again: the continued one holds more tokens now
        theirs, m = pc.fetch(b[:48] + probe[48:])
        assert n == m == 48
        pairs = zip(ours, theirs, strict=True)
        mixed = [t if isinstance(o, RotatingKVCache) else o for o, t in pairs]
        assert sum(isinstance(c, RotatingKVCache) for c in mixed) == 2
        assert max_diff(continued(gemma, mixed, probe[48:]), want) > 0.0


def test_a_window_not_kept_falls_back_to_the_deepest_covered_point(gemma):
    """A prompt diverging at 70 would restore 70 (cut back inside block 8), but
    blocks 6-8 hold no window payload: it restores at 48 (window_not_covered)."""
    a = prompt(1, 100)
    probe = a[:70] + prompt(7, 10)
    with hot_pc(gemma, snapshot_interval=6) as pc:
        pc.prefill(a, prefill_step_size=BLOCK)
        assert pc.stored_prefix(probe) == 70
        assert reasons(pc) == {"no_prefix": 1}  # the prefill's own miss
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 48
        assert reasons(pc) == {"no_prefix": 1, "window_not_covered": 1}
        want = live_logits(gemma, probe, 48, step=BLOCK)
        assert max_diff(continued(gemma, cache, probe[48:]), want) == 0.0
    with hot_pc(gemma, snapshot_interval=1) as pc:  # every boundary: every window kept
        pc.prefill(a, prefill_step_size=BLOCK)
        assert pc.fetch(probe)[1] == 70


def test_prefill_keeps_the_windows_where_stored_sequences_branch(gemma):
    """A shared system prompt between restore points misses once; then its
    windows are kept and the next prompt branching there resumes."""
    system = prompt(1, 24)  # needs blocks 1-2, kept by no point of the first prompt
    users = [system + prompt(10 + i, 30) for i in range(3)]
    with hot_pc(gemma, snapshot_interval=6) as pc:
        pc.prefill(users[0])
        assert pc.stored_prefix(users[1]) == 24 and pc.match(users[1]) == 0
        pc.prefill(users[1])  # misses, and keeps the windows at 24
        assert pc.match(users[2]) == 24
        cache, num_cached = pc.fetch(users[2])
        assert num_cached == 24
        want = live_logits(gemma, users[2], 24, step=BLOCK)
        assert max_diff(continued(gemma, cache, users[2][24:]), want) == 0.0


@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.parametrize("early", [True, False], ids=["budgeted", "explicit_interval"])
def test_default_interval_bounds_window_bytes_by_the_global_kv(gemma, ratio, early):
    """snapshot_interval=0: the interval's window payloads cost at most ``ratio`` x
    the global layers' K/V bytes, and the early points (after 1, 2, 4 ... blocks
    below the interval) one point's window each. The same interval set explicitly
    keeps no early point: the interval's bound alone."""
    with hot_pc(gemma, snapshot_ratio=ratio) as pc:
        layout = pc.layout
        point = layout.window_token_bytes * (layout.window // BLOCK + 1) * BLOCK
        interval = math.ceil(point / (ratio * layout.kv_token_bytes * BLOCK))
        assert layout.snapshot_interval == interval == round(3 / ratio)
    settings = {} if early else {"snapshot_interval": interval}
    with hot_pc(gemma, snapshot_ratio=ratio, **settings) as pc:
        layout = pc.layout
        pc.prefill(prompt(1, 2 * interval * BLOCK))
        prefixes = layout.window_prefixes

        def window_bytes(b):
            return sum(a.nbytes for n, a in b.arrays.items() if n.startswith(prefixes))

        window = sum(window_bytes(b) for b in pc.hot)
        kv = sum(b.nbytes - window_bytes(b) for b in pc.hot)
        powers = [b for b in range(1, interval) if b & (b - 1) == 0] if early else []
        assert 0 < window <= ratio * kv + len(powers) * point


@pytest.mark.parametrize("headers", [True, False], ids=["planned", "control_no_headers"])
def test_an_ssd_restore_between_points_loads_each_block_once(gemma, tmp_path, headers, monkeypatch):
    """From the SSD tier the plan reads which payloads each block holds from its
    header (``payload_names``), so the fallback to the covered point 48 loads
    only the blocks of that restore. Control: with the names unknown, the
    restore finds the gaps while loading and reloads the chain on each retry."""
    from prefixcache.tiers.ssd.tier import SsdTier

    if not headers:
        monkeypatch.setattr(SsdTier, "payload_names", lambda self, key: None)
    a = prompt(1, 100)
    probe = a[:70] + prompt(7, 10)
    config = CacheConfig(
        block_size=BLOCK,
        snapshot_interval=6,
        hot_max_bytes=1,
        promote=False,
        ssd_dir=str(tmp_path),
        ssd_min_free_bytes=0,
    )
    with PrefixCache(gemma, config, model_id="tiny") as pc:
        pc.prefill(a, prefill_step_size=BLOCK)
        pc.flush()
        before = pc.stats()["ssd"]["num_loads"]
        cache, num_cached = pc.fetch(probe)
        loads = pc.stats()["ssd"]["num_loads"] - before
        assert num_cached == 48
        want = live_logits(gemma, probe, 48, step=BLOCK)
        assert max_diff(continued(gemma, cache, probe[48:]), want) == 0.0
    if headers:
        assert loads == 48 // BLOCK  # blocks 0-5, once each
    else:
        assert loads > 48 // BLOCK
