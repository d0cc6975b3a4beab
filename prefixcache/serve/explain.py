"""``prefixcache serve``'s miss explanations: a header on every completion, and
``POST /v1/cache/explain``.

The ``X-Prefixcache-Explain`` header carries ``Explanation.short()`` (e.g.
``cached=96; at=100; why=diverged; message=3; role=assistant; rerendered``).
The generation thread explains each fetch as it happens (``PrefixCache.explain``
right after ``fetch`` reuses its lookup: the tiers are not walked again) and
files the record under the prompt (:class:`Explained`). The HTTP thread takes
it once mlx-lm hands it the request's context (on mlx-lm's batched path the
fetch came first; on its sequential path it follows at once, so the thread
waits for it, at most ``WAIT`` seconds), places the divergence in the
request's messages (about log2(messages) renders of the chat template, on the
HTTP thread) and sends it with the reply's headers. ``--explain-header off``
turns it off.

``POST /v1/cache/explain`` takes the body of a chat (or text) completion
request, checked as one (a malformed body is a 400 naming the value),
renders it as mlx-lm's server does, and answers the record as JSON
(``Explanation.as_dict()``); nothing is generated, stored or evicted.
"""

from __future__ import annotations

import array
import contextlib
import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash
from jinja2 import TemplateError
from mlx_lm import server

from ..cache.explain import in_messages
from ..cache.explanation import Explanation
from ..cache.messages import renderer
from ..cache.prefix_cache import PrefixCache
from .lifecycle import STORAGE_ERRORS
from .validate import RequestError

HEADER = "X-Prefixcache-Explain"
PATH = "/v1/cache/explain"
WAIT = 1.0  # seconds the HTTP thread waits for its request's fetch
_KEPT = 64  # explanations waiting for their HTTP thread, at most
_TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError)


class _Told(threading.local):
    """The header value for the reply this HTTP thread is sending (None: none)."""

    header: str | None = None


told = _Told()


class Explained:
    """What each fetch found, filed by prompt until its HTTP thread takes it (thread-safe)."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._cond = threading.Condition()
        self._items: OrderedDict[bytes, list[Explanation | None]] = OrderedDict()

    def put(
        self,
        tokens: Sequence[int],
        cache: PrefixCache,
        text: Sequence[int],
        extra: Mapping[str, str] | None,
    ) -> None:
        """Explain the fetch of ``text`` just done on ``cache`` (generation thread: a
        failure is a missing header, never an exception there)."""
        if not self.enabled:
            return
        try:
            record: Explanation | None = cache.explain(text, extra=extra)
        except (*STORAGE_ERRORS, ValueError, RuntimeError):
            record = None
        key = _key(tokens)
        with self._cond:
            self._items.setdefault(key, []).append(record)
            self._items.move_to_end(key)
            while len(self._items) > _KEPT:  # replies never sent (failed requests)
                self._items.popitem(last=False)
            self._cond.notify_all()

    def take(self, tokens: Sequence[int], timeout: float) -> Explanation | None:
        """The record of the fetch of ``tokens``, waiting up to ``timeout`` seconds."""
        key = _key(tokens)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._items.get(key):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            records = self._items[key]
            record = records.pop(0)
            if not records:
                del self._items[key]
            return record


def _key(tokens: Sequence[int]) -> bytes:
    """A prompt's 16-byte digest (a held prompt would cost its length in objects)."""
    return xxhash.xxh3_128_digest(array.array("q", tokens).tobytes())


def explained(generator: Any, request: Any, args: Any, got: tuple[Any, Any]) -> tuple[Any, Any]:
    """``got`` (mlx-lm's ``generate``: the request's context and its replies), with the
    header of the reply told to the HTTP handler on this thread."""
    told.header = header_for(generator, request, args, got[0].prompt)
    return got


def header_for(generator: Any, request: Any, args: Any, prompt: Sequence[int]) -> str | None:
    """The header value for ``request`` (HTTP thread, after mlx-lm tokenized it), or None."""
    tiered = generator.tiered
    if not tiered.explained.enabled or tiered.cache is None or _has_images(request):
        return None
    record = tiered.explained.take(prompt, WAIT)
    if record is None:
        return None
    tokenizer = generator.model_provider.tokenizer
    if request.request_type == "chat" and request.messages and tokenizer.has_chat_template:
        kwargs = _template_args(generator, args.chat_template_kwargs)
        render = renderer(tokenizer, tools=request.tools, template_kwargs=kwargs)
        # the request was rendered once already: placing it is best effort
        # RuntimeError: a fast tokenizer the generation thread is using ("Already borrowed")
        with contextlib.suppress(*_TEMPLATE_ERRORS, RuntimeError):
            record = in_messages(record, prompt, request.messages, render, tokenizer.decode)
    return header_safe(record.short())


def header_safe(text: str) -> str:
    """``text`` as printable ASCII (a role is the client's string)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def answer(generator: Any, body: dict[str, Any], extra: Mapping[str, str] | None) -> Explanation:
    """``POST /v1/cache/explain``'s record for a checked request ``body``.

    Raises:
        RequestError: the model's template or tokenizer refused the body (400), or
            no model's cache is open yet (503).
    """
    cache = generator.tiered.cache
    tokenizer = generator.model_provider.tokenizer
    if cache is None or tokenizer is None:
        raise RequestError("no model's cache is open yet: it opens with the first request", 503)
    try:
        tokens, messages, tools = _tokenized(generator, tokenizer, body)
        if not tokens:
            raise RequestError("the request renders to no tokens: nothing to explain")
        return cache.explain(
            tokens, extra=extra, tokenizer=tokenizer, messages=messages, tools=tools
        )
    except RequestError:
        raise
    except _TEMPLATE_ERRORS as err:
        raise RequestError(f"the request could not be tokenized: {err}") from None
    except (*STORAGE_ERRORS, RuntimeError) as err:  # a tier failing, the tokenizer busy
        # on the generation thread ("Already borrowed"), the cache closed by a switch
        raise RequestError(f"the cache cannot answer now, try again: {err}", 503) from None


def _tokenized(
    generator: Any, tokenizer: Any, body: dict[str, Any]
) -> tuple[list[int], list[dict[str, Any]] | None, Any]:
    """(tokens, messages, tools) of a request body, as mlx-lm's server renders it."""
    if "messages" not in body:
        return list(tokenizer.encode(body.get("prompt", ""))), None, None
    messages = copy.deepcopy(body["messages"])
    tools = body.get("tools") or None
    if not tokenizer.has_chat_template:
        text = server.convert_chat(messages, body.get("role_mapping"))
        return list(tokenizer.encode(text)), None, None
    server.process_message_content(messages)
    kwargs = _template_args(generator, body.get("chat_template_kwargs"))
    render = renderer(tokenizer, tools=tools, template_kwargs=kwargs)
    return list(render(messages)), messages, tools


def _template_args(generator: Any, asked: object) -> dict[str, Any]:
    """The chat template's arguments: serve's ``--chat-template-args`` and the request's."""
    args = dict(generator.model_provider.cli_args.chat_template_args or {})
    return args | asked if isinstance(asked, dict) else args


def _has_images(request: Any) -> bool:
    """A chat request with a content part that is not text (its fetch is keyed otherwise)."""
    for message in request.messages or () if request.request_type == "chat" else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            not isinstance(p, Mapping) or p.get("type") != "text" for p in content
        ):
            return True
    return False
