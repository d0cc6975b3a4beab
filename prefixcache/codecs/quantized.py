"""Codec for QuantizedKVCache: packed uint32 data, scales and biases, never dequantized.

Each token row is quantized on its own (groups run along head_dim), so a slice
of the packed arrays is exactly the quantization of the slice. Full-precision
blocks (captured before mlx-lm switched the cache to quantized) are quantized
on restore with ``mx.quantize``, which matches ``KVCache.to_quantized`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from ..errors import LayoutMismatchError
from ..memory.copies import Copies
from ..memory.host import HostArray
from .base import Builder, Codec, Resident, run_shape
from .buffer import TokenBuffer
from .kv import check_single, dtype_name, owned_slice

PARTS = ("q", "scales", "biases")


class QuantizedKVCodec(Codec):
    cache_type = QuantizedKVCache

    def layout(self, cache: QuantizedKVCache) -> tuple[object, ...]:
        # Same signature as the KVCache it was quantized from: bits and group
        # size belong to the namespace's kv_quant entry.
        if cache.keys is None:
            raise LayoutMismatchError("QuantizedKVCache is empty: its layout is unknown")
        k_packed, k_scales, _ = cache.keys
        check_single(cache, k_packed)
        per_word = 32 // cache.bits
        _, heads, _, _ = k_packed.shape
        k_dim = k_packed.shape[-1] * per_word
        v_dim = cache.values[0].shape[-1] * per_word
        return ("KVCache", dtype_name(k_scales.dtype), heads, k_dim, v_dim)

    def length(self, cache: QuantizedKVCache) -> int:
        return cache.offset

    def cut(
        self, cache: QuantizedKVCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        out = {}
        for name, packed in (("keys", cache.keys), ("values", cache.values)):
            for part, arr in zip(PARTS, packed, strict=True):
                out[f"{name}.{part}"] = owned_slice(arr, start, end)
        return out

    def builder(
        self, fresh: QuantizedKVCache, num_tokens: int, capacity: int, block_size: int
    ) -> Builder:
        return QuantizedBuilder(fresh, num_tokens, capacity, block_size)


class QuantizedBuilder(Builder):
    """Assembles packed buffers; fp blocks are quantized on the way in."""

    takes_host = True  # TokenBuffer takes streamed packed parts; fp ones become MLX arrays

    def __init__(self, fresh: QuantizedKVCache, num_tokens: int, capacity: int, block_size: int):
        self.cache = fresh
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.parts = {name: [TokenBuffer(capacity) for _ in PARTS] for name in ("keys", "values")}

    def _packed(self, arrays: dict[str, mx.array], name: str) -> tuple[mx.array, ...]:
        if f"{name}.q" in arrays:
            return tuple(arrays[f"{name}.{p}"] for p in PARTS)
        if name in arrays:
            c = self.cache
            x = arrays[name]
            x = x.to_mx() if isinstance(x, HostArray) else x
            return tuple(mx.quantize(x, group_size=c.group_size, bits=c.bits))
        raise LayoutMismatchError(f"block payload has no {name!r}")

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        start = index * self.block_size
        for name, bufs in self.parts.items():
            for buf, p in zip(bufs, self._packed(arrays, name), strict=True):
                buf.add(start, p)

    def add_resident(self, indices: Sequence[int], blocks: Sequence[Resident], prefix: str) -> bool:
        names = [f"{prefix}{name}.{p}" for name in self.parts for p in PARTS]
        if not all(n in arrays and n in views for arrays, views in blocks for n in names):
            return False  # a full-precision block is quantized on its own
        at = [i * self.block_size for i in indices]
        bufs = [b for bufs in self.parts.values() for b in bufs]
        for buf, n in zip(bufs, names, strict=True):
            buf.add_run([(p, a[n], v[n]) for p, (a, v) in zip(at, blocks, strict=True)])
        return True

    def reserve(self, index: int, arrays: dict[str, Any]) -> list[mx.array]:
        """Buffers to allocate for a streamed packed block (see TokenBuffer.reserve)."""
        out: list[mx.array] = []
        for name, bufs in self.parts.items():
            for buf, p in zip(bufs, PARTS, strict=True):
                out += buf.reserve(arrays.get(f"{name}.{p}"))
        return out

    def destination(
        self, index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None:
        """Where the SSD stream may read a packed part of block ``index`` (see TokenBuffer)."""
        kind, _, part = name.partition(".")
        run = run_shape(shape, count, self.block_size)
        if kind not in self.parts or part not in PARTS or run is None:
            return None
        buf = self.parts[kind][PARTS.index(part)]
        return buf.destination(index * self.block_size, dtype, run)

    def allocate(self) -> list[mx.array]:
        return [a for bufs in self.parts.values() for b in bufs for a in b.allocate()]

    def queue_copies(self, copies: Copies) -> None:
        for bufs in self.parts.values():
            for b in bufs:
                b.queue_copies(copies)

    def buffers(self) -> list[mx.array]:
        out = (b.materialize() for bufs in self.parts.values() for b in bufs)
        return [b for b in out if b is not None]

    def finish(self) -> QuantizedKVCache:
        self.cache.keys = tuple(b.finish() for b in self.parts["keys"])
        self.cache.values = tuple(b.finish() for b in self.parts["values"])
        self.cache.offset = self.num_tokens
        return self.cache
