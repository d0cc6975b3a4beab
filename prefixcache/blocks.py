"""Block: one full block of tokens and its cache payload, as the tiers hold it."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Block:
    """One cached block.

    Attributes:
        key: 16-byte chain key of this block (see hashing.py).
        parent: key of the previous block, or the namespace root key.
        root: namespace root key (which model / layout the block belongs to).
        index: position in the chain; the block holds tokens
            ``[index * block_size, (index + 1) * block_size)``.
        tokens: the block's token ids as little-endian uint32 bytes; compared
            on every hit (collision guard).
        arrays: flat payload ``"{layer}.{name}" -> mx.array``; each array is
            contiguous and owned by the block (never a view of a live cache).
    """

    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes
    arrays: dict[str, mx.array] = field(repr=False)
    nbytes: int = 0

    @classmethod
    def make(
        cls,
        key: bytes,
        parent: bytes,
        root: bytes,
        index: int,
        tokens: bytes,
        arrays: dict[str, mx.array],
    ) -> Block:
        nbytes = sum(a.nbytes for a in arrays.values())
        return cls(key, parent, root, index, tokens, arrays, nbytes)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<u4")

    def layer_arrays(self, layer: int) -> dict[str, mx.array]:
        """The payload of one layer, with the ``"{layer}."`` prefix removed."""
        return split_layers(self.arrays).get(layer, {})


def split_layers(arrays: dict[str, mx.array]) -> dict[int, dict[str, mx.array]]:
    """Group a flat ``"{layer}.{name}"`` payload by layer in one pass."""
    out: dict[int, dict[str, mx.array]] = {}
    for name, arr in arrays.items():
        layer, _, rest = name.partition(".")
        out.setdefault(int(layer), {})[rest] = arr
    return out


def join_layers(layers: list[dict[str, mx.array]]) -> dict[str, mx.array]:
    """Flatten per-layer payloads into one ``"{layer}.{name}"`` dict."""
    return {f"{i}.{name}": arr for i, layer in enumerate(layers) for name, arr in layer.items()}
