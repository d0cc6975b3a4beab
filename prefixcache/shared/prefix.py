"""A shared prefix: its K/V held once, read-only, for every sequence that uses it.

Per attention layer, one contiguous K and V buffer (packed for quantized K/V)
holding the prefix's tokens, exactly as long as the prefix: a
:class:`LayerPrefix`. Nothing ever writes into it (each sequence writes its own
suffix), so sequences may hold views of it. Layers that cannot be shared
(recurrent state, chunked attention, ...) keep their state at the prefix's end
as a template each sequence copies (copy-on-write in MLX: free until written).

Who frees it: each sequence holds a :class:`Lease` (its layer caches reference
it); the prefix lives while a lease or a cache references it and is freed with
the last one, by Python's reference counting (or at once by ``release``).
The registry of live prefixes holds weak references only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..hashing import TOKEN_BYTES
from .attention import Quant


@dataclass(frozen=True, slots=True)
class LayerKind:
    """What a shared layer is, with or without a prefix.

    Attributes:
        window: the sliding window (a RotatingKVCache's ``max_size``), or None.
        quant: the K/V packing (a QuantizedKVCache's), or None.
        signature: the layout signature of the mlx-lm cache it replaces (its
            codec's ``layout``), so a shared cache is stored like that cache.
        kv_heads: K/V heads.
    """

    window: int | None
    quant: Quant | None
    signature: tuple[object, ...]
    kv_heads: int


@dataclass(frozen=True, slots=True, eq=False)
class LayerPrefix:
    """One layer's shared prefix K/V: positions ``[start, start + length)``.

    Full attention holds every token from 0; a window layer only the last
    ``window - 1`` before the prefix's end (all a later query can see).
    """

    kind: LayerKind
    # (1, kv_heads, length, k_dim) (in memory (1, kv_heads, k_dim, length), see
    # build.py), or a packed (data, scales, biases) tuple
    keys: Any
    values: Any
    start: int

    def __deepcopy__(self, memo: dict) -> LayerPrefix:
        return self  # read-only: a copied cache shares it

    @property
    def length(self) -> int:
        return _first(self.keys).shape[2]

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in _flat(self.keys) + _flat(self.values))

    def attended(self, end: int) -> tuple[Any, Any]:
        """K/V for the attention of positions ``[start, end)``: full-precision keys
        whole (the scores are cut to the values' length, no strided copy), the rest
        as ``visible``."""
        if self.kind.quant is not None or end == self.end:
            return self.visible(end)
        return self.keys, self.visible(end)[1]

    def visible(self, end: int) -> tuple[Any, Any]:
        """K/V of positions ``[start, end)`` (views when ``end`` < ``self.end``)."""
        if end == self.end:
            return self.keys, self.values
        n = end - self.start
        if not 0 <= n <= self.length:
            raise ValueError(f"prefix holds positions [{self.start}, {self.end}), not up to {end}")
        return _head(self.keys, n), _head(self.values, n)


class Lease:
    """One sequence's hold on a shared prefix (its layer caches share it)."""

    __slots__ = ("__weakref__", "prefix")

    def __init__(self, prefix: SharedPrefix):
        self.prefix = prefix

    def __deepcopy__(self, memo: dict) -> Lease:
        return self  # a copied batch holds the same sequences


class SharedPrefix:
    """A prefix's K/V held once for the sequences sharing it.

    Args:
        root: namespace root key of the PrefixCache (and ``extra``) it came from.
        tokens: the prefix's token ids (uint32 bytes).
        layers: per layer, its LayerPrefix; None for a layer kept private.
        private: per layer, the private layers' caches at the prefix's end
            (templates, never used by a sequence directly); None for shared ones.
    """

    def __init__(
        self,
        root: bytes,
        tokens: bytes,
        layers: list[LayerPrefix | None],
        private: list[Any | None],
    ):
        self.root = root
        self.tokens = tokens
        self.layers = layers
        self.private = private
        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()

    def __deepcopy__(self, memo: dict) -> SharedPrefix:
        return self

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of the shared K/V (held once)."""
        return sum(layer.nbytes for layer in self.layers if layer is not None)

    @property
    def num_users(self) -> int:
        """Sequences holding a lease now."""
        return len(self._leases)

    @property
    def trimmable(self) -> bool:
        """Whether a sequence may start inside the prefix (every layer full attention):
        a window or recurrent layer holds its state at the prefix's end only."""
        return all(p is None or p.kind.window is None for p in self.layers) and not any(
            c is not None for c in self.private
        )

    def lease(self) -> Lease:
        lease = Lease(self)
        self._leases.add(lease)
        return lease


def _first(x: Any) -> mx.array:
    return x[0] if isinstance(x, tuple) else x


def _flat(x: Any) -> list[mx.array]:
    return list(x) if isinstance(x, tuple) else [x]


def _head(x: Any, n: int) -> Any:
    if isinstance(x, tuple):
        return tuple(a[..., :n, :] for a in x)
    return x[..., :n, :]
