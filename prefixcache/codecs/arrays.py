"""Codec for ArraysCache: recurrent state (mamba/SSM, gated delta net, conv state)
and histories of token ids (n-gram embeddings).

The state summarises every token seen so far and cannot be sliced, so it is
snapshotted where the cache stands (the end of a prefill chunk, or of a stored
sequence) and kept with the block, or the tail block, that ends there. A
restore at ``L`` tokens needs only the snapshot of the block holding token
``L - 1``, and only if that block ends at ``L`` (the cache cannot be trimmed:
the facade restores a recurrent model only where a block or tail ends). ArraysCache has no
``offset``: the caller's token count says where the cache stands.

Streamed from a lower tier, each slot's array is allocated unwritten from the
block's header before the stream starts (``reserve``) and read straight into
(``destination``): one copy, the reader's, as a K/V buffer gets its blocks.
From the hot tier, a large slot is copied into an unwritten array with the
restore's other copies (``queue_copies``: memcpy speed, huge pages), a small
one into a new MLX array.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from ..errors import LayoutMismatchError, MissReason
from ..memory.copies import Copies
from ..memory.host import HostArray, Placed, host_bytes, host_view
from ..memory.huge_pages import advise_huge
from ..memory.restore_buffers import SMALL, new_buffer, resolve
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
        return ArraysBuilder(fresh, num_blocks(num_tokens, block_size) - 1)


class ArraysBuilder(Builder):
    """Takes the state snapshot of block ``last`` (the one ending where the restore
    does): new arrays from the hot tier's, or streamed bytes in reserved ones."""

    takes_host = True  # a streamed slot is read into its reserved array, or copied once
    whole_tensors = True  # ``reserve`` sizes each array as the header's tensor itself

    def __init__(self, fresh: ArraysCache, last: int):
        self.cache = fresh
        self.last = last
        self._fresh: dict[int, Any] = {}  # slot -> array (or batch Slot) reserved, not open
        # slot -> (array, its writable host bytes): set once opened, read by reader threads
        self._open: dict[int, tuple[mx.array, np.ndarray]] = {}
        self._hot: dict[int, mx.array] = {}  # slot -> a hot block's large array, to copy

    def reserve(self, index: int, arrays: Mapping[str, Any]) -> list[mx.array]:
        """Allocate (unwritten) each slot's array from its streamed tensor or spec."""
        if index != self.last or self._fresh or self._open:
            return []
        for i in range(len(self.cache.cache)):
            x = arrays.get(str(i))
            if isinstance(x, HostArray | Placed) and x.shape and math.prod(x.shape):
                self._fresh[i] = new_buffer(x.shape, x.dtype)
        return [a for a in self._fresh.values() if isinstance(a, mx.array)]

    def destination(
        self, index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None:
        """A slot's reserved array, for the reader to read block ``last``'s ``name`` into."""
        opened = self._open.get(int(name)) if name.isdigit() and index == self.last else None
        if opened is None or count != 1 or not _fits(opened[0], dtype, shape):
            return None
        return opened[1]

    def add(self, index: int, arrays: dict[str, Any]) -> None:
        slots = len(self.cache.cache)
        if any(str(i) not in arrays for i in range(slots)):
            raise LayoutMismatchError(f"block {index} has no recurrent-state snapshot", BOUNDARY)
        # new arrays: the live cache must never hold the hot tier's own objects
        self.cache.cache = [self._take(i, arrays[str(i)]) for i in range(slots)]

    def _take(self, i: int, x: Any) -> mx.array | None:
        if not isinstance(x, HostArray | Placed):  # a hot block's array: copied into a new one
            if x.nbytes < SMALL or not x.ndim:
                return mx.array(x)
            self._hot[i] = x  # ``queue_copies`` copies it
            return None
        opened = self._opened(i)
        if opened is not None and _fits(opened[0], x.dtype, x.shape):
            if isinstance(x, HostArray):
                opened[1][...] = x.rows()  # a view of a read buffer: copied at once
                return opened[0]
            if x.region is opened[1]:  # read into it by the stream
                return opened[0]
        if type(x) is Placed:
            raise LayoutMismatchError(f"placed state {x.dtype}{x.shape} is not in its array")
        return x.to_mx()

    def _opened(self, i: int) -> tuple[mx.array, np.ndarray] | None:
        """Slot ``i``'s array and host bytes, opened now if it was only reserved."""
        fresh = self._fresh.pop(i, None)
        if fresh is not None:
            array = resolve(fresh)
            mx.eval(array)
            view = host_view(array)
            advise_huge(view)
            self._open[i] = (array, view)
        return self._open.get(i)

    def buffers(self) -> list[mx.array]:
        for i in list(self._fresh):  # open the reserved arrays for the readers
            self._opened(i)
        return [a for a in self.cache.cache if a is not None]

    def allocate(self) -> list[mx.array]:
        """Unwritten arrays for the hot block's large slots, made with the restore's."""
        for i, x in self._hot.items():
            if i not in self._fresh and i not in self._open:
                self._fresh[i] = new_buffer(x.shape, x.dtype)
        return [a for i, a in self._fresh.items() if i in self._hot and isinstance(a, mx.array)]

    def queue_copies(self, copies: Copies) -> None:
        """Hand the hot block's large slots' copies to ``copies`` (numpy only)."""
        for i, x in self._hot.items():
            array, view = self._opened(i) or self._made(i, x)
            copies.add(x.nbytes, partial(np.copyto, view, host_bytes(x)))
            self.cache.cache[i] = array
        self._hot.clear()

    def _made(self, i: int, x: mx.array) -> tuple[mx.array, np.ndarray]:
        """Slot ``i``'s array made now (``allocate`` was not called first)."""
        self._fresh[i] = new_buffer(x.shape, x.dtype)
        opened = self._opened(i)
        assert opened is not None
        return opened

    def finish(self) -> ArraysCache:
        for i, x in self._hot.items():  # no ``queue_copies`` came: a copy each here
            self.cache.cache[i] = mx.array(x)
        self._hot.clear()
        return self.cache


def _fits(array: mx.array, dtype: mx.Dtype, shape: tuple[int, ...]) -> bool:
    return array.dtype == dtype and tuple(array.shape) == tuple(shape)
