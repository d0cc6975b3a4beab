"""Read request traces in the Mooncake JSONL format, and make their token ids.

One JSON object a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, 2353, 2354]}

``timestamp`` is the arrival in milliseconds, ``input_length`` and
``output_length`` are tokens, ``hash_ids`` are the prompt's prefix blocks of
``TRACE_BLOCK_TOKENS`` tokens each (identical ids are identical prefixes; the
last block may be partial). An optional ``block_tokens`` field gives another
block size (``prefixcache serve --record-trace`` writes its cache's). A line
that is not such an object raises :class:`TraceError` naming the file and the
line number; blank lines are skipped.

A trace carries no text: :func:`request_tokens` makes a request's token ids,
the same for the same block id in every request (a seeded string per id),
the last block cut to ``input_length``, blocks scaled to ``block_tokens``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line that cannot be read: the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival, milliseconds from the start of the trace.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: the prompt's prefix block ids, root first.
        trace_block_tokens: tokens per hash id in the trace (Mooncake's: 512).
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    trace_block_tokens: int = TRACE_BLOCK_TOKENS

    def block_tokens(self, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
        """Tokens of each block at ``block_tokens`` per block (the last one may be short)."""
        n = len(self.hash_ids)
        if n == 0:
            return []
        total = scaled_length(self.input_length, n, block_tokens, self.trace_block_tokens)
        return [block_tokens] * (n - 1) + [total - (n - 1) * block_tokens]


def scaled_length(
    input_length: int, num_blocks: int, block_tokens: int, trace_block: int = TRACE_BLOCK_TOKENS
) -> int:
    """The prompt's length at ``block_tokens`` per block: ``input_length`` scaled from
    ``trace_block``-token blocks, within the blocks it has (the last one holds at
    least a token)."""
    scaled = math.ceil(input_length * block_tokens / trace_block)
    return min(num_blocks * block_tokens, max((num_blocks - 1) * block_tokens + 1, scaled))


def read_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """The requests of the trace at ``path`` (the first ``limit`` of them if given).

    Raises:
        TraceError: a line is not JSON, lacks a field, or holds a wrong value.
        OSError: the file cannot be read.
    """
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(parse_line(line, f"{path}: line {number}"))
    return out


def parse_line(line: str, where: str) -> TraceRequest:
    """One request from one JSON line; ``where`` (``FILE: line N``) prefixes any error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: not a JSON object")
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        raise TraceError(f"{where}: missing field {', '.join(map(repr, missing))}")
    numbers = [record[name] for name in _FIELDS[:3]]
    for name, value in zip(_FIELDS, numbers, strict=False):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise TraceError(f"{where}: {name} must be a number >= 0, got {value!r}")
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    timestamp, input_length, output_length = (int(v) for v in numbers)
    size = record.get("block_tokens", TRACE_BLOCK_TOKENS)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TraceError(f"{where}: block_tokens must be an integer >= 1, got {size!r}")
    if ids and input_length > len(ids) * size:
        raise TraceError(
            f"{where}: input_length {input_length} exceeds {len(ids)} blocks of {size} tokens"
        )
    return TraceRequest(timestamp, input_length, output_length, tuple(ids), size)


def block_token_ids(block_id: int, num_tokens: int, *, vocab_size: int, seed: int = 0) -> list[int]:
    """The token ids of block ``block_id``: a string of ``num_tokens`` seeded by the id."""
    rng = np.random.default_rng([seed, block_id])
    return rng.integers(0, vocab_size, size=num_tokens).tolist()


def request_tokens(
    request: TraceRequest, *, block_tokens: int, vocab_size: int, seed: int = 0
) -> list[int]:
    """The prompt of ``request``: each block's tokens, the last block cut short.

    Raises:
        ValueError: ``block_tokens`` or ``vocab_size`` is not a positive integer.
    """
    if block_tokens < 1 or vocab_size < 1:
        raise ValueError(
            f"block_tokens and vocab_size must be >= 1, got {block_tokens}, {vocab_size}"
        )
    out: list[int] = []
    for block_id, n in zip(request.hash_ids, request.block_tokens(block_tokens), strict=True):
        out += block_token_ids(block_id, block_tokens, vocab_size=vocab_size, seed=seed)[:n]
    return out
