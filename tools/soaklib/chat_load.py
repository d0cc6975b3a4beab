"""Chat load for the sustained serve scenario: 4 system prompts, random user
turns, and client threads sending them to a server back to back or at a rate."""

from __future__ import annotations

import random
import threading
import time

from reuselib.servers import Server

WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "model",
    "server",
    "memory",
    "disk",
    "write",
    "read",
    "chain",
    "tier",
    "hot",
    "restore",
    "prompt",
    "system",
    "user",
    "reply",
    "batch",
    "queue",
    "budget",
    "eviction",
    "layer",
    "value",
    "key",
]


class Chats:
    """4 system prompts, random user turns (thread-safe)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.systems = [self.words(60, seed * 10 + s) for s in range(4)]

    def words(self, n: int, seed: int) -> str:
        rng = random.Random(seed)
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def next(self) -> list[dict[str, str]]:
        with self._lock:
            system = self._rng.choice(self.systems)
            user = self.words(self._rng.randrange(4, 30), self._rng.randrange(1 << 30))
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]


class Clients:
    """4 threads sending chats until stopped; a pause gate for the kill."""

    def __init__(self, chats: Chats, rate: float):
        self.chats, self.rate = chats, rate
        self.server: Server | None = None
        self.go, self.stop = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.ttfts: list[float] = []
        self.prompt_tokens = self.cached = self.errors = self.ops = 0
        self.busy = 0
        self.idle = threading.Condition(self.lock)

    def run(self) -> None:
        n = 0
        began = time.monotonic()
        while not self.stop.is_set():
            self.go.wait()
            if self.stop.is_set():
                return
            if self.rate > 0:
                time.sleep(max(0.0, began + n / self.rate - time.monotonic()))
            n += 1
            with self.lock:
                if not self.go.is_set():
                    continue
                self.busy += 1
                server = self.server
            try:
                got = server.stream(self.chats.next(), 4, usage=True)
                with self.lock:
                    self.ttfts.append(got.first)
                    self.prompt_tokens += got.prompt_tokens
                    self.cached += got.cached_tokens
                    self.ops += 1
            except (RuntimeError, LookupError):
                with self.lock:
                    self.errors += 1
            finally:
                with self.lock:
                    self.busy -= 1
                    self.idle.notify_all()

    def pause(self) -> None:
        with self.lock:
            self.go.clear()
            self.idle.wait_for(lambda: self.busy == 0, timeout=600)

    def take(self) -> tuple[list[float], float]:
        with self.lock:
            ttfts, self.ttfts = self.ttfts, []
            share = self.cached / self.prompt_tokens if self.prompt_tokens else 0.0
            self.cached = self.prompt_tokens = 0
        return ttfts, share
