"""Record a server's traffic as a Mooncake-format trace (``serve --record-trace FILE``).

One JSON line per request, written and flushed when its reply ends:
``timestamp`` (milliseconds from the recorder's start to the request's
arrival), ``input_length`` (prompt tokens), ``output_length`` (tokens
generated), ``hash_ids`` and ``block_tokens``. The prompt is cut into blocks
of ``block_tokens`` (the cache's block size); each block's id stands for the
chain key of the prefix it ends (``hashing.chain_keys``), and a short last
block gets an id too (its tail key), as in Mooncake's traces. Keys become
small integers in the order they are first seen: equal ids are equal
prefixes, and no token id is written. ``block_tokens`` tells the trace
reader the block size (Mooncake's own traces have 512 and omit it).

Lines come in the order replies end (the order a cache stores them); a tool
that needs arrival order sorts by ``timestamp``. Safe under concurrent
requests: one lock around the remapping and the write.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash

from ..hashing import TOKEN_BYTES, chain_keys, tail_key, token_bytes

_ROOT = xxhash.xxh3_128_digest(b"prefixcache/trace-recorder\0")


class TraceRecorder:
    """Appends one Mooncake line per finished request to ``path``.

    Args:
        path: the file (created, or appended to: ids then restart from 0).
        block_tokens: tokens per block, the cache's ``block_size``.

    Raises:
        ValueError: ``block_tokens`` is not a positive integer.
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str, block_tokens: int):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._ids: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.num_requests = 0

    def now(self) -> float:
        """Seconds since the recorder started (an arrival's timestamp)."""
        return time.monotonic() - self._start

    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The chain key of every block of ``prompt``, the short last one's tail key too."""
        data = token_bytes(list(prompt))
        keys = chain_keys(_ROOT, data, self.block_tokens)
        rest = data[len(keys) * self.block_tokens * TOKEN_BYTES :]
        if rest:
            keys.append(tail_key(keys[-1] if keys else _ROOT, rest))
        return keys

    def record(self, arrival: float, prompt: Sequence[int], output_length: int) -> None:
        """Write the line of a request that arrived at ``arrival`` (``now()``) and ended."""
        keys = self.keys(prompt)
        with self._lock:
            if self._file.closed:
                return
            ids = [self._ids.setdefault(k, len(self._ids)) for k in keys]
            line = {
                "timestamp": round(arrival * 1000),
                "input_length": len(prompt),
                "output_length": output_length,
                "hash_ids": ids,
                "block_tokens": self.block_tokens,
            }
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
            self.num_requests += 1

    def follow(self, arrival: float, ctx: Any, responses: Iterator[Any]) -> Iterator[Any]:
        """``responses`` (mlx-lm's, one per generated token) passed through; the request's
        line is written when they end, however they end (a client gone too)."""
        count = 0
        try:
            for response in responses:
                count += 1
                yield response
        finally:
            self.record(arrival, ctx.prompt, count)

    def recording(self, base: type) -> type:
        """``base`` (mlx-lm's ResponseGenerator or a subclass) with each request's reply
        passed through :meth:`follow`."""
        recorder = self

        class RecordingGenerator(base):  # type: ignore[misc,valid-type]
            def generate(self, request: Any, generation_args: Any, progress_callback: Any = None):
                arrival = recorder.now()
                ctx, responses = super().generate(request, generation_args, progress_callback)
                return ctx, recorder.follow(arrival, ctx, responses)

        return RecordingGenerator

    def close(self) -> None:
        with self._lock:
            self._file.close()
