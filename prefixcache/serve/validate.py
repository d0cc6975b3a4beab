"""What ``prefixcache serve`` checks in a request before mlx-lm's server sees it.

mlx-lm's HTTP handler checks the types of its sampling fields; the rest of a
request reaches its generation thread as the client wrote it, where a wrong
type or value raises (a 404 with the exception's text) or kills the thread for
every later request (an empty prompt, a ``stop`` that is not text, a
``logit_bias`` id outside the vocabulary). Here the body is read within a size
limit (413), parsed (400) and each field it has checked for type and range
(400 naming the field); the prompt mlx-lm tokenizes is checked again on the
generation thread (``check_prompt``). Bounds are in docs/operating.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})  # mlx-lm's names
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})
MAX_BODY_BYTES = 32 << 20  # --max-body-bytes default
MAX_TOKENS_LIMIT = 1 << 17  # --max-tokens-limit default
MAX_STOP_WORDS = 16
MAX_STOP_CHARS = 256
MAX_SEED = (1 << 64) - 1  # MLX seeds are unsigned 64-bit
XTC_THRESHOLD = 0.5  # mlx-lm's XTC sampling raises above
MAX_NUMBER = (1 << 31) - 1  # a sampling number beyond: MLX raised converting it (int64)
MAX_BIAS = 100  # OpenAI's bound on a logit_bias value
SAMPLING_NUMBERS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "xtc_probability",
    "xtc_threshold",
    "num_draft_tokens",
    "top_logprobs",
)


class RequestError(ValueError):
    """A request the server refuses: ``status`` (4xx) and a message about the request."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Limits:
    """What serve accepts: body bytes, ``max_tokens``, the model's vocabulary (None:
    unknown, ids are not checked) and whether messages may hold images."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens: int = MAX_TOKENS_LIMIT
    vocab_size: int | None = None
    images: bool = False  # the model takes images (mlx-lm loaded a processor for it)


def read_body(rfile: BinaryIO, headers: Mapping[str, str], limit: int) -> bytes:
    """The request's body, as its Content-Length says.

    Raises:
        RequestError: no or a bad Content-Length (411, 400), a body over ``limit``
            bytes (413), one that ends early or does not arrive in time (400, 408).
    """
    text = headers.get("Content-Length")
    if text is None:
        raise RequestError("Content-Length header is required", 411)
    if not (text.isascii() and text.strip().isdigit()):
        raise RequestError(f"Content-Length must be a byte count, got {text[:40]!r}")
    length = int(text)
    if length > limit:
        raise RequestError(f"body of {length} bytes is over the limit of {limit} bytes", 413)
    try:
        raw = rfile.read(length)
    except TimeoutError:
        raise RequestError("the body did not arrive in time", 408) from None
    if len(raw) < length:
        raise RequestError(f"body ended after {len(raw)} of {length} bytes")
    return raw


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a body (NaN and Infinity refused).

    Raises:
        RequestError: not UTF-8, not JSON, nested too deep, or not an object.
    """
    try:
        body = json.loads(raw.decode(), parse_constant=_no_constant, parse_float=_finite)
    except RequestError:
        raise
    except UnicodeDecodeError:
        raise RequestError("body is not UTF-8") from None
    except ValueError as err:  # not JSON, or an integer of more digits than Python reads
        raise RequestError(f"body is not JSON: {err}") from None
    except RecursionError:
        raise RequestError("body is nested too deep") from None
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {type(body).__name__}")
    return body


def _no_constant(name: str) -> None:
    raise RequestError(f"body holds {name}, which JSON does not allow")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestError(f"body holds the number {text[:40]}, too large for a float")
    return value


def check_body(path: str, body: Mapping[str, Any], limits: Limits) -> None:
    """Check the fields of a completion request mlx-lm's handler does not check (or
    checks after using them).

    Raises:
        RequestError: the first bad field, named.
    """
    if path.endswith("chat/completions"):
        check_messages(body.get("messages"), images=limits.images)
    elif not isinstance(body.get("prompt"), str) or not body["prompt"]:
        # mlx-lm's server tokenizes the prompt itself: it takes no token ids
        raise RequestError(f"prompt must be non-empty text, got {_show(body.get('prompt'))}")
    for name in ("max_tokens", "max_completion_tokens"):
        _check_int(body, name, 1, limits.max_tokens)
    _check_int(body, "n", 1, 1)
    _check_int(body, "seed", 0, MAX_SEED)
    for name in SAMPLING_NUMBERS:  # mlx-lm checks their types; MLX cannot take huge ones
        value = body.get(name)
        if isinstance(value, bool):  # an int to mlx-lm's check; a top_logprobs of true raised
            raise RequestError(f"{name} must be a number, got {value!r}")
        if isinstance(value, int | float) and not abs(value) <= MAX_NUMBER:
            raise RequestError(f"{name} must be from -{MAX_NUMBER} to {MAX_NUMBER}, got {value!r}")
    if limits.vocab_size is not None:  # mlx-lm's top-k sampling raises on one not below it
        _check_int(body, "top_k", 0, limits.vocab_size - 1)
    threshold = body.get("xtc_threshold")
    if isinstance(threshold, float) and not 0 <= threshold <= XTC_THRESHOLD:  # likewise
        raise RequestError(f"xtc_threshold must be from 0 to {XTC_THRESHOLD}, got {threshold!r}")
    _check_stop(body.get("stop"))
    _check_logit_bias(body.get("logit_bias"), limits.vocab_size)
    for name in ("chat_template_kwargs", "stream_options", "role_mapping"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise RequestError(f"{name} must be an object, got {_show(body[name])}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options.get("include_usage"), bool):
        shown = _show(options.get("include_usage"))
        raise RequestError(f"stream_options.include_usage must be true or false, got {shown}")
    _check_tools(body.get("tools"))


def check_messages(messages: object, *, images: bool = False) -> None:
    """``messages``: a non-empty list of objects, each with a known ``role`` and a
    ``content`` that is text, null or a list of text parts (and, with ``images``,
    image parts).

    Raises:
        RequestError: the first bad message, named by its index.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list, got {_show(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object, got {_show(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            known = ", ".join(sorted(ROLES))
            raise RequestError(f"messages[{i}].role must be one of {known}; got {_show(role)}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be text, got {_show(content)}")
        for j, part in enumerate(content):
            _check_part(f"messages[{i}].content[{j}]", part, images)


def _check_part(where: str, part: object, images: bool) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    kind = kind if isinstance(kind, str) else None
    if images and kind in IMAGE_PARTS:
        url = part.get("image_url", part.get("image"))
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise RequestError(f"{where} must hold an image URL, got {_show(part)}")
        return
    if kind != "text":
        allowed = "text or image parts" if images else 'text parts {"type": "text", ...}'
        raise RequestError(f"{where} must be one of the {allowed}, got {_show(part)}")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text must be a string, got {_show(part.get('text'))}")


def check_prompt(prompt: Sequence[int], vocab_size: int | None, cache_key: Sequence[int]) -> None:
    """A tokenized prompt the generation thread can serve: not empty, every id in the
    vocabulary (a negative id only where ``cache_key`` marks an image).

    Raises:
        RequestError: the prompt is empty or holds an id out of range.
    """
    if not prompt:
        raise RequestError("the prompt is empty once tokenized")
    if vocab_size is None:
        return
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab_size and not (token < 0 and cache_key[i] == token):
            raise RequestError(f"prompt token {i} is {token}, outside the vocabulary")


def _check_int(body: Mapping[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer from {low} to {high}, got {_show(value)}")


def _check_tools(tools: object) -> None:
    """``tools``: a list of ``{"type": "function", "function": {"name": ..., ...}}``."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list, got {_show(tools)}")
    for i, tool in enumerate(tools):
        is_dict = isinstance(tool, dict)
        function = tool.get("function") if is_dict else None
        name = function.get("name") if isinstance(function, dict) else None
        if not is_dict or tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise RequestError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}, '
                f"got {_show(tool)}"
            )


def _check_stop(stop: object) -> None:
    words = [stop] if isinstance(stop, str) else stop
    if words is None:
        return
    ok = isinstance(words, list) and len(words) <= MAX_STOP_WORDS
    if not ok or not all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_CHARS for w in words):
        raise RequestError(
            f"stop must be a string or a list of at most {MAX_STOP_WORDS} strings of 1 to "
            f"{MAX_STOP_CHARS} characters, got {_show(stop)}"
        )


def _check_logit_bias(bias: object, vocab_size: int | None) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object of token id to bias, got {_show(bias)}")
    top = vocab_size if vocab_size is not None else 1 << 31
    for key, value in bias.items():
        ok = key.isascii() and key.isdigit() and int(key) < top
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not number or not -MAX_BIAS <= value <= MAX_BIAS:
            raise RequestError(
                f"logit_bias must map token ids 0 to {top - 1} to numbers from -{MAX_BIAS} to "
                f"{MAX_BIAS}, got {_show(key)}: {_show(value)}"
            )


def _show(value: object, limit: int = 60) -> str:
    """A bad value for an error message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
