"""Images and draft models through ``prefixcache serve`` (tools/serve_chats.py).

Real server processes on tiny models built offline: ``prefixcache serve``,
``mlx_lm.server`` and a cache-less ``mlx_lm.server`` (the reference replies)
answer the same greedy chats one request at a time (the image chat: the
first and the last only).

- Images (muse_spark, a sliding-window layer and a full one; images drawn in
  the test as PNG data URLs): a 4-turn chat with an image in turns 1 and 3
  reuses its whole history on every turn, with the reference's replies; a
  turn whose image differs reuses exactly up to that image's first patch,
  and its reply differs (so the reply check can fail on a wrong reuse).
- A draft model (``--draft-model``, speculative decoding): the reference's
  replies, and each turn reuses the previous turn's prompt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from mlx_lm.processors.muse_spark import image_tokens
from mlx_lm.utils import load_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import serve_chats

from prefixcache.tiny.vision import IMAGE_TOKENS, MERGE_SIZE, PATCH_SIZE, PATCH_TOKEN

MAX_TOKENS = 8
IMAGE_PATCHES = (64 // (PATCH_SIZE * MERGE_SIZE)) ** 2  # serve_chats' 64 x 64 images


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chats")


@pytest.fixture(scope="module")
def image_chat(workdir) -> dict[str, list[serve_chats.Sent]]:
    return serve_chats.compare("vision-window", workdir, MAX_TOKENS, servers=("none", "ours"))


@pytest.fixture(scope="module")
def draft_chat(workdir) -> dict[str, list[serve_chats.Sent]]:
    return serve_chats.compare("draft", workdir, MAX_TOKENS)


def _texts(sent: list[serve_chats.Sent]) -> list[str]:
    return [s.reply.text for s in sent]


def _cached(sent: list[serve_chats.Sent]) -> list[int]:
    return [s.reply.cached_tokens for s in sent]


def _last_image_start(tokenizer, messages) -> int:
    """Where the last image's first patch token is in the prompt the server makes."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    before = text.rsplit(PATCH_TOKEN, 1)[0].replace(PATCH_TOKEN, image_tokens(IMAGE_PATCHES))
    return len(tokenizer.encode(before + IMAGE_TOKENS[0], add_special_tokens=False))


def test_image_chat_reuses_its_whole_history_with_the_reference_replies(image_chat):
    ours, none = image_chat["ours"], image_chat["none"]
    assert _texts(ours) == _texts(none)
    prompts, cached = [s.reply.prompt_tokens for s in none], _cached(ours)
    assert cached[0] == 0
    # mlx_lm.server reuses none of it on this model (tools/serve_chats.py's table)
    assert all(cached[k] >= prompts[k - 1] for k in (1, 2, 3)), (cached, prompts)


def test_a_different_image_is_reused_up_to_its_first_patch(image_chat, workdir):
    ours = image_chat["ours"]
    tokenizer = load_tokenizer(workdir / "vision-window")
    for probe, original in ((4, 0), (5, 2)):
        start = _last_image_start(tokenizer, ours[probe].messages)
        assert ours[probe].reply.cached_tokens == start
        assert start == _last_image_start(tokenizer, ours[original].messages)
        # the image changes the reply: a reuse past it would show
        assert ours[probe].reply.text != ours[original].reply.text


def test_draft_model_replies_and_reuse(draft_chat):
    ours, none, plain = draft_chat["ours"], draft_chat["none"], draft_chat["mlx-lm"]
    assert _texts(ours) == _texts(none)
    prompts, cached = [s.reply.prompt_tokens for s in none], _cached(ours)
    assert cached[0] == 0
    assert all(cached[k] >= prompts[k - 1] for k in (1, 2, 3)), (cached, prompts)
    assert cached[4] >= 4 * serve_chats.BLOCK_SIZE  # a second chat: the system prompt
    # mlx-lm's own cache after speculative decoding counts the last generated token,
    # which no layer holds (the draft loop never feeds it): one more than it reuses
    assert all(o >= p - 1 for o, p in zip(cached, _cached(plain), strict=True))
