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
from functools import partial

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from ..errors import LayoutMismatchError, MissReason
from ..memory.copies import Copies
from ..memory.host import SAFETENSORS_DTYPES, host_view
from ..memory.restore_buffers import Slot, advise_huge, current, empty, resolve
from .base import Builder, Codec, Payload, Resident, num_blocks, owned
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
    """The snapshot's arrays copied into new ones. From the hot tier
    (``add_resident``), a large one (a gated delta net's 2 MiB state) goes into a
    restore buffer made with the restore's others and put on huge pages
    (``memory.restore_buffers``), copied with the hot blocks; the rest, and a
    snapshot from a lower tier (``add``), are copied by MLX (``mx.array``)."""

    def __init__(self, fresh: ArraysCache):
        self.cache = fresh
        # large hot arrays to copy: (slot, array, its host bytes, the buffer once made)
        self._large: list[tuple[int, mx.array, np.ndarray, mx.array | Slot | None]] = []

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        slots = len(self.cache.cache)
        if any(str(i) not in arrays for i in range(slots)):
            raise LayoutMismatchError(f"block {index} has no recurrent-state snapshot", BOUNDARY)
        # new arrays: the live cache must never hold the hot tier's own objects
        self.cache.cache = [mx.array(arrays[str(i)]) for i in range(slots)]
        self._large = []

    def add_resident(self, indices: Sequence[int], blocks: Sequence[Resident], prefix: str) -> bool:
        if len(indices) != 1:
            return False  # one at a time: ``add`` checks each
        (payload, views), slots = blocks[0], len(self.cache.cache)
        names = [f"{prefix}{i}" for i in range(slots)]
        if any(name not in payload for name in names):
            return False  # ``add`` reports it
        state = [payload[name] for name in names]
        large = {i for i, a in enumerate(state) if _large(a) and names[i] in views}
        self._large = [(i, state[i], views[names[i]], None) for i in sorted(large)]
        self.cache.cache = [None if i in large else mx.array(a) for i, a in enumerate(state)]
        return True

    def allocate(self) -> list[mx.array]:
        batch, made = current(), []
        for n, (i, source, view, _) in enumerate(self._large):
            shape, dtype = tuple(source.shape), source.dtype
            if batch is not None and batch.takes(shape, dtype, mx.cpu):
                into = batch.add(shape, dtype)
            else:
                into = empty(shape, dtype, stream=mx.cpu)
                made.append(into)
            self._large[n] = (i, source, view, into)
        return made

    def queue_copies(self, copies: Copies) -> None:
        left = []
        for i, source, view, into in self._large:
            if into is None:
                left.append((i, source, view, into))  # not allocated: ``finish`` copies it
                continue
            array = resolve(into)
            mx.eval(array)  # cheap: the restore evaluated it with the others
            host = host_view(array)
            advise_huge(host)
            copies.add(host.nbytes, partial(_copy, host, view))
            self.cache.cache[i] = array
        self._large = left

    def buffers(self) -> list[mx.array]:
        return [a for a in self.cache.cache if a is not None]

    def finish(self) -> ArraysCache:
        for i, source, _, _ in self._large:  # not copied by ``queue_copies``
            self.cache.cache[i] = mx.array(source)
        self._large = []
        return self.cache


# bytes: from here a snapshot's array goes into a restore buffer on huge pages (a
# huge page is 2 MiB); below, MLX's copy into its own allocation costs less
_LARGE = 2 << 20


def _large(a: object) -> bool:
    return isinstance(a, mx.array) and a.nbytes >= _LARGE and a.dtype in SAFETENSORS_DTYPES


def _copy(host: np.ndarray, view: np.ndarray) -> None:
    """A snapshot array's host bytes into its restore buffer's (same size)."""
    np.copyto(host.reshape(-1), view.reshape(-1))
