"""PrefixCache over both tiers: policies, hot_cache_only, restart, corruption, caps."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import live_logits, max_diff, prefill, prompt, store_fetch_in_threads
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16
BLOCK_BYTES = 8192  # tiny llama: 2 layers x K,V x 2 heads x 16 tokens x 16 dims x fp32


def config(tmp_path, **changes) -> CacheConfig:
    base = CacheConfig(
        ssd_run_tokens=0, block_size=BLOCK, ssd_dir=str(tmp_path / "ssd"), ssd_min_free_bytes=0
    )
    return base.replace(**changes)


def filled(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    return cache


def payload_files(tmp_path) -> list[str]:
    root = tmp_path / "ssd"
    return sorted(str(p) for p in root.rglob("*.safetensors")) if root.exists() else []


def writer_threads() -> int:
    return sum(t.is_alive() and t.name.startswith("prefixcache") for t in threading.enumerate())


def test_hot_cache_only_touches_no_disk(tmp_path, llama):
    tokens = prompt(1, 5 * BLOCK)
    before = writer_threads()
    with PrefixCache(
        llama, config(tmp_path, hot_cache_only=True, hot_max_bytes=2 * BLOCK_BYTES)
    ) as pc:
        assert writer_threads() == before
        pc.store(tokens, filled(llama, tokens))  # evicts 3 of 5 blocks: discarded
        pc.flush()
        st = pc.stats()
        assert "ssd" not in st and st["num_discarded"] == 3
    assert not (tmp_path / "ssd").exists()
    assert os.listdir(tmp_path) == []


def test_write_back_writes_nothing_while_hot_has_room(tmp_path, llama):
    tokens = prompt(2, 4 * BLOCK)
    with PrefixCache(llama, config(tmp_path), model_id="m") as pc:
        pc.store(tokens, filled(llama, tokens))
        pc.ssd.flush()
        assert pc.stats()["ssd"]["num_writes"] == 0 and payload_files(tmp_path) == []
    # close() persisted the dirty hot blocks
    assert len(payload_files(tmp_path)) == 4


def test_write_back_spills_on_eviction(tmp_path, llama):
    tokens = prompt(3, 6 * BLOCK)
    cfg = config(tmp_path, hot_max_bytes=2 * BLOCK_BYTES)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(tokens, filled(llama, tokens))
        pc.ssd.flush()
        st = pc.stats()
        # the 4 evicted and, written before them, their 2 ancestors still in hot
        assert st["num_spills"] == 6 and st["ssd"]["num_writes"] == 6
        assert st["hot"]["nbytes"] <= 2 * BLOCK_BYTES
        cache, num_cached = pc.fetch([*tokens, 7])  # hot and ssd blocks mixed
        assert num_cached == 6 * BLOCK
        restored = prefill(llama, [7], cache)
    assert max_diff(restored, live_logits(llama, [*tokens, 7], 6 * BLOCK)) == 0.0


def test_write_through_has_every_block_on_ssd_after_flush(tmp_path, llama):
    tokens = prompt(4, 3 * BLOCK + 5)
    with PrefixCache(llama, config(tmp_path, write_policy="write_through"), model_id="m") as pc:
        pc.store(tokens, filled(llama, tokens))
        pc.flush()
        assert len(payload_files(tmp_path)) == 4  # 3 full blocks and the 5-token tail
        assert pc.stats()["ssd"]["num_blocks"] == 4


RESTART_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import mlx.core as mx
    from conftest import live_logits, max_diff, prefill, prompt, tiny_model

    from prefixcache import CacheConfig, PrefixCache

    llama = tiny_model("llama")
    cfg = CacheConfig(ssd_run_tokens=0, block_size=16, ssd_dir={ssd!r}, ssd_min_free_bytes=0)
    tokens = prompt(5, 4 * 16) + prompt(6, 9)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        cache, n = pc.fetch(tokens)
        got = prefill(llama, tokens[n:], cache)
        print(n, max_diff(got, live_logits(llama, tokens, n)), pc.stats()["ssd_block_hits"])
    """
)


def test_restart_in_a_new_process_restores_exactly(tmp_path, llama):
    tokens = prompt(5, 4 * 16) + prompt(6, 9)
    with PrefixCache(llama, config(tmp_path), model_id="m") as pc:
        pc.store(tokens, filled(llama, tokens))
    code = RESTART_CHILD.format(tests=os.path.dirname(__file__), ssd=str(tmp_path / "ssd"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    num_cached, diff, ssd_hits = out.stdout.split()
    # 4 blocks and the tail, cut back to leave one token to prefill
    assert (int(num_cached), float(diff), int(ssd_hits)) == (4 * BLOCK + 8, 0.0, 5)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_payload_shortens_the_match(tmp_path, llama, damage):
    tokens = prompt(7, 4 * BLOCK + 3)
    with PrefixCache(llama, config(tmp_path, hot_max_bytes=1), model_id="m") as pc:
        pc.store(tokens, filled(llama, tokens))
        pc.flush()
        keys = [m.key for m in sorted(pc.ssd.iter_meta(), key=lambda m: m.index)]
        victim = next(p for p in payload_files(tmp_path) if keys[2].hex() in p)
        if damage == "flip":
            with open(victim, "r+b") as f:
                f.seek(-5, os.SEEK_END)
                byte = f.read(1)
                f.seek(-5, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif damage == "truncate":
            os.truncate(victim, os.path.getsize(victim) // 2)
        else:
            os.unlink(victim)
        cache, num_cached = pc.fetch(tokens)
        assert num_cached == 2 * BLOCK
        restored = prefill(llama, tokens[num_cached:], cache)
        assert max_diff(restored, live_logits(llama, tokens, num_cached)) == 0.0
        st = pc.stats()
        assert st["ssd"]["num_corrupt"] == 1 and st["miss_reasons"]["corrupt"] == 1
        # quarantined: the next fetch stops at the same block without re-reading it
        assert pc.match(tokens) == 2 * BLOCK


def test_caps_hold_under_a_stream_of_prompts(tmp_path, llama):
    cap = 5 * BLOCK_BYTES
    cfg = config(tmp_path, hot_max_bytes=2 * BLOCK_BYTES, ssd_max_bytes=cap)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        for i in range(6):
            tokens = prompt(100 + i, 3 * BLOCK)
            pc.store(tokens, filled(llama, tokens))
            pc.flush()
            on_disk = sum(os.path.getsize(p) for p in payload_files(tmp_path))
            assert on_disk <= cap
            assert pc.stats()["hot"]["nbytes"] <= 2 * BLOCK_BYTES
        assert pc.stats()["ssd"]["num_evictions"] > 0


def test_threads_fetch_and_store_while_the_writer_spills(tmp_path, llama):
    system = prompt(8, 2 * BLOCK)
    users = [system + prompt(30 + i, 2 * BLOCK + 1) for i in range(4)]
    caches = [filled(llama, u) for u in users]
    cfg = config(tmp_path, hot_max_bytes=3 * BLOCK_BYTES)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        store_fetch_in_threads(pc, users, caches, rounds=10)
        assert pc.stats()["num_spills"] > 0


def test_tiers_given_by_the_caller_replace_the_built_ones(tmp_path, llama):
    """A tier written against the contract alone (dict_tier.py) gets write-back spills,
    serves exact restores, and is closed with the cache; no SSD tier is opened."""
    from dict_tier import DictTier

    tokens = prompt(3, 4 * BLOCK)
    lower = DictTier()
    cfg = config(tmp_path, hot_max_bytes=2 * BLOCK_BYTES)
    with PrefixCache(llama, cfg, model_id="m", tiers=[lower]) as pc:
        assert pc.ssd is None and pc.tiers.lower == [lower]
        pc.store(tokens, filled(llama, tokens))
        # the first leaf evicted, after its 2 ancestors in hot (the 2nd evicted: written)
        assert lower.num_puts == 3 and pc.stats()["num_spills"] == 3
        pc.trim_hot(0)
        cache, num = pc.fetch([*tokens, 7])
        assert num == 4 * BLOCK and pc.stats()["remote_block_hits"] == 4
        logits = prefill(llama, [7], cache, step=BLOCK)
        assert max_diff(logits, live_logits(llama, [*tokens, 7], num, step=BLOCK)) == 0.0
        # negative control: the tier serving another block's payload changes the logits
        entries = sorted(lower.entries.values(), key=lambda e: e.index)
        lower.entries[entries[3].key] = dataclasses.replace(entries[3], payload=entries[2].payload)
        pc.trim_hot(0)
        cache, num = pc.fetch([*tokens, 7])
        wrong = prefill(llama, [7], cache, step=BLOCK)
        assert max_diff(wrong, live_logits(llama, [*tokens, 7], num, step=BLOCK)) > 0.0
    assert lower.closed and not (tmp_path / "ssd").exists()
