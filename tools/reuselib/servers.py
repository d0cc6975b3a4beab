"""A server subprocess on a free loopback port, and the chat client that drives it.

``Server`` speaks the OpenAI chat API as mlx-lm's server does (``prefixcache
serve`` wraps it); a server that differs declares it by overriding the two hooks
``request_fields`` and ``cached_tokens`` (tools/reuselib/vllm_mlx.py). Which
servers a benchmark compares, and how each is started: tools/reuselib/systems.py.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_TIMEOUT = 120.0  # seconds: up to five servers start at once on a shared 2-core machine
REQUEST_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class Reply:
    """One chat completion: the text, the server's token counts, or the error."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    error: str = ""


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed chat completion: seconds to its first token, its text, and its
    prompt and cached tokens (0 unless asked for)."""

    first: float
    text: str
    prompt_tokens: int
    cached_tokens: int


def carries_output(chunk: Mapping[str, Any]) -> bool:
    """Whether a streamed chat chunk shows a generated token: its delta holds anything
    besides ``role`` (content, reasoning, tool calls), or it ends the reply.

    mlx-lm's server writes a chunk only once it has text, reasoning or tool calls,
    and a last one with ``finish_reason`` (the reply may be one EOS): each of its
    chunks counts. vllm-mlx's first ``{"role": "assistant"}`` and its empty
    ``{}`` deltas do not.

    >>> carries_output({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]})
    False
    >>> carries_output({"choices": [{"delta": {"content": "Q"}, "finish_reason": None}]})
    True
    >>> carries_output({"choices": [{"delta": {"role": "assistant"}, "finish_reason": "stop"}]})
    True
    """
    if not chunk.get("choices"):
        return False
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    return any(v for k, v in delta.items() if k != "role") or bool(choice.get("finish_reason"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server subprocess on 127.0.0.1, its log file, and a chat client for it.

    The process starts in the constructor; ``wait_ready`` waits for ``/health``
    (so several servers can start side by side).
    """

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Return once ``/health`` answers; RuntimeError (with the log's tail) if it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready in {timeout:g}s: {self.tail()}")

    def request_fields(self) -> dict[str, object]:
        """Fields every request to this server carries besides the chat's own.

        None here: mlx-lm's server needs no ``model`` field (it falls back to its
        ``--model``), so none is sent and its requests stay as they were.
        """
        return {}

    def cached_tokens(self, usage: Mapping[str, Any], log_offset: int) -> int:
        """Prompt tokens this server reused for the request whose reply carried ``usage``.

        Here: ``usage.prompt_tokens_details.cached_tokens`` (mlx-lm's server, 0 when
        absent). ``log_offset`` is the log's size in bytes when the request was
        sent, for a server that says it only in its log.

        Raises:
            LookupError: the count cannot be found (the reply is kept as an error).
        """
        return usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

    def _request(self, body: dict[str, object]) -> urllib.request.Request:
        return urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps({**self.request_fields(), **body}).encode(),
            headers={"Content-Type": "application/json"},
        )

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Reply:
        """One greedy chat completion; a failed request is a Reply with ``error`` set."""
        request = self._request({"messages": messages, "temperature": 0, "max_tokens": max_tokens})
        log_offset = self.log.stat().st_size
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
                data = json.load(reply)
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
            alive = "" if self.proc.poll() is None else f" (exited {self.proc.returncode})"
            return Reply("", 0, 0, time.perf_counter() - start, f"{err}{alive}")
        seconds = time.perf_counter() - start
        text = data["choices"][0]["message"]["content"] or ""
        usage = data["usage"]
        try:
            cached = self.cached_tokens(usage, log_offset)
        except LookupError as err:
            return Reply(text, usage["prompt_tokens"], 0, seconds, str(err))
        return Reply(text, usage["prompt_tokens"], cached, seconds)

    def first_token(
        self, messages: list[dict[str, str]], max_tokens: int = 4, **extra: object
    ) -> float:
        """Seconds from sending a greedy streamed chat completion to its first token
        (the rest of the reply is read and dropped); ``extra``: more request fields
        (a ``seed`` sends it down mlx-lm's sequential path).

        Raises:
            RuntimeError: the request failed (with the server's log tail).
        """
        return self.stream(messages, max_tokens, **extra).first

    def stream(
        self, messages: list[dict[str, str]], max_tokens: int, *, usage: bool = False, **extra
    ) -> Streamed:
        """One greedy streamed chat completion: seconds to its first token, its text
        and, with ``usage`` (asked for with ``stream_options``), its token counts.

        The first token is the first chunk that carries output (see ``carries_output``):
        vllm-mlx streams a ``{"role": "assistant"}`` chunk before it prefills.

        Raises:
            RuntimeError: the request failed, streamed no token, or (``usage``) no
                counts (with the server's log tail).
            LookupError: the server's cached tokens cannot be found (``cached_tokens``).
        """
        body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens}
        if usage:
            extra = {**extra, "stream_options": {"include_usage": True}}
        request = self._request({**body, "stream": True, **extra})
        log_offset = self.log.stat().st_size
        start = time.perf_counter()
        first, parts, counts = None, [], {}
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
                for line in reply:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and carries_output(chunk):
                        first = time.perf_counter() - start
                    counts = chunk.get("usage") or counts
                    choices = chunk.get("choices") or ()
                    parts += [(c.get("delta") or {}).get("content") or "" for c in choices]
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
            raise RuntimeError(f"{self.name}: {err}: {self.tail()}") from None
        if first is None or (usage and not counts):
            raise RuntimeError(f"{self.name}: no token or no usage streamed: {self.tail()}")
        if not usage:
            return Streamed(first, "".join(parts), 0, 0)
        cached = self.cached_tokens(counts, log_offset)
        return Streamed(first, "".join(parts), counts["prompt_tokens"], cached)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_ns(self) -> int:
        """CPU time of the server's threads and child processes so far (schedstat)."""
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in glob.glob(f"/proc/{pid}/task/*"):
                with contextlib.suppress(OSError, ValueError):
                    with open(f"{task}/schedstat") as f:
                        total += int(f.read().split()[0])
                    with open(f"{task}/children") as f:
                        todo += [int(c) for c in f.read().split()]
        return total

    def settle(self, quiet: float = 0.03, busy_ns: int = 1_000_000, timeout: float = 5.0) -> None:
        """Wait until the server's CPU time grows by under ``busy_ns`` over ``quiet``
        seconds (its background work after a request done), ``timeout`` at most."""
        end = time.monotonic() + timeout
        last = self.cpu_ns()
        while time.monotonic() < end:
            time.sleep(quiet)
            now = self.cpu_ns()
            if now - last < busy_ns:
                return
            last = now

    def stop(self) -> int:
        """SIGTERM (``prefixcache serve`` flushes to SSD), then wait; killed if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def tail(self, num_lines: int = 5) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-num_lines:])

    def text(self) -> str:
        return self.log.read_text(errors="replace")
