"""Replay a trace against a running OpenAI-compatible server, at the trace's arrivals.

A server tokenizes text, so a request's token string (``reader.request_tokens``)
is written with words its tokenizer maps back to exactly those tokens: each
drawn id picks one of the vocabulary's single-token words (`` the``, `` a``,
...: a space and letters, which a byte-level BPE pre-tokenizer keeps apart),
so equal hash ids give equal text and equal tokens on the server.

Each request is sent to ``/v1/completions`` (streamed, ``temperature`` 0) when
its arrival comes (``timestamp / speed`` after the start), concurrently with
the ones still running. TTFT is the time from its arrival (when it was due:
a request the client could not send at once, with ``MAX_IN_FLIGHT`` running,
counts its wait) to the first streamed chunk with output; the cached tokens
are what the server reports in ``usage`` (``prompt_tokens_details.cached_tokens``:
mlx-lm's server and ``prefixcache serve`` both do).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .reader import TraceRequest, request_tokens
from .replay import Replayed
from .simulator import SimResult

_WORD = re.compile(r" [A-Za-z]+")
MAX_IN_FLIGHT = 32  # mlx-lm's HTTP server queues few connections: more are reset
TIMEOUT = 600.0
RETRIES = 6


@dataclass(frozen=True, slots=True)
class Sent:
    """One request's outcome: prompt tokens and cached tokens (the server's usage), TTFT."""

    prompt_tokens: int
    cached_tokens: int
    ttft: float


def word_tokens(tokenizer: Any) -> list[int]:
    """The ids of single-token words that encode back to themselves alone.

    Raises:
        ValueError: the tokenizer has fewer than two such words.
    """
    vocab = tokenizer.vocab_size
    out = []
    for t in range(vocab):
        text = tokenizer.decode([t])
        if _WORD.fullmatch(text) and tokenizer.encode(text) == [t]:
            out.append(t)
    if len(out) < 2:
        raise ValueError(f"the tokenizer has {len(out)} single-token words, need 2 or more")
    return out


def prompt_text(request: TraceRequest, words: list[int], tokenizer: Any, **kw: int) -> str:
    """The text of ``request``'s prompt in ``words`` (``kw``: ``request_tokens``'s
    ``block_tokens`` and ``seed``)."""
    drawn = request_tokens(request, vocab_size=len(words), **kw)
    return tokenizer.decode([words[t] for t in drawn])


def replay_http(
    requests: Sequence[TraceRequest],
    url: str,
    tokenizer: Any,
    *,
    block_tokens: int,
    speed: float,
    max_tokens: int,
    seed: int,
) -> Replayed:
    """Send every request at its arrival; the counts as ``simulate`` keys them.

    Raises:
        OSError: the server cannot be reached or answers with an error.
    """
    words = word_tokens(tokenizer)
    kw = {"block_tokens": block_tokens, "seed": seed}
    texts = [prompt_text(r, words, tokenizer, **kw) for r in requests]
    first = requests[0].timestamp_ms if requests else 0
    began = time.perf_counter()
    failed: list[BaseException] = []

    def send(i: int) -> Sent | None:
        arrival = began + (requests[i].timestamp_ms - first) / 1000 / speed
        threading.Event().wait(max(0.0, arrival - time.perf_counter()))
        try:
            return _complete_retrying(url, texts[i], max_tokens, arrival)
        except OSError as err:
            failed.append(err)
            return None

    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        sent = list(pool.map(send, range(len(requests))))
    if failed:
        raise failed[0]
    return _tally(url, requests, [s for s in sent if s is not None], began)


def _complete_retrying(url: str, text: str, max_tokens: int, arrival: float) -> Sent:
    """``_complete``, sent again when the server resets the connection before any
    reply (its listen queue overflowed at a burst of arrivals); the wait counts in TTFT."""
    for attempt in range(RETRIES):
        try:
            return _complete(url, text, max_tokens, arrival)
        except (ConnectionResetError, urllib.error.URLError) as err:
            reset = isinstance(getattr(err, "reason", err), ConnectionResetError)
            if not reset or attempt == RETRIES - 1:
                raise
            threading.Event().wait(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def _complete(url: str, text: str, max_tokens: int, arrival: float) -> Sent:
    body = {
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=TIMEOUT) as reply:
        for line in reply:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):  # the first chunk with output
                ttft = time.perf_counter() - arrival
            usage = chunk.get("usage") or usage
    if usage is None or ttft is None:
        raise OSError(f"{url}: a streamed completion came back without usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Sent(usage["prompt_tokens"], cached, ttft)


def _tally(url: str, requests: Sequence, sent: list[Sent], began: float) -> Replayed:
    counts, half = SimResult(), len(sent) // 2
    for i, s in enumerate(sent):
        counts.requests += 1
        counts.prompt_tokens += s.prompt_tokens
        counts.cached_tokens += s.cached_tokens
        if i >= half:
            counts.last_half_prompt += s.prompt_tokens
            counts.last_half_cached += s.cached_tokens
    counts.hit_tokens["hot"] = counts.cached_tokens  # a server reports no tiers
    if requests:
        counts.trace_seconds = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    counts.seconds = time.perf_counter() - began
    return Replayed(url, counts, [s.ttft for s in sent], [s.cached_tokens for s in sent])
