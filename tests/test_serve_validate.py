"""What serve accepts of a request (serve/validate.py, request_options.py, the handler's
limits) and how its generation loop is restarted (serve/supervisor.py), without a
server: real threads."""

from __future__ import annotations

import argparse
import io
import threading
from queue import Queue
from types import SimpleNamespace

import pytest
from mlx_lm.server import ModelProvider

from prefixcache.serve.generator import GuardedGenerator
from prefixcache.serve.handler import GuardedHandler
from prefixcache.serve.request_options import MAX_NAME, check_name, parse
from prefixcache.serve.supervisor import GenerationFailed, Supervisor
from prefixcache.serve.validate import (
    Limits,
    RequestError,
    check_body,
    check_prompt,
    parse_body,
    read_body,
)
from prefixcache.tiny.models import save_model
from prefixcache.tiny.vision import save_vision_model

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LIMITS = Limits(max_body_bytes=1000, max_tokens=100, vocab_size=512)


def refused(path: str, body: dict, limits: Limits = LIMITS) -> str:
    with pytest.raises(RequestError) as caught:
        check_body(path, body, limits)
    assert caught.value.status == 400
    return str(caught.value)


def test_good_bodies_pass():
    check_body(CHAT, {"messages": HI}, LIMITS)
    check_body(CHAT, {"messages": HI, "max_tokens": 100, "n": 1, "seed": 0, "stop": "x"}, LIMITS)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    check_body(CHAT, {"messages": [{"role": "system", "content": parts}]}, LIMITS)
    check_body(CHAT, {"messages": [{"role": "assistant", "content": None}]}, LIMITS)
    check_body("/v1/completions", {"prompt": "hi", "logit_bias": {"511": -5.5}}, LIMITS)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    with_image = {"messages": [{"role": "user", "content": [image]}]}
    check_body(CHAT, with_image, Limits(images=True))
    assert "content[0]" in refused(CHAT, with_image)  # a model without a processor


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": "hi"}, "messages must be"),
        ({"messages": []}, "messages must be"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [*HI, {"role": "user", "content": 5}]}, "messages[1].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "content[0].text"),
        ({"messages": HI, "max_tokens": 101}, "max_tokens"),
        ({"messages": HI, "max_tokens": True}, "max_tokens"),
        ({"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": HI, "n": 2}, "n must"),
        ({"messages": HI, "seed": -1}, "seed"),
        ({"messages": HI, "stop": ["a"] * 17}, "stop"),
        ({"messages": HI, "stop": [""]}, "stop"),
        ({"messages": HI, "logit_bias": {"512": 1}}, "logit_bias"),
        ({"messages": HI, "logit_bias": {"1": "x"}}, "logit_bias"),
        ({"messages": HI, "tools": {}}, "tools"),
        ({"messages": HI, "tools": [None]}, "tools[0]"),  # found by tools/fuzz_serve.py
        ({"messages": HI, "top_k": 512}, "top_k"),  # and this: sampling raised
        ({"messages": HI, "xtc_threshold": 0.6}, "xtc_threshold"),
        ({"messages": HI, "presence_penalty": 2**63}, "presence_penalty"),  # MLX's bad_cast
        ({"messages": HI, "temperature": -1e300}, "temperature"),
        ({"messages": HI, "top_logprobs": True, "logprobs": True}, "top_logprobs"),  # and this
        ({"messages": HI, "logit_bias": {"1": 2**1100}}, "logit_bias"),
        ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role"),  # and this
        ({"messages": HI, "stream_options": {"include_usage": 1}}, "include_usage"),
    ],
)
def test_bad_fields_are_named(body, named):
    assert named in refused(CHAT, body)


def test_prompt_must_be_text():
    for prompt in ("", [1, 2], None):
        assert "prompt" in refused("/v1/completions", {"prompt": prompt})


def test_body_reading_and_parsing():
    raw = b'{"messages": []}'
    assert read_body(io.BytesIO(raw), {"Content-Length": str(len(raw))}, 100) == raw
    cases = [
        ({}, raw, 411),
        ({"Content-Length": "-1"}, raw, 400),
        ({"Content-Length": "²"}, raw, 400),
        ({"Content-Length": "101"}, raw, 413),
        ({"Content-Length": "50"}, raw, 400),  # the body ends early
    ]
    for headers, body, status in cases:
        with pytest.raises(RequestError) as caught:
            read_body(io.BytesIO(body), headers, 100)
        assert caught.value.status == status, headers
    for text in (b"[1]", b"{", b"\xff", b'{"a": NaN}', b'{"a": 1e999}', b"[" * 10**5):
        with pytest.raises(RequestError):
            parse_body(text)
    assert parse_body(b'{"a": 1.5}') == {"a": 1.5}


def test_tokenized_prompt_checks():
    check_prompt([0, 511], 512, [0, 511])
    check_prompt([-7, -7, 3], 512, [-7, -7, 3])  # an image's place
    for prompt, key in (([], []), ([512], [512]), ([-1, 3], [5, 3])):
        with pytest.raises(RequestError):
            check_prompt(prompt, 512, key)


def test_cache_field_bounds():
    assert check_name("cache_salt", "a" * MAX_NAME) == "a" * MAX_NAME
    assert check_name("session_id", "../../étc/ü") == "../../étc/ü"  # a name, any script
    for bad in ("", "a" * (MAX_NAME + 1), "a\nb", "\x00", 5, ["a"]):
        with pytest.raises(ValueError, match="cache_salt"):
            check_name("cache_salt", bad)
    assert parse({"session_id": "s"}, {"X-Session-Id": "h"}).session == "s"
    assert parse({}, {"X-Session-Id": "h"}).session == "h"
    with pytest.raises(ValueError, match="X-Session-Id"):
        parse({}, {"X-Session-Id": "h\x1b"})
    with pytest.raises(ValueError, match="unknown fields"):
        parse({"cache": {"persist": True, "pin": 1}}, {})


def test_supervisor_fails_the_requests_in_flight_and_starts_the_loop_again():
    supervisor = Supervisor()
    waiting, held, calls = Queue(), Queue(), []

    def loop() -> None:
        calls.append(1)
        if len(calls) == 1:  # the first loop takes two requests, finishes one, and raises
            done, _stuck = supervisor.replies.track(Queue()), supervisor.replies.track(held)
            done.put(None)
            assert len(supervisor.replies) == 1
            raise ValueError("boom")
        assert supervisor.restarting  # until the new loop takes requests
        supervisor.running()
        waiting.put("served")  # a request that was still queued: the new loop serves it

    thread = threading.Thread(target=supervisor.run, args=(loop, lambda: False))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and len(calls) == 2
    failed = held.get_nowait()
    assert isinstance(failed, GenerationFailed) and "ValueError: boom" in str(failed)
    assert waiting.get_nowait() == "served"
    assert supervisor.num_restarts == 1 and not supervisor.restarting
    assert len(supervisor.replies) == 0


def test_images_pass_until_the_model_is_loaded(tmp_path):
    """mlx-lm answers /health while it loads the model: an image request then is not
    refused for want of a processor (mlx-lm refuses it itself if the model has none)."""
    text, vision = save_model(tmp_path / "text", "llama"), save_vision_model(tmp_path / "vision")
    cli = {"model": None, "adapter_path": None, "draft_model": None, "pipeline": False}
    cli |= {"trust_remote_code": False, "chat_template": "", "use_default_chat_template": False}
    provider = ModelProvider(argparse.Namespace(**cli))  # the fields mlx-lm's main() parses
    generator = GuardedGenerator.__new__(GuardedGenerator)  # only its model_provider is read
    generator.model_provider = provider
    handler = SimpleNamespace(response_generator=generator, limits=LIMITS)
    images = [GuardedHandler._limits(handler).images]  # not loaded yet
    for path in (str(text), str(vision)):
        provider.load(path)
        images.append(GuardedHandler._limits(handler).images)
    assert images == [True, False, True]
