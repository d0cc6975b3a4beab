"""Window and hybrid caches restored from the hot and the SSD tier grow like live ones.

Tiny gemma3_text (sliding-window layers beside global ones) and qwen3_next
(gated-delta-net state beside attention): a chain stored from one prefill
chunk (so every block holds the window layers' payload) is restored, then
continued past its restored length (a prefill in 8-token chunks, then greedy
decode steps) with the live run's logits bit for bit. From SSD, the window
layers' payloads of blocks before the window are skipped by the readers (no
layer reads them) and the needed ones are read straight into the restore
buffers, never through an MLX conversion. The controls: one restored block
(or the restored state) changed gives other logits.
"""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache
from test_restore_grows import grow

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache import restore
from prefixcache.memory.host import PlacedRun

BLOCK = 8
STORED = 12 * BLOCK  # 96 tokens: the window (16) reaches back two blocks
# qwen3_next with 1 MiB state arrays (16 value heads of 128 x 128, float32): large
# enough for the restore buffers' unwritten arrays and the hot tier's pooled copies
WIDE_STATE = {
    "linear_num_value_heads": 16,
    "linear_num_key_heads": 8,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}
MODELS = {
    "gemma3_text": ("gemma3_text", {}),
    "qwen3_next": ("qwen3_next", {}),
    "qwen3_next_wide_state": ("qwen3_next", WIDE_STATE),
}


def model_of(name: str):
    arch, overrides = MODELS[name]
    return tiny_model(arch, **overrides)


def config(tier: str, tmp_path, remote_url: str = "") -> CacheConfig:
    if tier == "hot":
        return CacheConfig(block_size=BLOCK, hot_cache_only=True)
    if tier == "remote":  # every block on the remote tier only
        return CacheConfig(
            block_size=BLOCK,
            hot_cache_only=True,
            hot_max_bytes=1,
            promote=False,
            remote_url=remote_url,
        )
    return CacheConfig(
        block_size=BLOCK,
        hot_max_bytes=1,  # every block on SSD only
        promote=False,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        write_queue_bytes=1 << 30,
    )


def kinds(arrays) -> Counter:
    """The kinds of a streamed block's tensors, by payload name's layer."""
    if type(arrays) is PlacedRun:
        return Counter({(name.split(".")[0], "Placed"): 1 for name in arrays})
    return Counter((name.split(".")[0], type(a).__name__) for name, a in arrays.items())


def spy_blocks(monkeypatch) -> dict[int, Counter]:
    """Block index -> the kinds of tensors its payload reached the builders as."""
    seen: dict[int, Counter] = {}
    payloads = restore.ChainLoad.payloads

    def spy(self, index, limit):
        got, resident = payloads(self, index, limit)
        seen.update((index + j, kinds(arrays)) for j, arrays in enumerate(got))
        return got, resident

    monkeypatch.setattr(restore.ChainLoad, "payloads", spy)
    return seen


@pytest.mark.parametrize("tier", ["hot", "ssd", "remote"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_restored_window_and_hybrid_caches_grow_with_the_live_logits(
    arch, tier, tmp_path, monkeypatch, request
):
    model = model_of(arch)
    shared = prompt(1, STORED)
    asked = shared + prompt(3, 37)
    url = request.getfixturevalue("redis_server").url if tier == "remote" else ""
    with PrefixCache(model, config(tier, tmp_path, url), model_id="t") as pc:
        stored = make_prompt_cache(model)
        prefill(model, shared, stored, step=STORED)  # one chunk: every block holds the window
        pc.store(shared, stored)
        pc.flush()
        if tier == "remote":
            assert pc.stats()["hot"]["num_blocks"] == 0  # every block on the remote tier only
        del stored
        seen = spy_blocks(monkeypatch)
        (cache, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == STORED
    special = [i for i, c in enumerate(cache) if type(c) in (RotatingKVCache, ArraysCache)]
    assert special, [type(c).__name__ for c in cache]
    if arch == "qwen3_next_wide_state":
        assert max(a.nbytes for c in cache if type(c) is ArraysCache for a in c.cache) >= 1 << 20

    live_cache = make_prompt_cache(model)
    prefill(model, shared, live_cache, step=STORED)
    want = grow(model, live_cache, asked[num:], 6, step=BLOCK)
    got = grow(model, cache, asked[num:], 6, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 7

    if tier != "hot":  # no window or state tensor became an MLX array on the way
        layers = {str(i) for i in special}
        streamed = Counter()
        for index, counts in seen.items():
            streamed.update(
                {(index, kind) for (layer, kind), _ in counts.items() if layer in layers}
            )
        assert streamed, seen
        assert all(kind in ("Placed", "HostArray") for _, kind in streamed), streamed
        # blocks before the window (or the state's boundary) carried none of theirs
        last = STORED // BLOCK - 1
        assert all(index >= last - 2 for index, _ in streamed), sorted(streamed)

    # the control: a restored block of a window layer (the state of a recurrent
    # one) changed gives other logits
    c = bad[special[0]]
    if type(c) is RotatingKVCache:
        c.keys[..., -BLOCK:, :] = c.keys[..., -BLOCK:, :] * 0.5
    else:
        c[1] = c[1] * 0.5
    wrong = grow(model, bad, asked[num:], 6, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0


@pytest.mark.parametrize("arch", list(MODELS))
def test_window_and_state_blocks_of_a_streamed_restore_come_in_place(arch, tmp_path, monkeypatch):
    """From SSD, the last block's window-layer tensors (gemma3) and state snapshot
    (qwen3_next) are read straight into the restore's arrays (Placed: the buffers
    were made from its header before the stream started), and blocks before the
    window carry none of theirs (skipped by the readers)."""
    model = model_of(arch)
    shared = prompt(5, STORED)
    with PrefixCache(model, config("ssd", tmp_path), model_id="t") as pc:
        stored = make_prompt_cache(model)
        prefill(model, shared, stored, step=STORED)
        pc.store(shared, stored)
        pc.flush()
        seen = spy_blocks(monkeypatch)
        cache, num = pc.fetch(shared + prompt(6, 3))
    assert num == STORED
    special = [str(i) for i, c in enumerate(cache) if type(c) in (RotatingKVCache, ArraysCache)]
    last = STORED // BLOCK - 1
    assert all(seen[last][(layer, "Placed")] for layer in special), seen[last]
    assert not any(seen[last][(layer, "HostArray")] for layer in special), seen[last]
    assert not any(k[0] in special for i in range(last - 2) for k in seen[i]), seen
