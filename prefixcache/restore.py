"""Restore: walk a prompt's block chain and rebuild caches at their final length.

Every layer gets ONE preallocated buffer (cached length plus headroom, rounded
up to mlx-lm's 256-token step) filled block by block by slice assignment, so
there is no growing concatenation and the suffix prefill writes in place.
Blocks are fed block-major and evaluated one at a time. SSD payloads stream
through: the buffers are allocated, unwritten, from the first streamed block's
header (``Loader.first_shapes``; else that block's copy allocates them), and the stream's
reader threads read each tensor straight into the buffer it belongs to
(``place``: one copy from the page cache, no read buffer), so the peak is the
restored cache (plus one block when the first block had to allocate). Tensors
without such a destination come as HostArrays (views of a read buffer):
builders that take them copy the bytes in; the others get MLX arrays of them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .blocks import split_layers
from .codecs import Builder, Codec, codec_for
from .errors import LayoutMismatchError, MissReason, Shortfall
from .host import HostArray, Place, Placed
from .tiers.base import ChainEntry


class Loader(Protocol):
    """Loads the blocks of one restore (tiers.stack.ChainLoad): the one loader contract."""

    def first_shapes(self, order: list[int]) -> tuple[int, Mapping[str, Placed]] | None:
        """The first block of ``order`` to be streamed, with its tensors' dtypes and
        shapes, so its layers' buffers exist before anything is read; or None."""

    def prepare(self, order: list[int], place: Place | None) -> None:
        """Start loading the blocks of ``order``; ``place`` gives a streamed tensor
        its destination in the restore buffers."""

    def load(self, index: int) -> tuple[Mapping[str, Any], bool]:
        """(block ``index``'s flat payload, whether it stays in memory anyway);
        raises Shortfall. Streamed arrays are valid until the next ``load``."""

    def close(self) -> None:
        """Stop whatever ``prepare`` started; nothing writes into the buffers after."""


@dataclass(frozen=True, slots=True)
class Walk:
    """Result of walking a prompt's keys through the tiers."""

    depth: int  # blocks matched, root-first
    reason: MissReason | None  # why block ``depth`` did not match, if any


def walk(entries: Sequence[ChainEntry], root: bytes, data: bytes, block_size: int) -> Walk:
    """How many of ``entries`` (held by the tiers, root-first) match the prompt
    ``data``: parent links, positions and stored token ids are checked."""
    step = block_size * 4
    parent = root
    depth = len(entries)
    for i, entry in enumerate(entries):
        if entry.parent != parent or entry.index != i:
            depth = i
            break
        parent = entry.key
    # the tokens in one comparison (a join is cheaper than a slice per block)
    if b"".join([e.tokens for e in entries[:depth]]) != data[: depth * step]:
        depth = next(
            i for i, e in enumerate(entries) if e.tokens != data[i * step : (i + 1) * step]
        )
    return Walk(depth, None if depth == len(entries) else MissReason.TOKEN_MISMATCH)


def rebuild(
    fresh: list[Any],
    codecs: Sequence[Codec],
    loader: Loader,
    *,
    num_blocks: int,
    num_tokens: int,
    capacity: int,
    block_size: int,
) -> list[Any]:
    """Fill every layer of ``fresh`` from ``num_blocks`` chain blocks.

    Args:
        fresh: empty caches from make_prompt_cache (quantized where due).
        codecs: the codec of each layer.
        loader: loads the chain's blocks (see :class:`Loader`); closed before
            the buffers are let go, whether the rebuild succeeds or not.
        num_blocks: blocks of the chain to restore.
        num_tokens: tokens the caches will hold (<= num_blocks * block_size).
        capacity: buffer length in tokens.
        block_size: tokens per block.

    Raises:
        Shortfall: a block (or a layer's part of it) is unusable.
    """
    builders = [
        codec.builder(cache, num_tokens, capacity, block_size)
        for codec, cache in zip(codecs, fresh, strict=True)
    ]
    users: dict[int, list[int]] = {}
    for layer, (codec, cache) in enumerate(zip(codecs, fresh, strict=True)):
        for index in codec.blocks_needed(cache, num_tokens, block_size):
            users.setdefault(index, []).append(layer)
    if users and max(users) >= num_blocks:
        raise ValueError(f"{num_tokens} tokens need block {max(users)}; restoring {num_blocks}")
    order = sorted(users)
    try:
        _reserve_first(builders, users, loader.first_shapes(order) if order else None, block_size)
        loader.prepare(order, _placer(builders, users))
        for index in order:
            _add_block(builders, users, index, *loader.load(index))
    finally:
        loader.close()
    caches = [b.finish() for b in builders]
    mx.eval([c.state for c in caches])
    return caches


def _reserve_first(
    builders: list[Builder],
    users: dict[int, list[int]],
    first: tuple[int, Mapping[str, Placed]] | None,
    block_size: int,
) -> None:
    """Allocate the buffers of the first streamed block's layers from its header."""
    if first is None:
        return
    index, specs = first
    # a token axis of one block bounds what an unverified header can allocate
    specs = {n: s for n, s in specs.items() if len(s.shape) == 4 and s.shape[2] == block_size}
    layers = split_layers(specs)
    for i in users[index]:
        builders[i].reserve(index, layers.get(i, {}))


def _add_block(
    builders: list[Builder],
    users: dict[int, list[int]],
    index: int,
    arrays: Mapping[str, Any],
    resident: bool,
) -> None:
    """Hand block ``index``'s payload to the builders of the layers that use it."""
    layers = split_layers(arrays)
    if not resident:  # allocate every layer's buffer (unwritten) before the copies
        mx.async_eval([builders[i].reserve(index, layers.get(i, {})) for i in users[index]])
    for layer in users[index]:
        builder = builders[layer]
        part = layers.get(layer, {})
        if not builder.takes_host:
            part = {n: _to_mx(a) for n, a in part.items()}
        try:
            builder.add(index, part)
        except (LayoutMismatchError, KeyError) as err:
            raise Shortfall(index, _reason(err)) from err
    if not resident:
        mx.eval([b.buffers() for b in builders])


def _placer(builders: list[Builder], users: dict[int, list[int]]) -> Place:
    """(chain index, flat payload name, dtype, shape) -> where a reader thread may
    write that tensor, or None. Only for layers that use the block, and only once
    their builder's buffer exists (``destination``); runs no MLX."""
    wanted = {index: set(layers) for index, layers in users.items()}

    def place(index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...]):
        head, _, rest = name.partition(".")
        if not head.isdigit() or int(head) not in wanted.get(index, ()):
            return None
        return builders[int(head)].destination(index, rest, dtype, shape)

    return place


def _to_mx(a: Any) -> Any:
    return a.to_mx() if isinstance(a, HostArray | Placed) else a


def plan(
    depth: int,
    *,
    usable: Callable[[int], tuple[int, int]],
    fresh: Callable[[int], list[Any]],
    payload: Callable[[int], Container[str] | None],
    block_size: int,
) -> tuple[int, int, MissReason | None]:
    """The deepest restorable prefix of at most ``depth`` blocks, from metadata only.

    A window, chunk or recurrent layer may lack its payload in some blocks
    (cut after the window moved on, no snapshot at that boundary); this finds
    where every layer has what it needs before anything is copied.

    Args:
        depth: blocks matched by the walk.
        usable: blocks -> (blocks to restore, tokens cached), as the manager
            leaves at least one token to prefill.
        fresh: tokens cached -> empty caches for them (quantized where due).
        payload: chain index -> the block's flat payload names, or None when
            unknown (the rebuild then checks, and may still fall short).
        block_size: tokens per block.

    Returns:
        (blocks to restore, tokens cached, why fewer than ``depth`` or None)
    """
    reason = None
    while depth > 0:
        num_blocks, num_tokens = usable(depth)
        if num_blocks <= 0:
            break
        gap = first_gap(fresh(num_tokens), num_tokens, block_size, payload)
        if gap is None:
            return num_blocks, num_tokens, reason
        # every codec's needs are suffix-closed: no depth between gap and depth works
        depth, why = gap
        reason = reason or why
    return 0, 0, reason


def first_gap(
    caches: list[Any],
    num_tokens: int,
    block_size: int,
    payload: Callable[[int], Container[str] | None],
) -> tuple[int, MissReason] | None:
    """A needed block whose payload cannot serve a layer, with the reason; None if all can."""
    layers = []
    for layer, cache in enumerate(caches):
        codec = codec_for(cache)
        if type(codec).covers is Codec.covers:
            continue  # trusts every block: its payload is always cut
        layers.append((layer, codec, cache, codec.blocks_needed(cache, num_tokens, block_size)))
    layers.sort(key=lambda t: len(t[3]))  # windows and snapshots first: they fail fast
    for layer, codec, cache, needed in layers:
        prefix = f"{layer}."
        for index in reversed(needed):
            names = payload(index)
            if names is None:
                continue
            why = codec.covers(
                cache,
                index,
                num_tokens,
                block_size,
                lambda n, p=prefix, names=names: p + n in names,
            )
            if why is not None:
                return index, why
    return None


def _reason(err: Exception) -> MissReason:
    return err.reason if isinstance(err, LayoutMismatchError) else MissReason.LAYOUT_MISMATCH
