"""The codec contract: how one cache class is cut into blocks and rebuilt.

A codec handles one layer's cache object. The manager cuts every new full
block of a finished (or in-progress) cache with ``cut`` and, on a hit, rebuilds
a fresh layer cache with a ``Builder`` fed block by block (hot blocks or SSD
payloads streamed one at a time), in chain order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx

STEP = 256  # mlx-lm's KV buffer growth step


def round_up(n: int, step: int = STEP) -> int:
    return -(-n // step) * step


class UnsupportedCacheError(TypeError):
    """A cache type has no registered codec."""


class LayoutMismatchError(ValueError):
    """A cache does not match the layout the PrefixCache was built for."""


class Builder(ABC):
    """Rebuilds one layer cache from block payloads fed in chain order."""

    @abstractmethod
    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        """Copy block ``index``'s payload for this layer into the cache."""

    @abstractmethod
    def buffers(self) -> list[mx.array]:
        """Arrays to evaluate after each block, so blocks stream through."""

    @abstractmethod
    def finish(self) -> Any:
        """Return the rebuilt layer cache."""


class Codec(ABC):
    """Cuts one cache class into block payloads and rebuilds it.

    Attributes:
        cache_type: the mlx-lm (or third-party) cache class handled.
    """

    cache_type: ClassVar[type]

    @abstractmethod
    def layout(self, cache: Any) -> tuple[object, ...]:
        """Layer signature for the namespace, from a cache holding >= 1 token."""

    def check(self, cache: Any, expected: tuple[object, ...]) -> None:
        """Raise LayoutMismatchError if ``cache`` does not fit ``expected``."""
        got = self.layout(cache)
        if got != expected:
            raise LayoutMismatchError(f"cache layer layout {got} != expected {expected}")

    @abstractmethod
    def length(self, cache: Any) -> int | None:
        """Tokens the cache holds, or None when the cache does not track it."""

    def trimmable_at(self, fresh: Any, num_tokens: int) -> bool:
        """Whether a cache rebuilt to hold ``num_tokens`` can be trimmed by a token.

        A fully cached prompt is restored one token short (by trimming) when
        every layer allows it; else one block short.
        """
        return bool(fresh.is_trimmable())

    @abstractmethod
    def cut(self, cache: Any, start: int, end: int) -> dict[str, mx.array]:
        """Payload of tokens ``[start, end)`` as new contiguous arrays (not evaluated).

        Return an empty dict when the cache no longer holds what the block needs.
        """

    def blocks_needed(self, fresh: Any, num_blocks: int, block_size: int) -> Sequence[int]:
        """Chain indices whose payload this layer needs to rebuild ``num_blocks`` blocks."""
        return range(num_blocks)

    @abstractmethod
    def builder(self, fresh: Any, num_tokens: int, capacity: int, block_size: int) -> Builder:
        """A builder filling ``fresh`` (an empty cache from make_prompt_cache).

        Args:
            fresh: empty layer cache of the right class and settings.
            num_tokens: tokens the rebuilt cache will hold.
            capacity: buffer length in tokens (>= num_tokens, a multiple of 256).
            block_size: tokens per block.
        """
