"""Restore: walk a prompt's block chain and rebuild caches at their final length.

Every layer gets ONE preallocated buffer (cached length plus headroom, rounded
up to mlx-lm's 256-token step) filled block by block by slice assignment, so
there is no growing concatenation and the suffix prefill writes in place.
Blocks are fed block-major and evaluated one at a time: SSD payloads stream
through and the peak is the restored cache plus one block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .blocks import split_layers
from .codecs import Codec, LayoutMismatchError
from .stats import MissReason


class ChainEntry(Protocol):
    """What the walk needs of a stored block (a hot Block or an SSD BlockMeta)."""

    parent: bytes
    index: int
    tokens: bytes


@dataclass(frozen=True, slots=True)
class Walk:
    """Result of walking a prompt's keys through the tiers."""

    depth: int  # blocks matched, root-first
    reason: MissReason | None  # why block ``depth`` did not match, if any


class Shortfall(Exception):
    """A block needed by the rebuild could not be used; restore fewer blocks."""

    def __init__(self, index: int, reason: MissReason):
        super().__init__(index, reason)
        self.index = index
        self.reason = reason


def walk(
    keys: Sequence[bytes],
    root: bytes,
    data: bytes,
    block_size: int,
    lookup: Callable[[bytes], ChainEntry | None],
    missing_reason: Callable[[bytes], MissReason],
) -> Walk:
    """Match ``keys`` root-first, checking parent links and stored token ids."""
    step = block_size * 4
    parent = root
    for i, key in enumerate(keys):
        entry = lookup(key)
        if entry is None:
            return Walk(i, missing_reason(key))
        tokens = data[i * step : (i + 1) * step]
        if entry.parent != parent or entry.index != i or entry.tokens != tokens:
            return Walk(i, MissReason.TOKEN_MISMATCH)
        parent = key
    return Walk(len(keys), None)


def rebuild(
    fresh: list[Any],
    codecs: Sequence[Codec],
    *,
    num_blocks: int,
    num_tokens: int,
    capacity: int,
    block_size: int,
    load: Callable[[int], tuple[dict[str, mx.array], bool]],
) -> list[Any]:
    """Fill every layer of ``fresh`` from ``num_blocks`` chain blocks.

    Args:
        fresh: empty caches from make_prompt_cache (quantized where due).
        codecs: the codec of each layer.
        num_blocks: blocks of the chain to restore.
        num_tokens: tokens the caches will hold (<= num_blocks * block_size).
        capacity: buffer length in tokens.
        block_size: tokens per block.
        load: chain index -> (the block's flat payload, whether it stays in
            memory anyway); raises Shortfall. Blocks that do not stay
            (streamed from SSD) are written into the buffers at once.

    Raises:
        Shortfall: a block (or a layer's part of it) is unusable.
    """
    builders = [
        codec.builder(cache, num_tokens, capacity, block_size)
        for codec, cache in zip(codecs, fresh, strict=True)
    ]
    users: dict[int, list[int]] = {}
    for layer, (codec, cache) in enumerate(zip(codecs, fresh, strict=True)):
        for index in codec.blocks_needed(cache, num_blocks, block_size):
            users.setdefault(index, []).append(layer)
    for index in sorted(users):
        arrays, resident = load(index)
        layers = split_layers(arrays)
        for layer in users[index]:
            try:
                builders[layer].add(index, layers.get(layer, {}))
            except (LayoutMismatchError, KeyError) as err:
                raise Shortfall(index, _reason(err)) from err
        if not resident:
            mx.eval([b.buffers() for b in builders])
    caches = [b.finish() for b in builders]
    mx.eval([c.state for c in caches])
    return caches


def _reason(err: Exception) -> MissReason:
    return getattr(err, "reason", MissReason.LAYOUT_MISMATCH)
