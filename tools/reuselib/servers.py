"""The three servers compared, as real subprocesses on free loopback ports.

``mlx-lm``  plain ``mlx_lm.server`` (its LRUPromptCache, default settings)
``ours``    ``prefixcache serve`` with the hot and SSD tiers (SSD in a temp dir)
``none``    ``mlx_lm.server --prompt-cache-size 0``: every insert is evicted at
            once (``len > max_size`` after each insert), so nothing is ever
            fetched and every reply is computed from the whole prompt. The
            reference. (``--prompt-cache-bytes 0`` would not do: mlx-lm applies
            it by ``trim_to`` only after the next request's fetch, and never on
            its sequential path.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SYSTEMS = ("mlx-lm", "ours", "none")
START_TIMEOUT = 120.0  # seconds: three servers start at once on a shared 2-core machine
REQUEST_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class Reply:
    """One chat completion: the text, the server's token counts, or the error."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    error: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def system_argv(
    system: str, model: Path, workdir: Path, block_size: int, mlx_lm_args: Sequence[str] = ()
) -> list[str]:
    """The command line that starts ``system`` on ``model`` (host and port added later).

    ``mlx_lm_args`` go to the plain mlx-lm server only (e.g. a larger ``--prompt-cache-size``).
    """
    plain = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
    if system == "mlx-lm":
        return [*plain, *mlx_lm_args]
    if system == "none":
        return [*plain, "--prompt-cache-size", "0"]
    if system == "ours":
        ssd = workdir / "ssd"
        return [
            *(sys.executable, "-m", "prefixcache", "serve", "--model", str(model)),
            *("--ssd-dir", str(ssd), "--block-size", str(block_size)),
        ]
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


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

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Reply:
        """One greedy chat completion; a failed request is a Reply with ``error`` set."""
        body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens}
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
                data = json.load(reply)
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
            alive = "" if self.proc.poll() is None else f" (exited {self.proc.returncode})"
            return Reply("", 0, 0, time.perf_counter() - start, f"{err}{alive}")
        usage = data["usage"]
        return Reply(
            data["choices"][0]["message"]["content"] or "",
            usage["prompt_tokens"],
            usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            time.perf_counter() - start,
        )

    def first_token(
        self, messages: list[dict[str, str]], max_tokens: int = 4, **extra: object
    ) -> float:
        """Seconds from sending a greedy streamed chat completion to its first token
        (the rest of the reply is read and dropped); ``extra``: more request fields
        (a ``seed`` sends it down mlx-lm's sequential path).

        Raises:
            RuntimeError: the request failed (with the server's log tail).
        """
        body = {
            "messages": messages,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            **extra,
        }
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        first = None
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
                for line in reply:
                    if first is None and line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("delta"):
                            first = time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
            raise RuntimeError(f"{self.name}: {err}: {self.tail()}") from None
        if first is None:
            raise RuntimeError(f"{self.name}: no token streamed: {self.tail()}")
        return first

    def alive(self) -> bool:
        return self.proc.poll() is None

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


def start_servers(
    model: Path, workdir: Path, block_size: int, mlx_lm_args: Sequence[str] = ()
) -> dict[str, Server]:
    """Start every system on ``model`` side by side and wait until each is ready.

    Raises:
        RuntimeError: a server exited or did not answer (the others are stopped).
    """
    shutil.rmtree(workdir / "ssd", ignore_errors=True)  # a kept --workdir: start cold
    servers: dict[str, Server] = {}
    try:
        for system in SYSTEMS:
            argv = system_argv(system, model, workdir, block_size, mlx_lm_args)
            servers[system] = Server(system, argv, workdir / f"{system}.log")
        for server in servers.values():
            server.wait_ready()
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers
