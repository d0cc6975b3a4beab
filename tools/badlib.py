"""Bad requests to an OpenAI-style server, and a raw HTTP client that sends them as written.

``BAD`` lists one request of each kind a careless or hostile client sends
(wrong types, out-of-range values, oversized fields, broken bodies and
headers); ``expect`` is the status ``prefixcache serve`` answers it with.
``send`` writes the bytes itself (no client library fixes a header or a body on
the way), so a broken Content-Length or a body cut short reach the server as
they are. Used by ``tools/bad_requests.py`` and ``tests/test_serve_safety.py``.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
from dataclasses import dataclass, field

MiB = 1 << 20
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True, slots=True)
class Bad:
    """One request: what it is, how it is sent, and the status ``prefixcache serve`` gives."""

    name: str
    body: bytes | None
    path: str = CHAT
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    expect: int = 400
    length: int | None = None  # a Content-Length other than the body's
    cut: bool = False  # close the sending side after the body (a body cut short)


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode()


def _chat(**fields: object) -> bytes:
    return _json({"messages": HI, "max_tokens": 2, **fields})


def _text(prompt: object, **fields: object) -> bytes:
    return _json({"prompt": prompt, "max_tokens": 2, **fields})


BAD: tuple[Bad, ...] = (
    Bad("empty prompt", _text(""), TEXT),
    Bad("all-special prompt", _text("<|im_end|><|endoftext|>"), TEXT, expect=200),
    Bad("content is an int", _json({"messages": [{"role": "user", "content": 5}]})),
    Bad("ids out of the vocabulary", _text([10**9, 3]), TEXT),
    Bad("negative ids", _text([-5, 3]), TEXT),
    Bad("messages is a string", _json({"messages": "hello"})),
    Bad("messages is empty", _json({"messages": []})),
    Bad("message is a string", _json({"messages": ["hi"]})),
    Bad("message without role", _json({"messages": [{"content": "hi"}]})),
    Bad("unknown role", _json({"messages": [{"role": "wizard", "content": "hi"}]})),
    Bad("content part not text", _chat(messages=[{"role": "user", "content": [{"type": "x"}]}])),
    Bad("cache_salt of 1 MB", _chat(cache_salt="s" * MiB)),
    Bad("cache_salt with control chars", _chat(cache_salt="a\x00b\n")),
    Bad("cache_salt is a number", _chat(cache_salt=7)),
    Bad("session_id of 300 chars", _chat(session_id="s" * 300)),
    Bad("session_id with control chars", _chat(session_id="a\x1bb")),
    Bad("X-Session-Id of 300 chars", _chat(), headers={"X-Session-Id": "s" * 300}),
    Bad("path-like session_id", _chat(session_id="../../../etc/passwd"), expect=200),
    Bad("cache is a string", _chat(cache="no")),
    Bad("malformed JSON", b'{"messages": [', expect=400),
    Bad("JSON NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    Bad("body is a list", _json([1, 2])),
    Bad("max_tokens is a string", _chat(max_tokens="10")),
    Bad("max_tokens huge", _chat(max_tokens=10**12)),
    Bad("temperature is a string", _chat(temperature="hot")),
    Bad("top_p out of range", _chat(top_p=5)),
    Bad("n is a string", _chat(n="two")),
    Bad("stop is an int", _chat(stop=5)),
    Bad("stop is a list of ints", _chat(stop=[1, 2])),
    Bad("logprobs is a string", _chat(logprobs="yes")),
    Bad("logit_bias id out of the vocabulary", _chat(logit_bias={"1000000000": 5})),
    Bad("logit_bias negative id", _chat(logit_bias={"-3": 5})),
    Bad("seed huge", _chat(seed=2**80)),
    Bad("chat_template_kwargs is an int", _chat(chat_template_kwargs=5)),
    Bad("stream_options is a string", _chat(stream=True, stream_options="x")),
    Bad("prompt is a list of strings", _text(["a", "b"]), TEXT),
    Bad("top_k over the vocabulary, greedy", _chat(top_k=10**9)),
    Bad("top_k over the vocabulary, sampled", _chat(top_k=10**9, temperature=1.0)),
    Bad("xtc_threshold 0.9, sampled", _chat(xtc_probability=0.5, xtc_threshold=0.9, temperature=1)),
    Bad("presence_penalty of 2**63", _chat(presence_penalty=2**63)),
    Bad("logit_bias of 2**1100", _chat(logit_bias={"5": 2**1100})),
    Bad("top_logprobs is true", _chat(logprobs=True, top_logprobs=True)),
    Bad("stream_options without include_usage", _chat(stream=True, stream_options={})),
    Bad("JSON nested 100000 deep", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    Bad("integer of 5000 digits", b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}"),
    Bad("number 1e400", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e400}'),
    Bad("missing body", None, length=0),
    Bad("no Content-Length", None, expect=411),
    Bad("negative Content-Length", b"{}", length=-5),
    Bad("non-JSON content type", b"hello", headers={"Content-Type": "text/plain"}),
    Bad("body cut short", b'{"messages": [', length=1000, cut=True),
    Bad("body over the limit (48 MiB)", _chat(pad="x" * (48 * MiB)), expect=413),
    Bad("a header of 70 KiB", _chat(), headers={"X-Pad": "x" * (70 << 10)}, expect=431),
    Bad("101 headers", _chat(), headers={f"X-{i}": "1" for i in range(101)}, expect=431),
    Bad("unknown path", _chat(), path="/v1/nothing", expect=404),
    Bad("unknown session (DELETE)", None, "/v1/sessions/nobody", "DELETE", expect=404),
    Bad("path-like session (DELETE)", None, "/v1/sessions/..%2F..%2Fetc", "DELETE", expect=404),
)


def request_bytes(bad: Bad, host: str) -> bytes:
    """The request as it goes on the wire."""
    headers = {"Host": host, "Content-Type": "application/json", **bad.headers}
    body = bad.body or b""
    length = bad.length if bad.length is not None else (len(body) if bad.body is not None else None)
    if length is not None:
        headers["Content-Length"] = str(length)
    head = f"{bad.method} {bad.path} HTTP/1.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "Connection: close\r\n\r\n"
    return head.encode() + body


def send(url: str, bad: Bad, timeout: float = 30.0) -> tuple[str, str]:
    """(status, the first 120 characters of the reply's body); status is the HTTP code,
    or ``dropped`` (closed without a reply), ``reset`` or ``timeout``."""
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        try:
            sock.sendall(request_bytes(bad, parts.netloc))
            if bad.cut:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (413) before the body is all sent: read it
        try:
            reply = _read_all(sock)
        except TimeoutError:
            return "timeout", ""
        except ConnectionResetError:
            return "reset", ""
    if not reply:
        return "dropped", ""
    head, _, body = reply.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "garbled"
    return status, body[:120].decode(errors="replace")


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def health(url: str, timeout: float = 5.0) -> str:
    """``GET /health``'s status code, or why there is none."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
            head = f"GET /health HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n"
            sock.sendall(head.encode())
            reply = _read_all(sock)
    except TimeoutError:
        return "timeout"
    except OSError as err:
        return type(err).__name__
    return reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "garbled"
