"""TieredPromptCache stores the inserts mlx-lm makes before a request's first token
after it (mlx_deferred.py): at the request's final insert, at a fetch that could
use them, or at close. Requests run as mlx-lm 0.32.2's server batch path runs
them: system and user segments, a cache extracted at each segment's end."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import prefill, prompt
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from prefixcache.config import CacheConfig
from prefixcache.serve import deferred as mlx_deferred
from prefixcache.serve.prompt_cache import TieredPromptCache

KEY = ("/models/tiny", None, None)
HOT = CacheConfig(block_size=16, hot_cache_only=True)


def serve_segments(cache, model, tokens, system_end, max_tokens=4):
    """One request with its segment inserts, as mlx-lm's server makes them;
    (generated tokens, tokens cached, hot blocks held at the first token)."""
    restored, rest = cache.fetch_nearest_cache(KEY, tokens)
    num_cached = len(tokens) - len(rest)
    segments = [tokens[num_cached:system_end], tokens[max(system_end, num_cached) :]]
    types = [t for s, t in zip(segments, ("system", "user"), strict=True) if s][::-1]
    gen = BatchGenerator(model)
    try:
        gen.insert_segments(
            segments=[[s for s in segments if s]],
            max_tokens=[max_tokens],
            caches=[restored],
            all_tokens=[tokens[:num_cached]],
        )
        out, held = [], None
        for _ in range(len(tokens) + max_tokens + 8):  # bounded: one step per token at least
            done, generated = gen.next()
            ends = [r.uid for r in done if r.end_of_segment and not r.end_of_prompt and types]
            for layers, held_tokens in gen.extract_cache(ends).values():
                cache.insert_cache(KEY, held_tokens[:], layers, cache_type=types.pop())
            for r in generated:
                if held is None:
                    held = len(cache) if isinstance(cache, TieredPromptCache) else 0
                out.append(r.token)
                if r.finish_reason is not None:
                    cache.insert_cache(KEY, r.all_tokens[:], r.prompt_cache)
                    return out, num_cached, held
    finally:
        gen.close()
    raise AssertionError("generation did not finish")


class NoCache:
    def fetch_nearest_cache(self, model_key, tokens):
        return None, list(tokens)

    def insert_cache(self, model_key, tokens, prompt_cache, *, cache_type="assistant"):
        pass


def chats(cache, model, system):
    """Two chats on one system prompt, three turns each: (outputs, cached, held, after)."""
    histories = [list(system), list(system)]
    outputs, cached, held, after = [], [], [], []
    for turn in range(3):
        for conv in range(2):
            tokens = histories[conv] + prompt(100 * conv + turn, 21)
            out, num, at_first = serve_segments(cache, model, tokens, len(system))
            outputs.append(out)
            cached.append(num)
            held.append(at_first)
            after.append(len(cache) if isinstance(cache, TieredPromptCache) else 0)
            histories[conv] = tokens + out
    return outputs, cached, held, after


def test_segment_inserts_are_stored_after_the_first_token_and_stay_exact(llama):
    system = prompt(1, 40)
    cold, *_ = chats(NoCache(), llama, system)
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        tiered.fetch_nearest_cache(KEY, prompt(9, 20))  # opens the model's cache
        ours, cached, held, after = chats(tiered, llama, system)
    assert ours == cold  # restored from deferred inserts, token for token
    assert cached[1] >= 32 and all(n > 40 for n in cached[2:])
    # at each first token, only what earlier requests stored is held; each request's
    # final insert stores its segment inserts and its own blocks
    assert held == [0, *after[:-1]]
    assert all(b > a for a, b in zip(held, after, strict=True))


def test_an_assistant_insert_is_stored_at_once(llama):
    """The control: an insert at the end of a request is not deferred."""
    tokens = prompt(2, 40)
    cache = make_prompt_cache(llama)
    prefill(llama, tokens, cache)
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        tiered.fetch_nearest_cache(KEY, prompt(9, 20))
        tiered.insert_cache(KEY, tokens, cache, cache_type="assistant")
        assert len(tiered) >= 2


def test_a_deferred_insert_is_stored_for_a_fetch_that_can_use_it_or_at_close(llama, tmp_path):
    a, b = prompt(3, 40), prompt(4, 40)
    caches = {}
    for name, tokens in (("a", a), ("b", b)):
        caches[name] = make_prompt_cache(llama)
        prefill(llama, tokens, caches[name])
    config = CacheConfig(block_size=16, ssd_dir=str(tmp_path / "ssd"))
    with TieredPromptCache(lambda key: llama, config) as tiered:
        tiered.fetch_nearest_cache(KEY, prompt(9, 20))
        tiered.insert_cache(KEY, a, caches["a"], cache_type="user")
        tiered.insert_cache(KEY, b, caches["b"], cache_type="system")
        assert len(tiered) == 0
        _, rest = tiered.fetch_nearest_cache(KEY, prompt(5, 40))  # shares no block
        assert len(rest) == 40 and len(tiered) == 0
        _, rest = tiered.fetch_nearest_cache(KEY, [*a, 7])
        assert len(rest) == 1  # a was stored first, then restored whole
        assert len(tiered._deferred) == 1  # b waits: a fetch of a cannot use it
    with TieredPromptCache(lambda key: llama, config) as reopened:  # close stored b
        _, rest = reopened.fetch_nearest_cache(KEY, [*b, 7])
        assert len(rest) <= 8  # b's full blocks at least, from the SSD tier


@pytest.mark.parametrize("bound", ["count", "bytes"])
def test_an_insert_past_the_bounds_is_stored_at_once(llama, monkeypatch, bound):
    if bound == "count":
        monkeypatch.setattr(mlx_deferred, "MAX_DEFERRED", 2)
    else:  # two of these caches fit, a third does not
        monkeypatch.setattr(mlx_deferred, "MAX_DEFERRED_BYTES", 2 * state_bytes(llama, 32))
    prompts = [prompt(20 + seed, 32) for seed in range(3)]
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        tiered.fetch_nearest_cache(KEY, prompt(9, 20))
        for tokens in prompts:
            cache = make_prompt_cache(llama)
            prefill(llama, tokens, cache)
            tiered.insert_cache(KEY, tokens, cache, cache_type="user")
        assert len(tiered._deferred) == 2 and len(tiered) == 2  # the third's two blocks
        assert tiered.cache.match([*prompts[2], 1]) == 32
        assert tiered.cache.match([*prompts[0], 1]) == 0  # still waiting
        _, rest = tiered.fetch_nearest_cache(KEY, [*prompts[0], 1])
        assert len(rest) == 1


def state_bytes(model, n: int) -> int:
    """Bytes of the arrays of a cache holding ``n`` prefilled tokens (its buffers)."""
    cache = make_prompt_cache(model)
    prefill(model, prompt(1, n), cache)
    leaves = tree_flatten([c.state for c in cache])
    return sum(a.nbytes for _, a in leaves if isinstance(a, mx.array))


@pytest.mark.parametrize("cache_type", ["system", "user"])
def test_deferred_inserts_are_stored_before_a_model_switch(llama, cache_type, tmp_path):
    other = ("/models/other", None, None)
    tokens = prompt(6, 32)
    cache = make_prompt_cache(llama)
    prefill(llama, tokens, cache)
    config = CacheConfig(block_size=16, ssd_dir=str(tmp_path / "ssd"))
    with TieredPromptCache(lambda key: llama, config) as tiered:
        tiered.fetch_nearest_cache(KEY, prompt(9, 20))
        tiered.insert_cache(KEY, tokens, cache, cache_type=cache_type)
        tiered.fetch_nearest_cache(other, tokens)  # KEY's cache is flushed and closed
        assert len(tiered._deferred) == 0
        _, rest = tiered.fetch_nearest_cache(KEY, [*tokens, 1])
        assert len(rest) == 1  # from KEY's SSD tier
