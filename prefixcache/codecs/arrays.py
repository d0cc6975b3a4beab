"""Codec for ArraysCache: recurrent state (mamba/SSM, gated delta net, conv state)
and histories of token ids (n-gram embeddings).

The state summarises every token seen so far and cannot be sliced, so it is
snapshotted where the cache stands (the end of a prefill chunk, or of a stored
sequence) and kept with the block, or the tail block, that ends there. A
restore at ``L`` tokens needs only the snapshot of the block holding token
``L - 1``, and only if that block ends at ``L`` (the cache cannot be trimmed:
the facade restores a recurrent model only where a block or tail ends). ArraysCache has no
``offset``: the caller's token count says where the cache stands.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import LayoutMismatchError, MissReason
from .base import Builder, Codec, Payload, num_blocks, owned
from .kv import dtype_name

BOUNDARY = MissReason.BOUNDARY_MISSING


def slot_signature(a: mx.array | None) -> tuple[object, ...] | None:
    """A slot's part of the layout: dtype and shape after the batch axis. A slot of
    integers holds token ids, not a state computed from weights (longcat_flash_ngram
    keeps the last n - 1 ids, 1 wide after one token, n - 1 from then on): its width
    follows the tokens seen, so only its dtype and rank name it."""
    if a is None:
        return None
    if mx.issubdtype(a.dtype, mx.integer):
        return (dtype_name(a.dtype), "ids", a.ndim)
    return (dtype_name(a.dtype), *a.shape[1:])


class ArraysCodec(Codec):
    cache_type = ArraysCache

    def layout(self, cache: ArraysCache) -> tuple[object, ...]:
        if cache.empty():
            raise LayoutMismatchError("ArraysCache is empty: its layout is unknown")
        batch = cache.batch_size
        if batch != 1:
            raise LayoutMismatchError(
                f"ArraysCache has batch size {batch}; store one sequence at a time "
                "(use the batch cache's extract(i))"
            )
        return ("ArraysCache", *(slot_signature(a) for a in cache.cache))

    def length(self, cache: ArraysCache) -> None:
        return None

    def trimmable_at(self, fresh: ArraysCache, num_tokens: int) -> bool:
        return False

    def reach(self, cache: ArraysCache, length: int) -> int:
        return max(0, length - 1)  # only the block ending where the cache stands

    def cut(
        self, cache: ArraysCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        if not snapshot or end != length or any(a is None for a in cache.cache):
            return {}
        # copies: the live arrays may be views of a batch, or be donated next step
        return {str(i): owned(a) for i, a in enumerate(cache.cache)}

    def blocks_needed(self, fresh: ArraysCache, num_tokens: int, block_size: int) -> Sequence[int]:
        return (num_blocks(num_tokens, block_size) - 1,) if num_tokens else ()

    def missing(
        self, fresh: ArraysCache, num_tokens: int, block_size: int, payload: Payload
    ) -> tuple[int, MissReason] | None:
        if not num_tokens:
            return None
        last = num_blocks(num_tokens, block_size) - 1  # the state is where it ends
        has = payload(last)
        if has is None or all(has(str(i)) for i in range(len(fresh.cache))):
            return None
        return last, BOUNDARY

    def builder(
        self, fresh: ArraysCache, num_tokens: int, capacity: int, block_size: int
    ) -> Builder:
        return ArraysBuilder(fresh)


class ArraysBuilder(Builder):
    def __init__(self, fresh: ArraysCache):
        self.cache = fresh

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        slots = len(self.cache.cache)
        if any(str(i) not in arrays for i in range(slots)):
            raise LayoutMismatchError(f"block {index} has no recurrent-state snapshot", BOUNDARY)
        # new arrays: the live cache must never hold the hot tier's own objects
        self.cache.cache = [mx.array(arrays[str(i)]) for i in range(slots)]

    def buffers(self) -> list[mx.array]:
        return [a for a in self.cache.cache if a is not None]

    def finish(self) -> ArraysCache:
        return self.cache
