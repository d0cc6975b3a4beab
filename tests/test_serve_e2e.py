"""End to end: ``prefixcache serve`` as a real subprocess, driven over HTTP.

Multi-turn chat completions against a tiny local model: the cached prompt
tokens the server reports grow turn by turn, greedy outputs equal plain
``mlx_lm.server``'s on the same requests, and after SIGTERM and a restart an
old conversation is served from the SSD tier.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from prefixcache.tiny.models import save_model

TIMEOUT = 60  # seconds per request: a tiny model answers in well under one
START_TIMEOUT = 60
SYSTEM = (
    "You are a careful assistant for a mountain railway. Answer briefly, cite the "
    "timetable when you can, and never invent a station. "
) * 4
QUESTIONS = (
    ("When does the first train leave the valley?", "And on Sundays?", "Is there a bus?"),
    ("How long is the ride to the summit?", "Can I bring a bicycle?", "What does it cost?"),
)
MAX_TOKENS = 12
BLOCK_SIZE = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server subprocess on 127.0.0.1 and its log file."""

    def __init__(self, argv: list[str], log: Path):
        self.port = _free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.text()}")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {START_TIMEOUT}s:\n{self.text()}")

    def chat(self, messages: list[dict[str, str]], **extra: object) -> tuple[str, int]:
        """(reply, cached prompt tokens) of one greedy chat completion (``extra``: more
        request fields, e.g. ``seed``, which sends it down mlx-lm's sequential path)."""
        body = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, **extra}
        reply = requests.post(self.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
        reply.raise_for_status()
        data = reply.json()
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        return data["choices"][0]["message"]["content"] or "", cached

    def stop(self) -> int:
        """SIGTERM, then wait; killed if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def running(argv: list[str], log: Path) -> Iterator[Server]:
    server = Server(argv, log)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("model") / "llama", "llama")


def _ours(model: Path, ssd: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "prefixcache",
        "serve",
        "--model",
        str(model),
        "--ssd-dir",
        str(ssd),
        "--block-size",
        str(BLOCK_SIZE),
        "--mx-cache-limit",
        "256M",
    ]


def _plain(model: Path) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]


def _converse(server: Server) -> tuple[list[list[dict]], list[str], list[list[int]]]:
    """Two conversations sharing a system prompt, interleaved turn by turn.

    Returns the requests in order, their replies and the cached tokens per conversation.
    """
    histories = [[{"role": "system", "content": SYSTEM}] for _ in QUESTIONS]
    requests_sent, replies = [], []
    cached: list[list[int]] = [[] for _ in QUESTIONS]
    for turn in range(len(QUESTIONS[0])):
        for conv, questions in enumerate(QUESTIONS):
            histories[conv].append({"role": "user", "content": questions[turn]})
            messages = [dict(m) for m in histories[conv]]
            reply, num_cached = server.chat(messages)
            requests_sent.append(messages)
            replies.append(reply)
            cached[conv].append(num_cached)
            histories[conv].append({"role": "assistant", "content": reply})
    return requests_sent, replies, cached


def _closed_stats(log: str) -> dict[str, int]:
    found = re.findall(r"prefixcache: closed cache for .*?: (.*)", log)
    assert found, f"no close line in the log:\n{log}"
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])}


def test_serve_multi_turn_matches_plain_and_survives_restart(model_dir, tmp_path):
    ssd = tmp_path / "ssd"
    with running(_ours(model_dir, ssd), tmp_path / "ours.log") as ours:
        sent, replies, cached = _converse(ours)
        assert ours.stop() == 0
    first = _closed_stats(ours.text())
    for conv in cached:
        assert all(b > a for a, b in itertools.pairwise(conv)), cached
    # the second conversation's first turn reuses the first one's system prompt blocks
    assert cached[1][0] >= BLOCK_SIZE * 4, cached
    assert first["num_spills"] > 0, first  # SIGTERM flushed the hot tier to SSD

    with running(_plain(model_dir), tmp_path / "plain.log") as plain:
        plain_replies = [plain.chat(messages)[0] for messages in sent]
    assert plain_replies == replies

    with running(_ours(model_dir, ssd), tmp_path / "restarted.log") as again:
        reply, num_cached = again.chat(sent[-2])  # an old conversation's last request
        assert again.stop() == 0
    assert reply == replies[-2]
    assert num_cached >= cached[0][-1], (num_cached, cached)
    second = _closed_stats(again.text())
    assert second["ssd_block_hits"] > 0 and second["hot_block_hits"] == 0, second


@pytest.mark.parametrize(
    ("arch", "path"),
    [("qwen3_next", "batched"), ("qwen3_next", "sequential"), ("deepseek_v41", "batched")],
)
def test_serve_hybrid_reuses_at_least_what_plain_mlx_lm_does(tmp_path, arch, path):
    """A recurrent hybrid (qwen3_next) and deepseek_v41 (windows, compressed groups):
    three conversations on one system prompt, two turns each, interleaved. Against
    plain ``mlx_lm.server`` on the same requests: replies identical, and every request
    reuses at least as many tokens. Through mlx-lm's batched path (segments cut at
    checkpoints) and its sequential one (a ``seed`` in the request; the prefill stops
    at checkpoints)."""
    model = save_model(tmp_path / arch, arch)
    extra = {"seed": 0} if path == "sequential" else {}
    questions = [QUESTIONS[0][:2], QUESTIONS[1][:2], ("Where is the ticket office?", "Why?")]

    def converse(server: Server) -> tuple[list[str], list[int]]:
        histories = [[{"role": "system", "content": SYSTEM}] for _ in questions]
        replies, cached = [], []
        for turn in range(2):
            for conv, asked in enumerate(questions):
                histories[conv].append({"role": "user", "content": asked[turn]})
                reply, num_cached = server.chat(histories[conv], **extra)
                replies.append(reply)
                cached.append(num_cached)
                histories[conv].append({"role": "assistant", "content": reply})
        return replies, cached

    with running(_ours(model, tmp_path / "ssd"), tmp_path / "ours.log") as ours:
        replies, cached = converse(ours)
    with running(_plain(model), tmp_path / "plain.log") as plain:
        plain_replies, plain_cached = converse(plain)
    assert replies == plain_replies
    assert all(o >= p for o, p in zip(cached, plain_cached, strict=True)), (cached, plain_cached)
    # the third conversation's first turn resumes at least at the system prompt's end
    # (the second one left it there), and every second turn resumes the first
    assert cached[2] > BLOCK_SIZE * 4, cached
    assert all(c > cached[i] for i, c in enumerate(cached[3:])), cached
