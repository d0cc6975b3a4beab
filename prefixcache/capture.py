"""Capture: cut a live cache into blocks as it fills, and block-aligned prefill.

Sliding-window K/V and recurrent state cannot be cut out of a finished cache:
the window has moved on, and the state is the state at its end only. So blocks
are cut while prefilling, after every chunk, with chunks ending on block
boundaries: every block the chunk completed is still in its window, and the
state at the chunk's end is the state at a block boundary. Blocks go straight
into the tiers, so no boundary snapshot is held anywhere else.

A block stored earlier may lack some layers' payloads (cut from a finished
cache after its window moved on, or at a boundary without a snapshot). A later
capture that holds them upgrades it: the hot block is replaced by one with the
union of both payloads (see ``Tiers.replace``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache

from .blocks import Block, join_layers
from .codecs import Codec, codec_for
from .hashing import chain_keys, token_bytes

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .cache import PrefixCache


DEFAULT_STEP = 2048  # mlx-lm's generate_step default prefill_step_size


@dataclass(frozen=True, slots=True)
class Cut:
    """Blocks cut from a live cache: new ones, and fuller versions of hot ones."""

    new: list[Block]
    upgraded: list[Block]


def chunk_ends(start: int, stop: int, step: int) -> list[int]:
    """Ends of the prefill chunks of tokens ``[start, stop)``: multiples of ``step``, then stop.

    Chunks end on absolute multiples of ``step``, so a prompt restored at any
    block boundary is chunked as a cold run of it would be from there on.
    """
    if start >= stop:
        return []
    return [*range((start // step + 1) * step, stop, step), stop]


def chunk_step(
    prefill_step_size: int | None, block_size: int, snapshot_interval: int, snapshots: bool
) -> int:
    """The prefill chunk: a multiple of ``block_size``.

    By default a model with recurrent layers is prefilled one snapshot interval
    at a time (a snapshot can only be taken at a chunk's end); others in
    chunks of about mlx-lm's 2048 tokens.

    Raises:
        ValueError: ``prefill_step_size`` is not a positive multiple of ``block_size``.
    """
    if prefill_step_size is None:
        if snapshots:
            return block_size * snapshot_interval
        return max(block_size, DEFAULT_STEP // block_size * block_size)
    if prefill_step_size < 1 or prefill_step_size % block_size:
        raise ValueError(
            f"prefill_step_size must be a positive multiple of block_size={block_size}, "
            f"got {prefill_step_size}"
        )
    return prefill_step_size


def cut_blocks(
    keys: Sequence[bytes],
    root: bytes,
    data: bytes,
    cache: Sequence[Any],
    *,
    block_size: int,
    snapshot_interval: int,
    first: int,
    stored: Callable[[bytes], bool],
    resident: Callable[[bytes], Block | None],
) -> Cut:
    """Cut the blocks ``keys[first:]`` that no tier holds, and upgrades of hot ones.

    Args:
        keys: chain keys of the full blocks of ``data``.
        root: namespace root key.
        data: the tokens the cache holds, as uint32 bytes.
        cache: the live cache list (holding ``len(data) // 4`` tokens).
        block_size: tokens per block.
        snapshot_interval: recurrent state is kept at every n-th boundary.
        first: first chain index to consider (earlier blocks were handled).
        stored: whether a key is held by any tier.
        resident: the hot block of a key, or None.
    """
    length = len(data) // 4
    codecs = [codec_for(c) for c in cache]
    reach = min((codec.reach(c, length) for codec, c in zip(codecs, cache, strict=True)))
    new: list[Block] = []
    upgraded: list[Block] = []
    for i in range(first, len(keys)):
        old = resident(keys[i]) if i >= reach // block_size else None
        if old is None and stored(keys[i]):
            continue
        snapshot = (i + 1) % snapshot_interval == 0
        arrays = _cut(codecs, cache, i * block_size, (i + 1) * block_size, length, snapshot)
        if old is None:
            tokens = data[i * block_size * 4 : (i + 1) * block_size * 4]
            parent = keys[i - 1] if i else root
            new.append(Block.make(keys[i], parent, root, i, tokens, arrays))
            continue
        gained = {name: a for name, a in arrays.items() if name not in old.arrays}
        if gained:
            merged = {**old.arrays, **gained}
            upgraded.append(Block.make(old.key, old.parent, old.root, i, old.tokens, merged))
    # evaluates only what is kept: the cuts of complete blocks are never computed
    mx.eval([b.arrays for b in new], [b.arrays for b in upgraded])
    return Cut(new, upgraded)


def _cut(
    codecs: list[Codec], cache: Sequence[Any], start: int, end: int, length: int, snapshot: bool
) -> dict[str, mx.array]:
    layers = [
        codec.cut(c, start, end, length=length, snapshot=snapshot)
        for codec, c in zip(codecs, cache, strict=True)
    ]
    return join_layers(layers)


def store_blocks(
    pc: PrefixCache,
    data: bytes,
    cache: Sequence[Any],
    root: bytes,
    *,
    keys: Sequence[bytes] | None = None,
    first: int = 0,
) -> int:
    """Cut and keep what ``cache`` adds to the tiers; the caller holds ``pc``'s lock.

    Returns:
        The number of new blocks.
    """
    bs = pc.config.block_size
    keys = chain_keys(root, data, bs) if keys is None else keys[: len(data) // 4 // bs]
    ssd = pc.ssd
    cut = cut_blocks(
        keys,
        root,
        data,
        cache,
        block_size=bs,
        snapshot_interval=pc.config.snapshot_interval,
        first=first,
        stored=lambda k: k in pc.hot or (ssd is not None and ssd.contains(k)),
        resident=pc.hot.get,
    )
    pc.tiers.keep(cut.new)
    pc.tiers.replace(cut.upgraded)
    return len(cut.new)


def prefill(
    pc: PrefixCache,
    tokens: Sequence[int],
    *,
    prefill_step_size: int | None = None,
    extra: Mapping[str, str] | None = None,
) -> tuple[list[Any], mx.array]:
    """Fetch the cached prefix, prefill the rest block-aligned, capturing every chunk.

    After each chunk mlx-lm's KV quantization schedule is applied (as
    ``generate_step`` does), the cache is evaluated and the blocks it completed
    are stored (window K/V while still in the window, recurrent state at the
    chunk's end boundary).

    Returns:
        (the cache holding all of ``tokens``, the last token's logits (1, vocab))
    """
    data = token_bytes(tokens)
    cfg = pc.config
    cache, start = pc.fetch(tokens, extra=extra)
    snapshots = any(codec_for(c).snapshots(c) for c in cache)
    step = chunk_step(prefill_step_size, cfg.block_size, cfg.snapshot_interval, snapshots)
    with pc._lock:
        root = pc._root(extra)
    keys = chain_keys(root, data, cfg.block_size)
    ids = mx.array(np.frombuffer(data, dtype="<u4").astype(np.int32))
    logits = None
    for end in chunk_ends(start, len(data) // 4, step):
        out = pc.model(ids[None, start:end], cache=cache)
        maybe_quantize_kv_cache(cache, cfg.quantized_kv_start, cfg.kv_group_size, cfg.kv_bits)
        if end * 4 == len(data):
            logits = mx.array(out[:, -1, :])  # a copy: the chunk's logits are let go
        # only the cache (and the last logits) are computed, as in generate_step
        mx.eval(logits, [c.state for c in cache])
        del out
        with pc._lock:
            pc._check_open()
            store_blocks(pc, data[: end * 4], cache, root, keys=keys, first=start // cfg.block_size)
        start = end
    return cache, logits
