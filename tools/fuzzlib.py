"""Property-based requests for a server, and the checks that follow each one.

``cases()`` draws completion requests (hypothesis): a path, a JSON body whose
fields mix good values with wrong types, out-of-range numbers, control
characters, NaN and oversized text, and sometimes an ``X-Session-Id`` header.
``check`` sends one and asserts the server answered with a status of
``ALLOWED`` (never a 5xx, never a dropped connection) and that ``/health``
still says 200. ``slow_body``, ``stalled_body``, ``cut_body`` and
``idle_connections`` misbehave at the connection level instead. Loopback
only; every connection is closed before a function returns. Used by
``tests/test_serve_fuzz.py`` and ``tools/fuzz_serve.py``.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from badlib import Bad, health, request_bytes, send
from hypothesis import strategies as st

ALLOWED = frozenset({"200", "400", "413"})
PATHS = ("/v1/chat/completions", "/v1/completions", "/chat/completions")
ROLES = ("system", "user", "assistant", "tool", "developer", "wizard", "", "USER")
MAX_TOKENS = 8  # the servers run with --max-tokens-limit MAX_TOKENS: any more is a 400

_char = st.characters(codec="utf-8")
_texts = st.one_of(
    st.text(max_size=40),
    st.text(_char, max_size=300),
    st.sampled_from(["", "<|im_end|>", "<|im_start|>", "\x00", "\u202e", "a" * 300]),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 10),
    st.floats(allow_nan=True, allow_infinity=True),
    _texts,
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_texts, inner, max_size=4),
    max_leaves=10,
)
_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"]) | _values},
    optional={"text": _texts | _values, "image_url": _values},
)
_messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(ROLES) | _values,
            "content": _texts | st.lists(_parts, max_size=3) | _values,
            "name": _texts,
        },
    )
    | _values,
    max_size=4,
)
_fields = {
    "messages": _messages | _values,
    "prompt": _texts | _values,
    "max_tokens": st.integers(1, MAX_TOKENS) | _values,
    "max_completion_tokens": _values,
    "temperature": st.sampled_from([0, 0.0, 0.7]) | _values,
    "top_p": st.floats(0, 1) | _values,
    "top_k": st.integers(-2, 10**6) | _values,
    "min_p": _values,
    "n": st.sampled_from([1, 2]) | _values,
    "stop": _texts | st.lists(_texts, max_size=20) | _values,
    "stream": st.booleans() | _values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _values,
    "logprobs": st.booleans() | _values,
    "top_logprobs": st.integers(-2, 12) | _values,
    "logit_bias": st.dictionaries(st.integers(-5, 600).map(str), st.floats(-100, 100)) | _values,
    "seed": st.integers(-1, 2**65) | _values,
    "repetition_penalty": _values,
    "presence_penalty": _values,
    "chat_template_kwargs": _values,
    "tools": _values,
    "cache_salt": _texts | _values,
    "session_id": _texts | _values,
    "cache": st.fixed_dictionaries({}, optional={"persist": _values, "x": _values}) | _values,
}
_header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300)


_printable = st.text(st.characters(categories=["L", "N", "P", "S", "Zs"]), min_size=1, max_size=20)
_good = {  # values serve takes: the request reaches generation
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 600),
    "min_p": st.floats(0, 1),
    "stop": _printable | st.lists(_printable, max_size=3),
    "stream": st.booleans(),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 11),
    "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-10, 10), max_size=3),
    "seed": st.integers(0, 2**64 - 1),
    "repetition_penalty": st.floats(0, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "cache_salt": _printable,
    "session_id": _printable,
    "cache": st.fixed_dictionaries({"persist": st.booleans()}),
    "n": st.just(1),
}
_good_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=80)}
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def cases(draw) -> Bad:
    """One request: a known path and a body that is good (``mode`` good), good but for
    one field (off), or a few fields of anything (wild); ``max_tokens`` small unless it
    is a wrong one; perhaps an ``X-Session-Id``."""
    path = draw(st.sampled_from(PATHS))
    main = "prompt" if path == "/v1/completions" else "messages"
    mode = draw(st.sampled_from(["good", "off", "wild"]))
    body: dict = {}
    if mode != "wild":
        good = st.text(min_size=1, max_size=200) if main == "prompt" else _good_messages
        body[main] = draw(good)
        for name in draw(st.lists(st.sampled_from(sorted(_good)), max_size=4, unique=True)):
            body[name] = draw(_good[name])
    names = draw(st.lists(st.sampled_from(sorted(_fields)), min_size=1, max_size=6, unique=True))
    for name in names[: {"good": 0, "off": 1, "wild": 6}[mode]]:
        body[name] = draw(_fields[name])
    body.setdefault("max_tokens", draw(st.integers(1, MAX_TOKENS)))
    headers = {"X-Session-Id": draw(_header_text)} if draw(st.booleans()) else {}
    raw = json.dumps(body, allow_nan=True).encode()  # NaN, Infinity: sent as written
    return Bad("fuzz", raw, path, headers=headers, expect=0)


def check(url: str, case: Bad, timeout: float = 60.0) -> str:
    """Send ``case``; assert its status is allowed and the server healthy after."""
    status, text = send(url, case, timeout)
    assert status in ALLOWED, (status, text, case.path, case.headers, case.body[:2000])
    after = health(url)
    assert after == "200", (after, status, case.path, case.body[:2000])
    return status


def _connect(url: str, timeout: float) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname in ("127.0.0.1", "localhost", "::1"), "loopback only"
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def _status(sock: socket.socket) -> str:
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "dropped"


GOOD = Bad("good", json.dumps({"prompt": "hello there", "max_tokens": 2}).encode(), PATHS[1])


def slow_body(url: str, pieces: int = 10, pause: float = 0.05) -> str:
    """A good request whose body arrives in ``pieces``, ``pause`` seconds apart: its status."""
    raw = request_bytes(GOOD, urllib.parse.urlsplit(url).netloc)
    head, body = raw[: -len(GOOD.body)], GOOD.body
    step = max(1, len(body) // pieces)
    with _connect(url, 60.0) as sock:
        sock.sendall(head)
        for i in range(0, len(body), step):
            time.sleep(pause)  # the point: a client that sends slowly
            sock.sendall(body[i : i + step])
        return _status(sock)


def stalled_body(url: str, timeout: float) -> tuple[str, float]:
    """Half a body, then silence: (the status, seconds until the server answered)."""
    raw = request_bytes(GOOD, urllib.parse.urlsplit(url).netloc)
    with _connect(url, timeout) as sock:
        sock.sendall(raw[: len(raw) - len(GOOD.body) // 2])
        start = time.monotonic()
        return _status(sock), time.monotonic() - start


def cut_body(url: str) -> str:
    """Half a body, then the sending side closed: its status."""
    raw = request_bytes(GOOD, urllib.parse.urlsplit(url).netloc)
    with _connect(url, 60.0) as sock:
        sock.sendall(raw[: len(raw) - len(GOOD.body) // 2])
        sock.shutdown(socket.SHUT_WR)
        return _status(sock)


@contextmanager
def idle_connections(url: str, count: int, timeout: float = 60.0) -> Iterator[list[socket.socket]]:
    """``count`` connections opened and left idle (half of them with a partial request
    line) for the duration of the block; all closed after."""
    with ExitStack() as stack:
        socks = [stack.enter_context(_connect(url, timeout)) for _ in range(count)]
        for sock in socks[::2]:
            sock.sendall(b"POST /v1/comp")
        yield socks


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` (EOF or a reply) within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        sock.recv(65536)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True
