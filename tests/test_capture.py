"""Capture during prefill: generate_step's progress callback, upgrades, snapshots, miss reasons."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from conftest import max_diff, prompt, tiny_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache.capture import chunk_ends, chunk_step

BLOCK = 16


def hot_pc(model, **settings) -> PrefixCache:
    settings = {"snapshot_interval": 1, **settings}  # every boundary, unless a test says
    return PrefixCache(
        model, CacheConfig(block_size=BLOCK, hot_cache_only=True, **settings), model_id="tiny"
    )


def cold(model, tokens, step: int = BLOCK):
    """A cache and last logits prefilled live, in chunks ending on multiples of ``step``."""
    cache, pos, logits = make_prompt_cache(model), 0, None
    for end in chunk_ends(0, len(tokens), step):
        logits = model(mx.array([tokens[pos:end]]), cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        pos = end
    return cache, logits


def run(model, tokens, cache, *, n: int = 6, callback=None) -> tuple[list[int], mx.array]:
    out, logprobs = [], []
    for token, lp in generate_step(
        mx.array(tokens),
        model,
        prompt_cache=cache,
        prefill_step_size=BLOCK,
        max_tokens=n,
        prompt_progress_callback=callback,
    ):
        out.append(int(token))
        logprobs.append(lp)
    return out, mx.stack(logprobs)


def reasons(pc: PrefixCache) -> dict[str, int]:
    return {k: v for k, v in pc.stats()["miss_reasons"].items() if v}


def test_chunk_plan():
    assert chunk_ends(0, 50, 16) == [16, 32, 48, 50]
    assert chunk_ends(20, 50, 16) == [32, 48, 50]  # absolute multiples, as a cold run
    assert chunk_ends(48, 48, 16) == []
    assert chunk_step(None, 16) == 2048
    assert chunk_step(None, 48) == 2016
    assert chunk_step(32, 16) == 32
    for bad in (24, 0, -16):
        with pytest.raises(ValueError, match="multiple of block_size=16"):
            chunk_step(bad, 16)


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next", "falcon_h1"])
def test_capture_from_generate_step_progress_callback(arch):
    """A scheduler's own loop: generate_step + prompt_progress_callback -> capture."""
    model = tiny_model(arch)
    shared = prompt(1, 56)
    a, b = shared + prompt(2, 30), shared + prompt(3, 25)
    with hot_pc(model) as pc:
        cache, num_cached = pc.fetch(a)
        assert num_cached == 0

        def progress(done: int, total: int) -> None:
            if done < total:  # the last call comes once a generated token is in the cache
                pc.capture(a[: num_cached + done], cache)

        run(model, a[num_cached:], cache, callback=progress)
        # a window is cut back to the 56 shared tokens; recurrent state exists at 48 only
        shared_len = 56 if arch == "gemma3_text" else 48
        assert pc.match(b) == shared_len
        restored, num_cached = pc.fetch(b)
        assert num_cached == shared_len
        tokens, logprobs = run(model, b[num_cached:], restored)
        live, _ = cold(model, b[:num_cached])
        cold_tokens, cold_logprobs = run(model, b[num_cached:], live)
        assert tokens == cold_tokens
        assert max_diff(logprobs, cold_logprobs) == 0.0


@pytest.mark.parametrize(
    ("arch", "reason"),
    [("gemma3_text", "window_not_covered"), ("mamba2", "partial_block")],
)
def test_a_junction_checkpoint_serves_the_third_prompt(arch, reason):
    """A finished cache lacks old windows / snapshots: the second prompt sharing its
    first 56 tokens misses; its prefill keeps the state where it leaves the first
    (the junction), and the third resumes there, exactly."""
    model = tiny_model(arch)
    shared = prompt(1, 56)
    a, b, c = (shared + prompt(s, 30) for s in (2, 3, 4))
    with hot_pc(model) as pc:
        finished, _ = cold(model, a)
        assert pc.store(a, finished) == len(a) // BLOCK  # window / state payloads are partial
        _, num_cached = pc.fetch(b)
        assert num_cached == 0
        assert reasons(pc)[reason] == 1  # a's block 3 shares 8 tokens of it, unusably
        assert 56 in pc.checkpoints(b)  # the junction
        pc.prefill(b, prefill_step_size=BLOCK)  # misses again, then keeps the state at 56
        restored, num_cached = pc.fetch(c)
        assert num_cached == 56
        assert reasons(pc)[reason] == 2  # no new miss for c
        logits = model(mx.array([c[56:]]), cache=restored)[:, -1, :]
        live, pos = make_prompt_cache(model), 0
        for end in (16, 32, 48, 56):  # b's chunks up to its checkpoint
            model(mx.array([c[pos:end]]), cache=live)
            pos = end
        want = model(mx.array([c[56:]]), cache=live)[:, -1, :]
        assert max_diff(logits, want) == 0.0
        # negative control: a's state at its end, continued with c's tokens
        theirs, _ = pc.fetch([*a, 1])
        wrong = model(mx.array([c[56:]]), cache=theirs)[:, -1, :]
        assert max_diff(wrong, want) > 0.0


def test_checkpoints_end_chunks_whatever_the_step():
    """With 32-token chunks the state is kept at every interval point (16) and at the
    junction (56) all the same: they end chunks of their own."""
    model = tiny_model("mamba2")
    shared = prompt(1, 56)
    a, b = shared + prompt(2, 30), shared + prompt(3, 30)
    with hot_pc(model) as pc:
        pc.prefill(a, prefill_step_size=32)
        assert pc.match(b) == 48
        cuts = pc.checkpoints(b, 48)
        assert cuts == [56, 64, 75, 80]  # junction, interval points, the end minus 11
        _, logits = pc.prefill(b, prefill_step_size=32)
        assert pc.stats()["cached_tokens"] == 48
        live, pos = make_prompt_cache(model), 0
        for end in (16, 32, 48, *cuts, len(b)):  # a's chunks, then b's
            want = model(mx.array([b[pos:end]]), cache=live)[:, -1, :]
            pos = end
        assert max_diff(logits, want) == 0.0
        assert pc.match(shared + prompt(4, 30)) == 56


def test_snapshot_interval_bounds_snapshots():
    model = tiny_model("mamba2")
    tokens = prompt(1, 100)
    with hot_pc(model, snapshot_interval=2) as pc:
        pc.prefill(tokens, prefill_step_size=BLOCK)
        with_state = [b.index for b in pc.hot if any(n.startswith("0.") for n in b.arrays)]
        # boundaries 32, 64, 96, the end minus 11 (a tail at 80..89), the end (96..100)
        assert sorted(with_state) == [1, 3, 5, 5, 6]
        assert pc.match(prompt(1, 90) + [7] * 20) == 89


@pytest.mark.parametrize("ratio", [1.0, 0.25])
def test_default_interval_bounds_snapshot_bytes_by_the_kv(ratio):
    """snapshot_interval=0: interval snapshots cost at most ``ratio`` x the K/V under
    them, plus one snapshot at each early point (after 1, 2, 4 ... blocks)."""
    model = tiny_model("qwen3_next")
    tokens = prompt(1, 130)
    with hot_pc(model, snapshot_interval=0, snapshot_ratio=ratio) as pc:
        layout = pc.layout
        interval = layout.snapshot_interval
        assert interval == -(-layout.state_bytes // int(ratio * layout.kv_token_bytes * BLOCK))
        pc.prefill(tokens)
        blocks = sorted(pc.hot, key=lambda b: b.index)
        recurrent = {
            f"{i}." for i, c in enumerate(make_prompt_cache(model)) if not c.is_trimmable()
        }

        def state(b):
            return sum(a.nbytes for n, a in b.arrays.items() if n[: n.index(".") + 1] in recurrent)

        with_state = [b.index for b in blocks if state(b)]
        full = [i for i in range(130 // BLOCK) if (i + 1) % interval == 0]
        early = [i for i in range(interval - 1) if (i + 1) & i == 0]  # after 1, 2, 4 ... blocks
        # the interval's points, the early ones below it, the end minus 11 (a tail at
        # 112..119), the end (a tail at 128..130)
        points = sorted({*full, *early})
        assert with_state == sorted([*points, (130 - 11) // BLOCK, 130 // BLOCK])
        interior = sum(state(b) for b in blocks if b.num_tokens == BLOCK)
        kv = sum(b.nbytes - state(b) for b in blocks if b.num_tokens == BLOCK)
        assert interior <= ratio * kv + len(early) * layout.state_bytes


def test_default_step_of_a_recurrent_model_snapshots_every_interval():
    model = tiny_model("qwen3_next")
    tokens = prompt(1, 70)
    with hot_pc(model) as pc:
        pc.prefill(tokens)  # default chunk: one block (snapshot_interval=1)
        assert pc.match([*tokens[:64], 1, 2, 3]) == 64


def test_layout_mismatch_when_a_payload_is_missing():
    """A block whose attention payload is gone shortens the restore (layout_mismatch)."""
    model = tiny_model("llama")
    tokens = prompt(1, 70)
    with hot_pc(model) as pc:
        pc.prefill(tokens, prefill_step_size=BLOCK)
        block = next(b for b in pc.hot if b.index == 2)
        del block.arrays["1.keys"], block.arrays["1.values"]
        _, num_cached = pc.fetch(tokens)
        assert num_cached == 32
        assert reasons(pc)["layout_mismatch"] == 1  # found while rebuilding


def test_capture_checks_the_cache_length():
    model = tiny_model("gemma3_text")
    tokens = prompt(1, 40)
    cache, _ = cold(model, tokens)
    with hot_pc(model) as pc, pytest.raises(ValueError, match="holds 40 tokens but 32"):
        pc.capture(tokens[:32], cache)


def test_no_snapshot_outlives_its_request():
    """Memory is flat across requests once the hot tier is full (snapshots live in blocks)."""
    model = tiny_model("qwen3_next")
    with hot_pc(model, hot_max_bytes=256 << 10) as pc:

        def requests(first: int, n: int) -> int:
            for i in range(first, first + n):
                pc.prefill(prompt(100 + i, 40 + i % 7), prefill_step_size=BLOCK)
            gc.collect()
            return mx.get_active_memory() - pc.hot.nbytes

        requests(0, 10)
        after_10 = requests(10, 1)
        after_40 = requests(11, 30)
        assert pc.hot.nbytes <= 256 << 10
        assert after_40 <= after_10 + (64 << 10)


def test_upgrades_reach_the_ssd_tier(tmp_path):
    """write_through: the fuller block replaces the SSD copy; it serves after a restart."""
    model = tiny_model("gemma3_text")
    shared = prompt(1, 56)
    a, b, c = (shared + prompt(s, 30) for s in (2, 3, 4))
    config = CacheConfig(
        block_size=BLOCK, hot_cache_only=False, ssd_dir=str(tmp_path), write_policy="write_through"
    )
    with PrefixCache(model, config, model_id="tiny") as pc:
        pc.store(a, cold(model, a)[0])
        pc.prefill(b, prefill_step_size=BLOCK)
        assert pc.stats()["upgraded_blocks"] == 3
    with PrefixCache(model, config, model_id="tiny") as pc:  # a restart: the hot tier is empty
        restored, num_cached = pc.fetch(c)  # at b's junction checkpoint
        assert num_cached == 56
        assert pc.stats()["ssd_block_hits"] >= 3
        live, _ = cold(model, c[:56])
        tail = mx.array([c[56:]])
        assert max_diff(model(tail, cache=restored), model(tail, cache=live)) == 0.0


def test_partial_blocks_on_the_ssd_tier_are_found_while_loading(tmp_path):
    """The SSD index does not list payload names: the rebuild finds the gap instead."""
    model = tiny_model("gemma3_text")
    shared = prompt(1, 56)
    a, b = shared + prompt(2, 30), shared + prompt(3, 30)
    config = CacheConfig(
        block_size=BLOCK, hot_cache_only=False, ssd_dir=str(tmp_path), hot_max_bytes=1
    )
    with PrefixCache(model, config, model_id="tiny") as pc:
        pc.store(a, cold(model, a)[0])
        pc.flush()
        _, num_cached = pc.fetch(b)
        assert num_cached == 0
        assert reasons(pc) == {"window_not_covered": 1}
