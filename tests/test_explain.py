"""``PrefixCache.explain``: where a prompt left the nearest stored sequence and why,
on real tiny models, real tiers and a real chat template that strips reasoning."""

from __future__ import annotations

import json

import pytest
from conftest import prompt, tiny_model
from mlx_lm.utils import load_tokenizer

from prefixcache import CacheConfig, Explanation, PrefixCache, Why
from prefixcache.cache.messages import locate, renderer
from prefixcache.tiers.losses import Losses
from prefixcache.tiny.models import CHAT_TEMPLATE, STRIP_THINKING_TEMPLATE, save_tokenizer

BLOCK = 16


def hot_only(**changes) -> CacheConfig:
    return CacheConfig(block_size=BLOCK, hot_cache_only=True, **changes)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny tokenizer with the plain template and with one stripping reasoning."""
    out = {}
    for name, template in (("plain", CHAT_TEMPLATE), ("strip", STRIP_THINKING_TEMPLATE)):
        path = tmp_path_factory.mktemp(name)
        save_tokenizer(path, chat_template=template)
        out[name] = load_tokenizer(path)
    return out


def agent_turns(n: int) -> list[list[dict]]:
    """The messages of an agent's requests: each turn adds an assistant message with
    reasoning and a tool call, then the tool's answer."""
    messages = [
        {"role": "system", "content": "You are a careful assistant with tools. " * 4},
        {"role": "user", "content": "Find the weather in Paris and Rome."},
    ]
    turns = []
    for i in range(n):
        think = f"<think>I should call the tool for step {i} first.</think>"
        messages = [
            *messages,
            {"role": "assistant", "content": f'{think}<tool_call>{{"step": {i}}}</tool_call>'},
            {"role": "tool", "content": f"result {i}: sunny, {20 + i} degrees"},
        ]
        turns.append(messages)
    return turns


def served(pc, tokenizer, messages):
    """Render, prefill and store one request; its tokens."""
    tokens = list(renderer(tokenizer)(messages))
    pc.prefill(tokens)
    return tokens


def test_template_stripping_reasoning_is_named(llama, tokenizers):
    tok = tokenizers["strip"]
    first, second = agent_turns(2)
    with PrefixCache(llama, hot_only(), model_id="tiny") as pc:
        served(pc, tok, first)
        tokens = list(renderer(tok)(second))
        got = pc.explain(tokens, tokenizer=tok, messages=second)
    assert got.why is Why.DIVERGED
    assert (got.message, got.role, got.rerendered) == (2, "assistant", True)
    # the stored side still holds the reasoning, the prompt's side lost it (the
    # tokenizer cuts "<think>" after "<t", which both sides share)
    assert (got.before_text + got.stored_text).endswith("<think>I should call the")
    theirs = got.before_text + got.prompt_text
    assert "<tool_call>" in theirs and "<think>" not in theirs
    assert got.num_cached <= got.divergence < len(tokens) - 1
    assert "message=2; role=assistant; rerendered" in got.short()


def test_template_keeping_turns_is_not_named(llama, tokenizers):
    """Negative control: the plain template renders earlier turns as they were: the
    next turn leaves the stored sequence where it ended, in a new message."""
    tok = tokenizers["plain"]
    first, second = agent_turns(2)
    with PrefixCache(llama, hot_only(), model_id="tiny") as pc:
        stored = served(pc, tok, first)
        tokens = list(renderer(tok)(second))
        got = pc.explain(tokens, tokenizer=tok, messages=second)
    assert got.why is Why.ENDED and not got.rerendered
    assert got.divergence == len(stored) and got.stored_tokens == ()
    assert got.message == 4 and got.role == "assistant"  # the turn the tool answer follows


def test_locate_places_every_message(tokenizers):
    """Under the plain template a message starts where the messages before it end:
    its role header, its content and the generation prompt are placed right."""
    tok = tokenizers["plain"]
    messages = agent_turns(3)[-1]
    render = renderer(tok)
    full = list(render(messages))
    for j, message in enumerate(messages):
        start = len(tok.apply_chat_template(messages[:j], tokenize=True)) if j else 0
        assert full[start] == tok.convert_tokens_to_ids("<|im_start|>")
        for index in (start + 1, start + 4):  # its role, then its content
            assert locate(messages, index, full, render) == (j, message["role"])
    assert locate(messages, len(full) - 1, full, render)[0] == len(messages) - 1
    with pytest.raises(ValueError, match="empty"):
        locate([], 0, full, render)
    with pytest.raises(TypeError, match="messages\\[0\\]"):
        locate([{"content": "no role"}], 0, full, render)


def test_locate_from_the_decoded_prompt_agrees_with_rendering(tokenizers):
    """The fast path (contents found in the decoded prompt) places tokens where the
    renders do (every fifth token), under both templates; an empty content falls back
    to the renders."""
    for tok in tokenizers.values():
        for messages in (agent_turns(3)[-1], [*agent_turns(1)[0], {"role": "user", "content": ""}]):
            render = renderer(tok)
            full = list(render(messages))
            for index in [*range(0, len(full), 5), len(full) - 1]:  # renders take time
                rendered = locate(messages, index, full, render)
                assert locate(messages, index, full, render, tok.decode) == rendered, index


def test_evicted_from_hot_names_the_tier(llama):
    a, others = prompt(1, 4 * BLOCK), [prompt(10 + i, 4 * BLOCK) for i in range(6)]
    with PrefixCache(llama, hot_only(hot_max_bytes=200_000), model_id="tiny") as pc:
        pc.prefill(a)
        kept = pc.explain(a)
        for p in others:
            pc.prefill(p)
        got = pc.explain(a)
        fresh = pc.explain(prompt(99, 4 * BLOCK))
    assert kept.why is Why.CACHED and kept.num_cached == len(a) - 1
    assert (got.why, got.tier, got.cause) == (Why.EVICTED, "hot", "evicted")
    assert got.divergence == got.num_cached < len(a) - 1
    assert fresh.why is Why.NEW  # negative control: never stored is not "evicted"


def test_evicted_from_ssd_names_the_tier(llama, tmp_path):
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        counters_save_seconds=0,
        hot_max_bytes=100_000,
        ssd_max_bytes=150_000,
        write_policy="write_through",
    )
    a = prompt(1, 4 * BLOCK)
    with PrefixCache(llama, cfg, model_id="tiny") as pc:
        pc.prefill(a)
        pc.flush()
        for i in range(10):
            pc.prefill(prompt(20 + i, 4 * BLOCK))
            pc.flush()
        got = pc.explain(a)
        assert pc.stats()["ssd"]["num_evictions"] > 0
    assert got.why is Why.EVICTED and got.tier == "ssd"


def test_refused_by_ssd_admission_is_named(llama, tmp_path):
    """A block hot evicted and the SSD tier did not admit (seen once, ``ssd_admit_after=2``)."""
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        counters_save_seconds=0,
        hot_max_bytes=100_000,
        ssd_admit_after=2,
    )
    a = prompt(1, 4 * BLOCK)
    with PrefixCache(llama, cfg, model_id="tiny") as pc:
        pc.prefill(a)
        for i in range(6):
            pc.prefill(prompt(20 + i, 4 * BLOCK))
        got = pc.explain(a)
        assert pc.stats()["ssd_writes_skipped"] > 0
    assert (got.why, got.tier, got.cause) == (Why.NOT_ADMITTED, "ssd", "not admitted")


def test_another_salt_is_named(llama):
    a = prompt(1, 5 * BLOCK)
    with PrefixCache(llama, hot_only(), model_id="tiny") as pc:
        pc.prefill(a, extra={"cache_salt": "team-a"})
        same = pc.explain(a, extra={"cache_salt": "team-a"})
        other = pc.explain(a, extra={"cache_salt": "team-b"})
        unsalted = pc.explain(a)
    assert same.why is Why.CACHED  # negative control
    assert other.why is Why.OTHER_NAMESPACE and other.num_cached == 0
    assert '"cache_salt": "team-a"' in other.namespace
    assert '"cache_salt": "team-b"' in other.namespace
    assert unsalted.why is Why.OTHER_NAMESPACE


def test_record_is_frozen_and_json_ready(llama):
    with PrefixCache(llama, hot_only(), model_id="tiny") as pc:
        got = pc.explain(prompt(1, 20))
    assert isinstance(got, Explanation)
    with pytest.raises(AttributeError):
        got.why = Why.CACHED  # type: ignore[misc]
    doc = json.loads(json.dumps(got.as_dict()))
    assert doc["why"] == "new" and doc["num_tokens"] == 20


def test_losses_are_bounded_and_forget_what_is_stored_again():
    losses = Losses(max_keys=3)
    losses.lost("hot", [b"a", b"b", b"c", b"d"], "evicted")
    assert len(losses) == 3 and losses.of(b"a") is None
    assert losses.of(b"d").tier == "hot"

    class Entry:
        key = b"d"

    losses.stored("ssd", [Entry()])
    assert losses.of(b"d") is None
    with pytest.raises(ValueError, match="max_keys"):
        Losses(max_keys=0)


def test_right_after_a_fetch_explains_what_it_found(llama):
    """Reusing the fetch's lookup gives the record a new lookup gives; a store after
    the fetch is seen (nothing stale is reused)."""
    a = prompt(1, 5 * BLOCK)
    b = a[: 3 * BLOCK + 5] + prompt(2, 2 * BLOCK)
    with PrefixCache(llama, hot_only(), model_id="tiny") as pc:
        pc.prefill(a)
        _, num_cached = pc.fetch(b)
        reused = pc.explain(b)
        pc.match(a)  # another prompt's lookup: the next explain looks again
        again = pc.explain(b)
        pc.prefill(b[: 4 * BLOCK])  # stores its blocks
        after = pc.explain(b)
    assert reused == again and reused.why is Why.DIVERGED
    assert reused.num_cached == num_cached and reused.divergence == 3 * BLOCK + 5
    assert after.num_cached == 4 * BLOCK and after.why is Why.ENDED


def test_state_missing_where_a_recurrent_layer_cannot_resume():
    """A prompt leaving a stored sequence inside a block of a recurrent model: the
    shared tokens cannot be restored without a snapshot there."""
    model = tiny_model("mamba2")
    a = prompt(1, 4 * BLOCK)
    b = a[: 2 * BLOCK + 7] + prompt(2, 2 * BLOCK)
    with PrefixCache(model, hot_only(), model_id="tiny") as pc:
        pc.prefill(a)
        got = pc.explain(b)
        on = pc.explain(a + prompt(3, 5))  # negative control: state where it ends
    assert got.why is Why.STATE_MISSING and got.num_cached < 2 * BLOCK + 7
    assert got.divergence == got.num_cached and got.cause is not None
    assert on.why is Why.ENDED and on.num_cached == len(a)


def test_another_model_on_the_ssd_tier_is_named(llama, tmp_path):
    """Roots the SSD tier recorded: a prompt stored under another model id."""
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        counters_save_seconds=0,
        write_policy="write_through",
    )
    a = prompt(1, 3 * BLOCK)
    with PrefixCache(llama, cfg, model_id="tiny-a") as pc:
        pc.prefill(a)
    with PrefixCache(llama, cfg, model_id="tiny-b") as pc:
        got = pc.explain(a)
    assert got.why is Why.OTHER_NAMESPACE
    assert 'model: "tiny-a" (this prompt: "tiny-b")' in got.namespace


def test_a_remote_tier_that_is_down_is_named(llama, tmp_path, redis_server):
    def cache(name: str) -> PrefixCache:
        cfg = CacheConfig(
            block_size=BLOCK,
            ssd_dir=str(tmp_path / name),
            ssd_min_free_bytes=0,
            counters_save_seconds=0,
            remote_url=redis_server.url,
            remote_timeout_ms=500,
        )
        return PrefixCache(llama, cfg, model_id="tiny")

    a = prompt(1, 3 * BLOCK + 1)
    with cache("a") as writer:
        writer.prefill(a)
        writer.flush()
    with cache("b") as reader:
        up = reader.explain(a)  # negative control: the remote tier answers
        redis_server.kill()
        down = reader.explain(a)
    assert up.why is Why.CACHED and up.num_cached == 3 * BLOCK
    assert (down.why, down.tier, down.num_cached) == (Why.TIER_DOWN, "remote", 0)
    assert down.cause == "remote_unavailable"


def test_a_session_that_ended_is_named(llama):
    a, b = prompt(1, 3 * BLOCK), prompt(2, 3 * BLOCK)
    with PrefixCache(llama, hot_only(), model_id="tiny") as pc:
        pc.prefill(a, session="chat-1")
        pc.prefill(b, session="chat-2")
        pc.end_session("chat-1")
        gone, kept = pc.explain(a), pc.explain(b)
    assert (gone.why, gone.tier, gone.cause) == (Why.EVICTED, "hot", "session ended")
    assert kept.why is Why.CACHED  # negative control: the other session's blocks stay


def test_serve_hand_off_waits_for_its_fetch_and_can_be_off(llama):
    """The record a fetch files (serve/explain.py) is taken once by its prompt, waited for
    while the fetch has not come, and not made at all when the header is off."""
    import threading

    from prefixcache.serve.explain import Explained

    a = prompt(1, 3 * BLOCK)
    with PrefixCache(llama, hot_only(), model_id="tiny") as pc:
        pc.prefill(a)
        pc.fetch(a)
        on, off = Explained(), Explained(enabled=False)
        late = threading.Timer(0.05, on.put, (a, pc, a, None))
        late.start()
        got = on.take(a, timeout=30)  # waits for the put
        late.join()
        off.put(a, pc, a, None)
        assert got is not None and got.why is Why.CACHED
        assert on.take(a, timeout=0) is None  # taken once
        assert off.take(a, timeout=0) is None  # nothing made
