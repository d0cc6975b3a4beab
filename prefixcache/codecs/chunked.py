"""Codec for ChunkedKVCache (llama4's chunked local attention).

The cache keeps tokens ``[start_position, offset)`` and, before every forward,
drops all but the last ``chunk_size`` of them. A block is cut while it is still
held; a restore at ``L`` tokens needs only the blocks covering the last
``chunk_size`` tokens and starts the buffer at the first of them. The model's
next ``maybe_trim_front`` then leaves exactly what the live cache would hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ChunkedKVCache

from ..errors import LayoutMismatchError, MissReason
from .base import Builder, Codec, Payload, num_blocks, owned_tokens, round_up
from .kv import KVBuilder, kv_signature

CHUNK = MissReason.WINDOW_NOT_COVERED


def first_block(fresh: ChunkedKVCache, num_tokens: int, block_size: int) -> int:
    return max(0, num_tokens - fresh.chunk_size) // block_size


class ChunkedKVCodec(Codec):
    cache_type = ChunkedKVCache

    def layout(self, cache: ChunkedKVCache) -> tuple[object, ...]:
        return (*kv_signature(cache), cache.chunk_size)

    def length(self, cache: ChunkedKVCache) -> int:
        return cache.offset

    def window(self, cache: ChunkedKVCache) -> tuple[str, int, int]:
        return ("", cache.chunk_size, 0)

    def reach(self, cache: ChunkedKVCache, length: int) -> int:
        return length if cache.keys is None else cache.start_position

    def cut(
        self, cache: ChunkedKVCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        first = cache.start_position
        if cache.keys is None or end <= first or end > cache.offset:
            return {}
        a, b = max(start, first) - first, end - first
        # after maybe_trim_front the buffer itself is a slice of an older one
        out = {
            "keys": owned_tokens(cache.keys, a, b),
            "values": owned_tokens(cache.values, a, b),
        }
        if start >= first:
            return out
        # trimmed in front: the tokens still held, enough for a restore near the end
        out = {f"last.{name}": x for name, x in out.items()}
        out["last.first"] = mx.array([first - start], dtype=mx.int32)
        return out

    def blocks_needed(
        self, fresh: ChunkedKVCache, num_tokens: int, block_size: int
    ) -> Sequence[int]:
        first = first_block(fresh, num_tokens, block_size)
        return range(first, num_blocks(num_tokens, block_size))

    def missing(
        self, fresh: ChunkedKVCache, num_tokens: int, block_size: int, payload: Payload
    ) -> tuple[int, MissReason] | None:
        for index in reversed(self.blocks_needed(fresh, num_tokens, block_size)):
            has = payload(index)
            # ``last``: a block trimmed in front; how far it reaches back, the builder checks
            if has is not None and not (has("keys") or has("last.keys")):
                return index, CHUNK
        return None

    def builder(
        self, fresh: ChunkedKVCache, num_tokens: int, capacity: int, block_size: int
    ) -> Builder:
        return ChunkedBuilder(fresh, num_tokens, capacity, block_size)


class ChunkedBuilder(KVBuilder):
    """One buffer starting at the first needed block (the new ``start_position``)."""

    missing = CHUNK
    placed_checks_only = False  # a block trimmed in front is judged by its values

    def __init__(self, fresh: ChunkedKVCache, num_tokens: int, capacity: int, block_size: int):
        first = first_block(fresh, num_tokens, block_size) * block_size
        super().__init__(fresh, num_tokens, round_up(capacity - first), block_size, first=first)

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        """A block trimmed in front (``last.*``) serves if it holds every token the
        restored chunk needs; the buffer before it is cut off by the model's next
        ``maybe_trim_front``."""
        if "keys" in arrays or "last.keys" not in arrays:
            return super().add(index, arrays)
        start = index * self.block_size + int(arrays["last.first"].item())
        if start > max(0, self.num_tokens - self.cache.chunk_size):
            raise LayoutMismatchError(f"block {index} lost tokens of the chunk", CHUNK)
        self.keys.add(start - self.first, arrays["last.keys"])
        self.values.add(start - self.first, arrays["last.values"])

    def finish(self) -> ChunkedKVCache:
        cache = super().finish()
        cache.start_position = self.first
        return cache
