"""TieredPromptCache: mlx-lm's server prompt-cache interface over PrefixCache.

Requests are served the way mlx-lm 0.32.2's server serves them: the batch
path (BatchGenerator, caches extracted from the batch) and the sequential
path (generate_step on the fetched cache, quantized KV, speculative decoding),
and compared token for token with a cold run and with mlx-lm's LRUPromptCache.
"""

from __future__ import annotations

import inspect
import logging
import time

import mlx.core as mx
import pytest
from conftest import QUANT_LLAMA, prompt, tiny_model
from mlx_lm.generate import BatchGenerator, generate_step, speculative_generate_step
from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache

from prefixcache.cli import serve, setup_arg_parser
from prefixcache.config import CacheConfig
from prefixcache.serve import fit as mlx_fit
from prefixcache.serve.fit import MlxLmVersionError, ModelPair
from prefixcache.serve.images import IMAGE_BASE, chain_tokens, image_start
from prefixcache.serve.prefetch import QueuedPrefetch
from prefixcache.serve.prompt_cache import TieredPromptCache
from prefixcache.tiny.models import build_model

KEY = ("/models/tiny", None, None)
HOT = CacheConfig(block_size=16, hot_cache_only=True)


class NoCache:
    """The cold reference: every fetch misses."""

    def fetch_nearest_cache(self, model_key, tokens):
        return None, list(tokens)

    def insert_cache(self, model_key, tokens, prompt_cache, *, cache_type="assistant"):
        pass


def serve_batched(cache, model, tokens, max_tokens=6):
    """One request through BatchGenerator as mlx-lm's server's batch path runs it."""
    restored, rest = cache.fetch_nearest_cache(KEY, tokens)
    num_cached = len(tokens) - len(rest)
    gen = BatchGenerator(model)
    try:
        gen.insert_segments(
            segments=[[rest]],
            max_tokens=[max_tokens],
            caches=[restored],
            all_tokens=[tokens[:num_cached]],
        )
        out = []
        for _ in range(max_tokens + len(rest) + 2):  # bounded: one step per token at least
            _, responses = gen.next()
            for r in responses:
                out.append(r.token)
                if r.finish_reason is not None:
                    cache.insert_cache(KEY, r.all_tokens[:], r.prompt_cache)
                    return out, num_cached
    finally:
        gen.close()
    raise AssertionError("generation did not finish")


def serve_single(cache, model, tokens, max_tokens=6, **kwargs):
    """One request as the server's sequential path runs it (generate_step on the cache)."""
    restored, rest = cache.fetch_nearest_cache(KEY, tokens)
    num_cached = len(tokens) - len(rest)
    restored = restored if restored is not None else make_prompt_cache(model)
    key = list(tokens)
    steps = generate_step(
        mx.array(rest), model, prompt_cache=restored, max_tokens=max_tokens, **kwargs
    )
    for token, _ in steps:
        key.append(token)
    cache.insert_cache(KEY, key, restored)
    return key[len(tokens) :], num_cached


def conversations(serve, cache, model, *, num=2, turns=3, system=64, user=21):
    """Interleaved chats sharing a system prompt; (outputs, cached counts) per request."""
    histories = [prompt(1, system) for _ in range(num)]
    outputs, cached = [], []
    for turn in range(turns):
        for conv in range(num):
            tokens = histories[conv] + prompt(100 * conv + turn, user)
            out, num_cached = serve(cache, model, tokens)
            outputs.append(out)
            cached.append(num_cached)
            histories[conv] = tokens + out
    return outputs, cached


def test_has_the_interface_mlx_lm_server_calls():
    for name in ("fetch_nearest_cache", "insert_cache", "trim_to", "stats_by_type", "__len__"):
        ours = inspect.signature(getattr(TieredPromptCache, name)).parameters
        theirs = inspect.signature(getattr(LRUPromptCache, name)).parameters
        assert [p.kind for p in ours.values()] == [p.kind for p in theirs.values()], name
        keyword = [n for n, p in theirs.items() if p.kind is p.KEYWORD_ONLY]
        assert [n for n in ours if n in keyword] == keyword, name
    assert isinstance(inspect.getattr_static(TieredPromptCache, "nbytes"), property)


@pytest.mark.parametrize("serve", [serve_batched, serve_single])
def test_multi_turn_exact_and_cached_grows(llama, serve):
    cold, _ = conversations(serve, NoCache(), llama)
    lru, lru_cached = conversations(serve, LRUPromptCache(), llama)
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        ours, cached = conversations(serve, tiered, llama)
        stats = tiered.stats()
    assert ours == cold == lru
    # conversation 1 starts on conversation 0's system prompt (64 tokens = 4 blocks)
    assert cached[:2] == [0, 64]
    assert cached[2:] == sorted(cached[2:]) and min(cached[2:]) > 64
    assert stats["hot_block_hits"] > 0 and stats["num_rejected"] == 0
    assert sum(cached) >= sum(lru_cached) - 16 * len(cached)  # block granularity at most


@pytest.mark.parametrize(
    "arch", ["gemma3_text", "llama4", "qwen3_next", "lfm2", "mamba2", "falcon_h1"]
)
def test_every_cache_type_stays_exact_and_hits(arch):
    # The adapter only fetches: what the server skips is what was restored, so
    # the cached_tokens it reports are PrefixCache's. Each insert keeps the
    # state at the sequence's end (recurrent state and window included), so
    # every second turn resumes the whole first one.
    model = tiny_model(arch)
    batched = all(hasattr(c, "merge") for c in make_prompt_cache(model))
    serve = serve_batched if batched else serve_single
    cold, _ = conversations(serve, NoCache(), model, turns=2)
    with TieredPromptCache(lambda key: model, HOT) as tiered:
        ours, cached = conversations(serve, tiered, model, turns=2)
        assert tiered.stats()["num_rejected"] == 0
        stats = tiered.stats()
    assert ours == cold
    assert stats["cached_tokens"] == sum(cached)
    assert cached[0] == 0
    assert min(cached[2:]) >= 64 + 21  # system + first user message at least
    # the second chat shares only the system prompt, where no insert ended: its
    # window / recurrent state there was not kept (a server inserting at the
    # system segment's end keeps it)
    assert cached[1] == 0


def test_cold_request_of_a_recurrent_model_reports_no_cached_tokens():
    model = tiny_model("qwen3_next")
    tokens = prompt(3, 716 // 16)
    with TieredPromptCache(lambda key: model, HOT) as tiered:
        restored, rest = tiered.fetch_nearest_cache(KEY, tokens)
        assert restored is None and rest == tokens  # the server reports 0 cached tokens
        assert tiered.stats()["cached_tokens"] == 0 and tiered.stats()["num_misses"] == 1
        out, num_cached = serve_single(tiered, model, tokens)
        assert num_cached == 0
        follow = [*tokens, *out, *prompt(4, 5)]
        out2, num_cached = serve_single(tiered, model, follow)
        assert num_cached >= len(tokens) + len(out) - 1  # the whole first turn
        assert tiered.stats()["cached_tokens"] == num_cached
    cold_out, _ = serve_single(NoCache(), model, follow)
    assert out2 == cold_out


class Poisoned(TieredPromptCache):
    """Negative control: restored keys are scaled, so a hit must change the outputs."""

    def fetch_nearest_cache(self, model_key, tokens):
        restored, rest = super().fetch_nearest_cache(model_key, tokens)
        for layer in restored or ():
            layer.keys = layer.keys * 3
        return restored, rest


def test_outputs_depend_on_the_restored_cache(llama):
    cold, _ = conversations(serve_batched, NoCache(), llama)
    with Poisoned(lambda key: llama, HOT) as poisoned:
        wrong, cached = conversations(serve_batched, poisoned, llama)
    assert max(cached) > 64 and wrong != cold


def test_quantized_kv_sequential_path():
    model = tiny_model("llama", **QUANT_LLAMA)
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    cold, _ = conversations(lambda c, m, t: serve_single(c, m, t, **kv), NoCache(), model)
    config = HOT.replace(**kv)
    with TieredPromptCache(lambda key: model, config) as tiered:
        serve = lambda c, m, t: serve_single(c, m, t, **kv)  # noqa: E731
        ours, cached = conversations(serve, tiered, model)
        assert tiered.stats()["num_rejected"] == 0
    assert ours == cold and cached[-1] > 64


def test_draft_model_pair(llama):
    draft = tiny_model("llama", seed=1)
    pair = ModelPair(llama, draft)

    def serve(cache, model, tokens, max_tokens=6):
        restored, rest = cache.fetch_nearest_cache(KEY, tokens)
        restored = restored if restored is not None else pair.make_cache()
        steps = speculative_generate_step(
            mx.array(rest), llama, draft, prompt_cache=restored, max_tokens=max_tokens
        )
        out = [token for token, _, _ in steps]
        cache.insert_cache(KEY, tokens + out, restored)  # the last token is not in the cache
        return out, len(tokens) - len(rest)

    cold, _ = conversations(serve, NoCache(), pair)
    with TieredPromptCache(lambda key: pair, HOT) as tiered:
        ours, cached = conversations(serve, tiered, pair)
        assert tiered.stats()["num_rejected"] == 0
    assert ours == cold and cached[-1] > 64


def test_trim_to_len_nbytes_and_stats_by_type(llama):
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        assert (len(tiered), tiered.nbytes) == (0, 0)
        conversations(serve_batched, tiered, llama)
        full = tiered.nbytes
        by_type = tiered.stats_by_type()
        assert by_type == {"hot": {"n_sequences": len(tiered), "n_bytes": full}}
        tiered.trim_to(n_sequences=3)  # sequences share blocks: a count keeps them
        assert tiered.nbytes == full
        tiered.trim_to(n_bytes=full // 2)
        assert 0 < tiered.nbytes <= full // 2
        tiered.trim_to(n_bytes=-5)
        assert (len(tiered), tiered.nbytes) == (0, 0)
        conversations(serve_batched, tiered, llama, turns=1)
        tiered.trim_to(n_sequences=0)
        assert tiered.nbytes == 0


def test_bad_insert_is_refused_without_raising(llama, caplog):
    with TieredPromptCache(lambda key: llama, HOT) as tiered, caplog.at_level(logging.WARNING):
        cache = make_prompt_cache(llama)[:1]  # one layer of two
        llama(mx.array([prompt(0, 20)]), cache=make_prompt_cache(llama))
        tiered.insert_cache(KEY, prompt(0, 20), cache)
        tiered.insert_cache(KEY, prompt(0, 20), cache)
        assert tiered.stats()["num_rejected"] == 2
    assert len([r for r in caplog.records if "not stored" in r.message]) == 1


def test_image_prompts_are_keyed_by_image_and_never_cut_inside_one(llama):
    # mlx-lm's vision cache key: an image's patch tokens all hold one negative id
    text, image, other = prompt(4, 40), [-(1 << 59)] * 8, [-(1 << 58)] * 8
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        cache = make_prompt_cache(llama)
        llama(mx.array([text + [7] * 8 + text[:20]]), cache=cache)  # patches as some token
        tiered.insert_cache(KEY, text + image + text[:20], cache)
        restored, rest = tiered.fetch_nearest_cache(KEY, text + image + text)
        assert rest == text[20:] and restored[0].offset == 68  # past the image
        restored, rest = tiered.fetch_nearest_cache(KEY, text + other + text)
        assert rest == other + text and restored[0].offset == 40  # up to the other image
        assert tiered.fetch_nearest_cache(KEY, image + text) == (None, image + text)
        cache = make_prompt_cache(llama)
        llama(mx.array([text[:30] + [7] * 6]), cache=cache)
        tiered.insert_cache(KEY, text[:30] + image[:6], cache)  # ends inside the image
        restored, rest = tiered.fetch_nearest_cache(KEY, text[:30] + image + text)
        assert rest == image + text and restored[0].offset == 30  # not inside it
        stats = tiered.stats()
        assert stats["cached_tokens"] == 68 + 40 + 30  # one restore each, none undone
        assert stats["num_rejected"] == 0


def test_image_chain_tokens():
    image, other = [-(1 << 59)] * 3, [-5] * 3
    mapped = chain_tokens([1, *image, 2, *other, *image])
    assert mapped[0] == 1 and mapped[4] == 2
    patches = mapped[1:4] + mapped[5:]
    assert all(IMAGE_BASE <= t < 1 << 32 for t in patches)
    assert mapped[1:4] == mapped[8:] and len(set(mapped[1:4])) == 3  # per image and place
    assert not set(mapped[1:4]) & set(mapped[5:8])  # another image, other tokens
    assert chain_tokens(text := prompt(0, 9)) is text
    assert [image_start([1, *image, 2], n) for n in range(6)] == [0, 1, 1, 1, 4, 5]
    with pytest.raises(ValueError, match=str(1 << 31)):
        chain_tokens([-1, 1 << 31])


class OddCache(KVCache):
    """A cache class without a codec (the registry is keyed by exact class)."""


def test_model_without_codec_is_served_uncached(caplog):
    model = build_model("llama")
    model.make_cache = lambda: [OddCache() for _ in model.layers]
    tokens = prompt(0, 40)
    with TieredPromptCache(lambda key: model, HOT) as tiered, caplog.at_level(logging.WARNING):
        out, _ = serve_single(tiered, model, tokens)
        assert tiered.fetch_nearest_cache(KEY, tokens + out) == (None, tokens + out)
    assert any("without a prompt cache" in r.message for r in caplog.records)


def test_model_switch_opens_one_cache_at_a_time(llama):
    other = tiny_model("llama", seed=2)
    models = {"a": llama, "b": other}
    calls = []

    def model_for(key):
        calls.append(key)
        return models[key]

    tokens = prompt(3, 40)
    with TieredPromptCache(model_for, HOT) as tiered:
        for key in ("a", "b", "b", "a"):
            restored, rest = tiered.fetch_nearest_cache(key, tokens)
            cache = restored or make_prompt_cache(models[key])
            models[key](mx.array([rest]), cache=cache)
            tiered.insert_cache(key, tokens, cache)
        assert calls == ["a", "b", "a"] and tiered.stats()["model_key"] == "a"


def test_ssd_restart_serves_old_conversation(llama, tmp_path):
    config = CacheConfig(block_size=16, ssd_dir=str(tmp_path / "ssd"))
    cold, _ = conversations(serve_batched, NoCache(), llama)
    with TieredPromptCache(lambda key: llama, config) as tiered:
        conversations(serve_batched, tiered, llama)
    with TieredPromptCache(lambda key: llama, config) as tiered:
        ours, cached = conversations(serve_batched, tiered, llama)
        stats = tiered.stats()
    assert ours == cold
    assert cached[0] > 64 and stats["ssd_block_hits"] > 0


def test_version_check(monkeypatch):
    assert mlx_fit.check_mlx_lm_version() == "0.32.2"
    for ok in ("0.32.2", "0.32.9", "0.32.2.post1"):
        mlx_fit.check_mlx_lm_version(ok)
    for bad in ("0.31.0", "0.33.0", "0.33.0rc1", "1.0"):
        with pytest.raises(MlxLmVersionError, match=rf"{bad}.*installed") as err:
            mlx_fit.check_mlx_lm_version(bad)
        assert ">=0.32.2,<0.33" in str(err.value)
    monkeypatch.setattr(mlx_fit, "SUPPORTED_MLX_LM", ("0.40", "0.41"))
    with pytest.raises(MlxLmVersionError, match=r">=0\.40,<0\.41.*0\.32\.2 is installed"):
        TieredPromptCache(lambda key: None, HOT)


def test_serve_on_unsupported_mlx_lm_exits_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(mlx_fit, "SUPPORTED_MLX_LM", ("0.40", "0.41"))
    args = setup_arg_parser().parse_args(["serve", "--model", "m"])
    assert serve.run_serve(args) == 2
    assert "mlx-lm 0.32.2 is installed" in capsys.readouterr().err


def test_serve_args_pass_mlx_lm_options_through(monkeypatch):
    argv = "serve --port 9 --model m --ssd-dir d --max-tokens 5 --hot-max-bytes 1M --temp 0.5"
    args = setup_arg_parser().parse_args(argv.split())
    assert args.mlx_lm_args == ["--port", "9", "--max-tokens", "5", "--temp", "0.5"]
    monkeypatch.setenv("PREFIXCACHE_BLOCK_SIZE", "32")
    config = serve.serve_config(args)
    assert (config.ssd_dir, config.hot_max_bytes, config.block_size) == ("d", 1 << 20, 32)
    assert config.hot_cache_only is False and config.restore_headroom == serve.SERVE_HEADROOM == 1
    monkeypatch.setenv("PREFIXCACHE_RESTORE_HEADROOM", "512")
    assert serve.serve_config(args).restore_headroom == 512
    args = setup_arg_parser().parse_args(["serve", "--model", "m", "--hot-cache-only"])
    assert serve.serve_config(args).hot_cache_only and args.mlx_lm_args == []
    assert serve.set_mx_cache_limit(args) is None  # not given: MLX's own default stays


def test_serve_sets_mlx_buffer_cache_limit():
    args = setup_arg_parser().parse_args(["serve", "--model", "m", "--mx-cache-limit", "3G"])
    assert args.mx_cache_limit == 3 << 30 and args.mlx_lm_args == []
    before = serve.set_mx_cache_limit(args)
    try:
        assert mx.set_cache_limit(before) == 3 << 30  # it was in force
    finally:
        mx.set_cache_limit(before)
    with pytest.raises(SystemExit):
        setup_arg_parser().parse_args(["serve", "--model", "m", "--mx-cache-limit", "lots"])


def test_namespace_names_the_model_path_and_its_weights(llama):
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        serve_batched(tiered, llama, prompt(1, 40))
        model_id = tiered.cache.namespace.model_id
    assert model_id.startswith("/models/tiny@fp:")
    other = tiny_model("llama", seed=1)
    with TieredPromptCache(lambda key: other, HOT) as tiered:
        serve_batched(tiered, other, prompt(1, 40))
        assert tiered.cache.namespace.model_id != model_id  # same path, other weights


class TrimAfterFetch:
    """mlx-lm's batch path as it trims: right after admitting each request."""

    def __init__(self, tiered: TieredPromptCache, limit: int, *, in_flight: bool = True):
        self.tiered, self.limit, self.in_flight = tiered, limit, in_flight

    def fetch_nearest_cache(self, model_key, tokens):
        got = self.tiered.fetch_nearest_cache(model_key, tokens)
        if not self.in_flight:
            self.tiered._last = None  # control: a trim that knows of no request in flight
        self.tiered.trim_to(n_bytes=self.limit)
        return got

    def insert_cache(self, model_key, tokens, prompt_cache, *, cache_type="assistant"):
        self.tiered.insert_cache(model_key, tokens, prompt_cache, cache_type=cache_type)


def two_conversations(tiered: TieredPromptCache, llama) -> tuple[list[int], list[int]]:
    """An older and a newer conversation served once each: their histories."""
    old, new = prompt(1, 64), prompt(2, 64)
    return old + serve_batched(tiered, llama, old)[0], new + serve_batched(tiered, llama, new)[0]


@pytest.mark.parametrize("in_flight", [True, False], ids=["in_flight_first", "control"])
def test_trim_to_evicts_the_request_in_flight_first(llama, in_flight):
    """The chain a request was just restored from is held twice (hot and its cache)
    and kept again by its insert: trimming takes it first, so an older conversation
    survives, and the request's next turn is still restored whole and exactly. The
    control (a trim with no request in flight) evicts the older conversation."""
    ref = NoCache()
    with TieredPromptCache(lambda key: llama, HOT) as tiered:
        old, new = two_conversations(tiered, llama)
        pc = tiered.cache
        assert pc.match([*old, 7]) == len(old)
        turn = [*new, *prompt(3, 16)]
        trim = TrimAfterFetch(tiered, tiered.nbytes // 2, in_flight=in_flight)
        out, cached = serve_batched(trim, llama, turn)
        assert cached == len(new) and out == serve_batched(ref, llama, turn)[0]
        # the older conversation: whole when the in-flight chain went first
        assert (pc.match([*old, 7]) == len(old)) is in_flight
        history = turn + out
        nxt = [*history, *prompt(4, 16)]
        out, cached = serve_batched(tiered, llama, nxt)  # the in-flight one was kept again
        assert cached == len(history) and out == serve_batched(ref, llama, nxt)[0]


def test_with_a_lower_tier_the_request_in_flight_stays_hot(llama, tmp_path):
    """With an SSD tier, evicting the in-flight chain would only move it to disk:
    the store skips it as stored and the next turn reads it back. So the trim keeps
    it hot (the older conversation spills, still restorable) and the next turn is
    served from hot alone, exactly."""
    config = HOT.replace(hot_cache_only=False, ssd_dir=str(tmp_path))
    ref = NoCache()
    with TieredPromptCache(lambda key: llama, config) as tiered:
        old, new = two_conversations(tiered, llama)
        pc = tiered.cache
        turn = [*new, *prompt(3, 16)]
        out, cached = serve_batched(TrimAfterFetch(tiered, tiered.nbytes // 2), llama, turn)
        assert cached == len(new)
        history = turn + out
        ssd_hits = pc.stats()["ssd_block_hits"]
        nxt = [*history, *prompt(4, 16)]
        out, cached = serve_batched(tiered, llama, nxt)
        assert cached == len(history) and out == serve_batched(ref, llama, nxt)[0]
        assert pc.stats()["ssd_block_hits"] == ssd_hits  # every block from hot
        assert pc.match([*old, 7]) == len(old)  # spilled, not lost


def test_a_checkpointed_layout_trims_by_its_policy_alone():
    """Where a layer cannot be cut back (recurrent state), a store cannot make the
    in-flight chain's checkpoints again: ``first`` changes nothing."""
    model = tiny_model("mamba2")
    left = []
    for first in (None, "in flight"):
        with TieredPromptCache(lambda key: model, HOT) as tiered:
            a, b = prompt(1, 64), prompt(2, 64)
            serve_batched(tiered, model, a)
            serve_batched(tiered, model, b)
            tiered.fetch_nearest_cache(KEY, [*b, 5])
            tiered.cache.trim_hot(tiered.nbytes // 2, first=[*b, 5] if first else None)
            left.append(sorted(block.key for block in tiered.cache.hot))
    assert left[0] == left[1]


class Provider:
    """What QueuedPrefetch reads of mlx-lm's ModelProvider: the loaded model, its key
    and tokenizer (here the requests are their prompts' tokens already)."""

    def __init__(self, model):
        self.model, self.model_key, self.tokenizer = model, KEY, object()


def prompt_of(tokenizer, request, args):
    """mlx-lm's ``_tokenize`` result: prompt, segments, their types, state, images."""
    return (list(request), [list(request)], ["assistant"], "normal", None)


def test_a_request_taken_at_once_is_not_prefetched_one_left_waiting_is(tmp_path, llama):
    """The generation thread takes the first request within the pickup time: no
    prefetch starts (promotions and reads beside its own fetch only cost it). The
    second is left waiting (the control): its blocks, on SSD only, are prefetched
    into hot, then restored from there."""
    config = CacheConfig(block_size=16, ssd_dir=str(tmp_path), promote=False)
    with TieredPromptCache(lambda key: llama, config) as tiered:
        history = prompt(1, 64)
        history += serve_batched(tiered, llama, history)[0]
        tiered.trim_to(n_bytes=0)  # the conversation lives on SSD only
        tiered.cache.flush()
        queued = QueuedPrefetch(prompt_of, tiered, pickup=0.05)
        taken = [*history, *prompt(2, 8)]
        queued(Provider(llama), taken, None, None)
        queued.picked(taken)
        time.sleep(0.3)
        assert tiered.stats()["prefetched_blocks"] == 0
        waiting = [*history, *prompt(3, 8)]
        queued(Provider(llama), waiting, None, None)
        deadline = time.monotonic() + 10
        while tiered.stats()["prefetched_blocks"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        tiered.cache.flush()
        assert tiered.stats()["prefetched_blocks"] > 0
        _, cached = serve_batched(tiered, llama, waiting)
        assert cached == len(history) and tiered.stats()["prefetch_hits"] > 0
