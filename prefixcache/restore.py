"""Restore: walk a prompt's block chain and rebuild caches at their final length.

Every layer gets ONE preallocated buffer (cached length plus headroom, rounded
up to mlx-lm's 256-token step) filled block by block by slice assignment, so
there is no growing concatenation and the suffix prefill writes in place.
Blocks are fed block-major and evaluated one at a time. SSD payloads stream
through: the buffers are allocated, unwritten, from the first streamed block's
header (``shapes``; else that block's copy allocates them), and the stream's
reader threads read each tensor straight into the buffer it belongs to
(``place``: one copy from the page cache, no read buffer), so the peak is the
restored cache (plus one block when the first block had to allocate). Tensors
without such a destination come as HostArrays (views of a read buffer):
builders that take them copy the bytes in; the others get MLX arrays of them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .blocks import split_layers
from .codecs import Codec, codec_for
from .errors import LayoutMismatchError, MissReason, Shortfall
from .host import HostArray, Placed


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
    load: Callable[[int], tuple[dict[str, mx.array | HostArray | Placed], bool]],
    prepare: Callable[[list[int], Place], None] | None = None,
    close: Callable[[], None] | None = None,
    shapes: Callable[[list[int]], tuple[int, dict[str, Placed]] | None] | None = None,
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
            (streamed from SSD) are written into the buffers at once; their
            arrays may be HostArrays, valid until the next ``load``.
        prepare: called once with every chain index ``load`` will be asked
            for, in that order, and the ``Place`` function that gives a
            streamed tensor its destination (e.g. to start reading ahead).
        close: stops whatever ``prepare`` started; called before the buffers
            are let go, whether the rebuild succeeds or not (a reader thread
            must never write into a freed buffer).
        shapes: given the load order, the first block that will be streamed
            and its tensors' shapes (``Placed`` without views), or None: its
            layers' buffers are allocated before ``prepare``, so that block
            too is read straight into them.

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
    first = shapes(order) if shapes is not None and order else None
    if first is not None:
        index, specs = first
        # a token axis of one block bounds what an unverified header can allocate
        specs = {n: s for n, s in specs.items() if len(s.shape) == 4 and s.shape[2] == block_size}
        layers = split_layers(specs)
        for i in users[index]:
            _reserve(builders[i], index, layers.get(i, {}))
    try:
        if prepare is not None:
            prepare(order, _placer(builders, users))
        for index in order:
            arrays, resident = load(index)
            layers = split_layers(arrays)
            if not resident:  # allocate every layer's buffer (unwritten) before the copies
                reserve = [_reserve(builders[i], index, layers.get(i, {})) for i in users[index]]
                mx.async_eval(reserve)
            for layer in users[index]:
                builder = builders[layer]
                part = layers.get(layer, {})
                if not getattr(builder, "takes_host", False):
                    part = {n: _to_mx(a) for n, a in part.items()}
                try:
                    builder.add(index, part)
                except (LayoutMismatchError, KeyError) as err:
                    raise Shortfall(index, _reason(err)) from err
            if not resident:
                mx.eval([b.buffers() for b in builders])
    finally:
        if close is not None:
            close()
    caches = [b.finish() for b in builders]
    mx.eval([c.state for c in caches])
    return caches


Place = Callable[[int, str, mx.Dtype, tuple[int, ...]], "list[memoryview] | None"]


def _placer(builders: list[Any], users: dict[int, list[int]]) -> Place:
    """(chain index, flat payload name, dtype, shape) -> where a reader thread may
    write that tensor, or None. Only for layers that use the block, and only once
    their builder's buffer exists (``destination``); runs no MLX."""
    wanted = {index: set(layers) for index, layers in users.items()}

    def place(index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...]):
        head, _, rest = name.partition(".")
        if not head.isdigit() or int(head) not in wanted.get(index, ()):
            return None
        destination = getattr(builders[int(head)], "destination", None)
        return None if destination is None else destination(index, rest, dtype, shape)

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


def _reserve(builder: Any, index: int, arrays: dict[str, Any]) -> list[mx.array]:
    reserve = getattr(builder, "reserve", None)
    return reserve(index, arrays) if reserve is not None else []


def _reason(err: Exception) -> MissReason:
    return getattr(err, "reason", MissReason.LAYOUT_MISMATCH)
