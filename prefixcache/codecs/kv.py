"""Codec for mlx-lm's KVCache: blocks are slices of the token axis (axis 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..errors import LayoutMismatchError, MissReason
from ..memory.copies import Copies
from ..memory.runs import COVERED
from .base import Builder, Codec, Resident, owned_tokens, run_shape
from .buffer import TokenBuffer
from .unused import UNUSED


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def owned_slice(x: mx.array, start: int, end: int) -> mx.array:
    """A row-contiguous copy of ``x[..., start:end, :]`` that owns its memory (a
    buffer a whole first chunk filled may be the attention's transposed K/V itself,
    whose plain copy would keep that layout: ``owned_tokens``)."""
    return owned_tokens(x, start, end)


def check_single(cache: Any, keys: mx.array) -> None:
    if keys.shape[0] != 1:
        raise LayoutMismatchError(
            f"{type(cache).__name__} has batch size {keys.shape[0]}; store one sequence "
            "at a time (use the batch cache's extract(i))"
        )


def kv_signature(cache: Any) -> tuple[object, ...]:
    """(class name, dtype, kv heads, k dim, v dim) of a K/V-array cache holding tokens."""
    name = type(cache).__name__
    if cache.keys is None:
        raise LayoutMismatchError(f"{name} is empty: its layout is unknown")
    check_single(cache, cache.keys)
    _, heads, _, k_dim = cache.keys.shape
    return (name, dtype_name(cache.keys.dtype), heads, k_dim, cache.values.shape[-1])


class KVCodec(Codec):
    cache_type = KVCache
    cuts_runs = True

    def layout(self, cache: KVCache) -> tuple[object, ...]:
        # empty after a forward: a layer the model never writes (unused.py)
        return UNUSED if cache.keys is None else kv_signature(cache)

    def length(self, cache: KVCache) -> int | None:
        return None if cache.keys is None else cache.offset

    def cut(
        self, cache: KVCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        if cache.keys is None:
            return {}
        return {
            "keys": owned_slice(cache.keys, start, end),
            "values": owned_slice(cache.values, start, end),
        }

    def builder(self, fresh: KVCache, num_tokens: int, capacity: int, block_size: int) -> Builder:
        return KVBuilder(fresh, num_tokens, capacity, block_size)


class KVBuilder(Builder):
    """Assembles one buffer per K and V of (B, kv_heads, capacity, head_dim).

    ``first`` is the token the buffers start at (a chunked cache keeps only
    its current chunk); ``missing`` is the miss reason of a block without keys.
    """

    takes_host = True  # TokenBuffer takes streamed HostArrays and Placed tensors
    placed_checks_only = True  # a Placed tensor's add checks its names and fit only
    missing = MissReason.LAYOUT_MISMATCH

    def __init__(
        self, fresh: Any, num_tokens: int, capacity: int, block_size: int, *, first: int = 0
    ):
        self.cache = fresh
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.first = first
        self.keys = TokenBuffer(capacity)
        self.values = TokenBuffer(capacity)

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        if "keys" not in arrays:
            raise LayoutMismatchError(f"block {index} has no keys for this layer", self.missing)
        pos = index * self.block_size - self.first
        self.keys.add(pos, arrays["keys"])
        self.values.add(pos, arrays["values"])

    def add_resident(self, indices: Sequence[int], blocks: Sequence[Resident], prefix: str) -> bool:
        if indices[-1] - indices[0] != len(indices) - 1:
            return False  # not one run (a layer's blocks are a range): one at a time
        keys, values = prefix + "keys", prefix + "values"
        if not all(keys in a and values in a for a, _ in blocks):
            return False  # e.g. a chunked block trimmed in front: one at a time
        # a run's consecutive blocks come as one view, the rest of them COVERED (runs.py)
        heads = [v for _, v in blocks if v is not COVERED]
        try:
            ks, vs = [v[keys] for v in heads], [v[values] for v in heads]
        except KeyError:
            return False
        last_k, last_v = blocks[-1][0][keys], blocks[-1][0][values]
        bs = self.block_size
        start = indices[0] * bs - self.first
        # every block but a chain's last is whole: a shorter one fails numpy's copy
        end_k = start + (len(indices) - 1) * bs + last_k.shape[2]
        end_v = start + (len(indices) - 1) * bs + last_v.shape[2]
        self.keys.add_views(start, end_k, blocks[0][0][keys], ks)
        self.values.add_views(start, end_v, blocks[0][0][values], vs)
        return True

    def reserve(self, index: int, arrays: dict[str, Any]) -> list[mx.array]:
        """Buffers to allocate for a streamed block (see TokenBuffer.reserve)."""
        return self.keys.reserve(arrays.get("keys")) + self.values.reserve(arrays.get("values"))

    def destination(
        self, index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None:
        """Where the SSD stream may read block ``index``'s ``name`` tensor (see TokenBuffer)."""
        buf = self.keys if name == "keys" else self.values if name == "values" else None
        run = run_shape(shape, count, self.block_size)  # full blocks lie one after another
        if buf is None or run is None:
            return None
        return buf.destination(index * self.block_size - self.first, dtype, run)

    def allocate(self) -> list[mx.array]:
        return self.keys.allocate() + self.values.allocate()

    def queue_copies(self, copies: Copies) -> None:
        self.keys.queue_copies(copies)
        self.values.queue_copies(copies)

    def buffers(self) -> list[mx.array]:
        return [b for b in (self.keys.materialize(), self.values.materialize()) if b is not None]

    def finish(self) -> Any:
        self.cache.keys = self.keys.finish()
        self.cache.values = self.values.finish()
        self.cache.offset = self.num_tokens
        return self.cache
