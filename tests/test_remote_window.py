"""Window layers through the real remote tier (redis-server): a second host restores a
gemma3_text chain long enough that the window layers' payloads of early blocks are
read by no layer (``UNNEEDED``); it skips them (hashed in a scratch, left out of the
block) and its restores equal the live run bit for bit.

Tiny gemma3_text: 2 window layers (window 16) and 2 global ones, 8-token blocks,
``snapshot_interval=6``: a 100-token prompt keeps window payloads in blocks 3-5
(restores at 48) and 9-11 (at 96); a restore at 96 reads blocks 3-5's window
tensors for nothing.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import RotatingKVCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory.host import UNNEEDED
from prefixcache.tiers.remote import fill, reader

BLOCK = 8


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3_text")


def host(model, url: str, ssd_dir, **settings) -> PrefixCache:
    config = CacheConfig(
        block_size=BLOCK,
        snapshot_interval=6,
        checkpoint_tail=0,
        ssd_dir=str(ssd_dir),
        ssd_min_free_bytes=0,
        remote_url=url,
        **settings,
    )
    return PrefixCache(model, config, model_id="tiny")


@pytest.fixture
def skipped(monkeypatch):
    """Bytes of the tensors the remote reader skipped (a spy on the real scratch runs)."""
    seen: list[int] = []
    real = fill._scratch_runs

    def spy(size: int):
        seen.append(size)
        return real(size)

    monkeypatch.setattr(fill, "_scratch_runs", spy)
    return seen


def restored_on_a_second_host(gemma, redis_server, probe, stored, secret=None):
    """Host one prefills ``stored`` through to the server; host two (an empty SSD tier,
    a hot tier of one byte, nothing promoted) restores ``probe`` from it: (its cache,
    tokens restored)."""
    url, where = redis_server.url, redis_server.workdir
    with host(gemma, url, f"{where}/one", remote_secret=secret) as one:
        one.prefill(stored, prefill_step_size=BLOCK)
        one.flush()
    two = host(gemma, url, f"{where}/two", hot_max_bytes=1, promote=False, remote_secret=secret)
    try:
        cache, num = two.fetch(probe)
        assert two.stats()["remote"]["num_loads"] >= num // BLOCK
        return cache, num
    finally:
        two.close()


@pytest.mark.parametrize("secret", [None, "a secret shared by the hosts"], ids=["plain", "signed"])
@pytest.mark.parametrize("point", [48, 96])
def test_a_remote_restore_skips_unneeded_window_tensors_and_equals_the_live_run(
    gemma, redis_server, skipped, secret, point
):
    a = prompt(1, 100)
    probe = a[:point] + prompt(5, 6)
    cache, num = restored_on_a_second_host(gemma, redis_server, probe, a, secret)
    assert num == point
    # blocks before the window (2 blocks) that kept window payloads: 3 at 48, 3-5 and 9 at 96
    assert len(skipped) == {48: 6, 96: 20}[point] and sum(skipped) > 0
    want = live_logits(gemma, probe, point, step=BLOCK)
    assert max_diff(prefill(gemma, probe[point:], cache, step=BLOCK), want) == 0.0


def test_a_window_layer_changed_after_the_restore_changes_the_logits(gemma, redis_server):
    """Negative control: the same restore with its window layers' keys zeroed."""
    a = prompt(1, 100)
    probe = a[:96] + prompt(5, 6)
    cache, num = restored_on_a_second_host(gemma, redis_server, probe, a)
    assert num == 96
    window = [c for c in cache if isinstance(c, RotatingKVCache)]
    assert len(window) == 2
    for c in window:
        c.keys = mx.zeros_like(c.keys)
    want = live_logits(gemma, probe, 96, step=BLOCK)
    assert max_diff(prefill(gemma, probe[96:], cache, step=BLOCK), want) > 0.0


def test_window_tensors_a_restore_needs_are_never_skipped_into_a_wrong_cache(
    gemma, redis_server, monkeypatch
):
    """The reader told that the needed blocks' window tensors are unneeded too: the
    restore does not use such blocks (it restores less), never a cache without them."""
    prepare = reader.RemoteReader.prepare

    def wrong(self, indices, place):
        def place_all(index, name, dtype, shape, count=1):
            if name.startswith(("0.", "2.")):
                return UNNEEDED
            return place(index, name, dtype, shape, count)

        return prepare(self, indices, place_all if place is not None else None)

    monkeypatch.setattr(reader.RemoteReader, "prepare", wrong)
    a = prompt(1, 100)
    probe = a[:96] + prompt(5, 6)
    cache, num = restored_on_a_second_host(gemma, redis_server, probe, a)
    assert num < 96
    want = live_logits(gemma, probe, num, step=BLOCK)
    assert max_diff(prefill(gemma, probe[num:], cache, step=BLOCK), want) == 0.0
