"""Capture: cut a live cache into blocks (pure: no tier, no policy).

Sliding-window and chunked K/V and recurrent state cannot be cut out of a
finished cache: the window has moved on, and the state is the state at its
end only. So what a later restore needs of them is cut where the cache stands:
at checkpoints while prefilling (``PrefixCache.checkpoints``), and at the end
of a finished sequence. Every cut keeps the state at the cache's exact end.
The blocks go straight to the caller (the facade's ``store``), so no snapshot
is held here.

A block stored earlier may lack some layers' payloads (cut from a finished
cache after its window moved on, or at a boundary without a snapshot). A later
capture that holds them upgrades it: the hot block is replaced by one with the
union of both payloads (``TierStack.replace``).

The tail of a cut (its last tokens after the last full block) is cut as a
tail block (``cut_tail``): a child of that last full block, outside the
chain, carrying every layer's payload at the exact end (the recurrent state
there included). A block that ends exactly there keeps its snapshot too,
whatever the interval: the next turn of a conversation, or the next prompt
branching there, resumes from it. Window and chunk K/V are kept only in
blocks within the window of those same restore points (``WindowPolicy``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..blocks import Block, join_layers
from ..codecs import Codec, codec_for
from ..hashing import TOKEN_BYTES, tail_key
from ..memory.runs import pack, run_blocks
from .points import RestorePoints
from .window import WindowPolicy

DEFAULT_STEP = 2048  # mlx-lm's generate_step default prefill_step_size


@dataclass(frozen=True, slots=True)
class Cut:
    """Blocks cut from a live cache: new ones, and fuller versions of hot ones."""

    new: list[Block]
    upgraded: list[Block]
    tail: Block | None = None


def chunk_ends(start: int, stop: int, step: int) -> list[int]:
    """Ends of the prefill chunks of tokens ``[start, stop)``: multiples of ``step``, then stop.

    Chunks end on absolute multiples of ``step``, so a prompt restored at any
    block boundary is chunked as a cold run of it would be from there on.
    """
    if start >= stop:
        return []
    return [*range((start // step + 1) * step, stop, step), stop]


def chunk_step(prefill_step_size: int | None, block_size: int) -> int:
    """The prefill chunk: a multiple of ``block_size`` (about mlx-lm's 2048 tokens
    by default), so chunk ends fall on block boundaries.

    Raises:
        ValueError: ``prefill_step_size`` is not a positive multiple of ``block_size``.
    """
    if prefill_step_size is None:
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
    points: RestorePoints,
    stored: Callable[[bytes], bool],
    resident: Callable[[bytes], Block | None],
    window: WindowPolicy | None = None,
    tenant: str = "",
    runs: tuple[int, int] = (0, 0),
) -> Cut:
    """Cut the blocks of ``keys`` that no tier holds, and upgrades of hot ones.

    Args:
        keys, root: chain keys of the full blocks of ``data``; the namespace root key.
        data, cache: the tokens (uint32 bytes) and the live cache list holding them.
        block_size: tokens per block.
        points, window: the restore points; which blocks keep window K/V.
        stored, resident: whether a key is held by any tier; its hot block or None.
        tenant: who the new blocks are charged to (tenant shares; an upgrade keeps
            its block's owner).
        runs: (tokens, bytes): new consecutive blocks cut as runs of at most these
            where every codec ``cuts_runs`` (memory/runs.py); 0: none.
    """
    length = len(data) // TOKEN_BYTES
    codecs = [codec_for(c) for c in cache]
    reaches = [codec.reach(c, length) for codec, c in zip(codecs, cache, strict=True)]
    reach, last = min(reaches), partial_layers(reaches, length)
    new, upgraded = [], []
    for i in range(len(keys)):
        old = resident(keys[i]) if i >= reach // block_size else None
        if old is None and stored(keys[i]):
            continue
        arrays = _block(codecs, cache, i, block_size, length, points, window, last)
        if old is None:
            tokens = data[i * block_size * TOKEN_BYTES : (i + 1) * block_size * TOKEN_BYTES]
            parent = keys[i - 1] if i else root
            new.append(Block.make(keys[i], parent, root, i, tokens, arrays, tenant))
            continue
        if fuller := _upgrade(old, arrays, i):
            upgraded.append(fuller)
    new = _runs(new, codecs, cache, block_size, length, runs)
    # a hot tail is held; one held only below is cut again (its put is a no-op)
    tail = cut_tail(keys, root, data, cache, block_size=block_size, stored=resident, tenant=tenant)
    # evaluates only what is kept (one eval): the cuts of complete blocks are never computed
    mx.eval([b.arrays for b in new], [b.arrays for b in upgraded], tail and tail.arrays)
    return Cut(new, upgraded, tail)


def cut_tail(
    keys: Sequence[bytes],
    root: bytes,
    data: bytes,
    cache: Sequence[Any],
    *,
    block_size: int,
    stored: Callable[[bytes], object],
    tenant: str = "",
) -> Block | None:
    """The tail block of ``data`` (the tokens after its last full block), or None;
    its arrays are not evaluated.

    Args:
        keys: chain keys of the full blocks of ``data``.
        root: namespace root key.
        data: the tokens the cache holds, as uint32 bytes.
        cache: the live cache list (holding ``len(data) // TOKEN_BYTES`` tokens).
        block_size: tokens per block.
        stored: whether (truthy) a tail key is held already (then None is returned).
        tenant: who the tail is charged to (tenant shares).
    """
    length = len(data) // TOKEN_BYTES
    index = length // block_size
    start = index * block_size
    if start == length:
        return None
    parent = keys[index - 1] if index else root
    tail = data[start * TOKEN_BYTES :]
    key = tail_key(parent, tail)
    if stored(key):
        return None
    codecs = [codec_for(c) for c in cache]
    reaches = [codec.reach(c, length) for codec, c in zip(codecs, cache, strict=True)]
    arrays = _cut(codecs, cache, start, length, length, True, partial_layers(reaches, length))
    return Block.make(key, parent, root, index, tail, arrays, tenant)


def _upgrade(old: Block, arrays: dict[str, mx.array], index: int) -> Block | None:
    """``old`` with the payloads of ``arrays`` it lacks, or None if it lacks none."""
    gained = _gained(old.arrays, arrays)
    if not gained:
        return None
    merged = {**old.arrays, **gained}  # views of a run stay its run's (charged by it)
    return Block.make(old.key, old.parent, old.root, index, old.tokens, merged, old.tenant, old.run)


def _runs(
    new: list[Block],
    codecs: list[Codec],
    cache: Sequence[Any],
    block_size: int,
    length: int,
    runs: tuple[int, int],
) -> list[Block]:
    """``new`` with its consecutive blocks cut as runs (memory/runs.py) of at most
    ``runs`` (tokens, bytes): the payloads of the layers whose codec ``cuts_runs``
    (the others' stay each block's own)."""
    num = run_blocks(new, *runs)
    layers = [i for i, codec in enumerate(codecs) if codec.cuts_runs]
    if num < 2 or not layers:
        return new

    def cut_run(start: int, end: int) -> dict[str, mx.array]:
        cuts = {i: codecs[i].cut(cache[i], start, end, length=length) for i in layers}
        return {f"{i}.{name}": arr for i, cut in cuts.items() for name, arr in cut.items()}

    return pack(new, cut_run, block_size, num)


def _gained(old: dict[str, mx.array], new: dict[str, mx.array]) -> dict[str, mx.array]:
    """Payloads of ``new`` that ``old`` lacks; a window's partial payloads (``keep.*``,
    ``last.*``) add nothing to a layer that holds the whole block (``keys``)."""
    out = {}
    for name, arr in new.items():
        if name in old:
            continue
        for part in ("last.", "keep."):
            head, sep, _ = name.partition(part)
            if sep and head + "keys" in old:
                break
        else:
            out[name] = arr
    return out


def _block(
    codecs: list[Codec],
    cache: Sequence[Any],
    i: int,
    block_size: int,
    length: int,
    points: RestorePoints,
    window: WindowPolicy | None,
    last: frozenset[int],
) -> dict[str, mx.array]:
    """Block ``i``'s payload: recurrent state at a restore point and where the cache
    ends (``length``); window K/V where ``window`` keeps it; layers ``last`` last."""
    snapshot = points.at(i + 1) or (i + 1) * block_size == length
    arrays = _cut(codecs, cache, i * block_size, (i + 1) * block_size, length, snapshot, last)
    if window is not None and not window.keeps(i, length):
        arrays = window.strip(arrays)  # never evaluated: costs nothing
    return arrays


def partial_layers(reaches: Sequence[int], length: int) -> frozenset[int]:
    """The layers whose payloads only some blocks keep (window K/V, recurrent state:
    their ``reach`` is short of ``length``): a restore skips them in most blocks."""
    return frozenset(i for i, r in enumerate(reaches) if r < length)


def _cut(
    codecs: list[Codec],
    cache: Sequence[Any],
    start: int,
    end: int,
    length: int,
    snapshot: bool,
    last: frozenset[int] = frozenset(),
) -> dict[str, mx.array]:
    """The layers' cuts as one flat payload: the layers ``last`` after the others, so
    a payload file ends with what a restore through it mostly skips (one read takes
    the rest: tiers/ssd/loads.py)."""
    layers = [
        codec.cut(c, start, end, length=length, snapshot=snapshot)
        for codec, c in zip(codecs, cache, strict=True)
    ]
    if not last:
        return join_layers(layers)
    order = [i for i in range(len(layers)) if i not in last] + sorted(last)
    return {f"{i}.{name}": arr for i in order for name, arr in layers[i].items()}
