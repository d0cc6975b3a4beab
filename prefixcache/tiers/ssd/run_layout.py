"""The tensors of a run file (``runfiles.py``): K/V joined on the token axis, extras whole.

A tensor every block of the run has alike, K/V named so by its codec and shaped
(B, heads, the block's tokens, dim), is its blocks' tensors one after another on
the token axis; any other tensor of a block (a recurrent layer's state snapshot
at a checkpoint, window K/V only some blocks keep, the K/V of a window no
longer than a block: ``whole``) is an extra, kept whole for that block after
them, named ``"<name>@<block position>"``. A restore uses a short window's K/V
of its last block only: as extras, the other blocks' are neither read nor
hashed (``checked.verify``), where joined they would be hashed with the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ...memory.host import Tensor
from ..writer import WriteItem

EXTRA = "@"  # an extra's name in a run file: "<name>@<block position>"
_KV = frozenset({"keys", "values"})


def joined(name: str, shape: Sequence[int], num_tokens: int, whole: tuple[str, ...] = ()) -> bool:
    """Whether a block's tensor is joined on the token axis in a run file (else it is
    kept whole, per block: an extra): K/V (plain, quantized, a window's), named so by
    its codec, shaped (B, heads, the block's tokens, dim). The name tells: a recurrent
    state may have that shape too (its key dim equal to the block size). ``whole``: the
    payload-name prefixes of layers kept whole (a window no longer than a block)."""
    if name.startswith(whole):
        return False
    return len(shape) == 4 and shape[2] == num_tokens and not _KV.isdisjoint(name.split("."))


def extra_name(name: str, position: int) -> str:
    """The run file's name of block ``position``'s extra tensor ``name``."""
    return f"{name}{EXTRA}{position}"


def split_extra(name: str) -> tuple[str, int] | None:
    """(tensor name, block position) of an extra's name in a run file, or None."""
    base, sep, pos = name.rpartition(EXTRA)
    return (base, int(pos)) if sep and pos.isdigit() else None


def _common(items: Sequence[WriteItem], whole: tuple[str, ...] = ()) -> list[str]:
    """Names of the tensors joined on the token axis: those every block has alike
    (in the first block's order)."""
    n = items[0].block.num_tokens
    alike = set.intersection(
        *(
            {(t.name, t.dtype, t.shape) for t in it.tensors if joined(t.name, t.shape, n, whole)}
            for it in items
        )
    )
    return [t.name for t in items[0].tensors if (t.name, t.dtype, t.shape) in alike]


def tensors(items: Sequence[WriteItem], whole: tuple[str, ...] = ()) -> list[Tensor]:
    """The run file's tensors: each name every block has alike on the token axis, its
    blocks' tensors joined on that axis; then each block's other tensors (a recurrent
    state's snapshot, window K/V some blocks keep) whole, named ``extra_name``."""
    names = _common(items, whole)
    by_name = [{t.name: t for t in it.tensors} for it in items]
    out = []
    for name in names:
        first = by_name[0][name]
        b, h, n, d = first.shape
        pieces = [np.frombuffer(m[name].data, np.uint8).reshape(b, h, n, -1) for m in by_name]
        data = np.concatenate(pieces, axis=2)
        shape = (b, h, n * len(items), d)
        out.append(Tensor(name, first.dtype, shape, memoryview(data).cast("B")))
    keep = set(names)
    for j, it in enumerate(items):
        out += [
            dataclasses.replace(t, name=extra_name(t.name, j))
            for t in it.tensors
            if t.name not in keep
        ]
    return out


def layout(items: Sequence[WriteItem], whole: tuple[str, ...] = ()) -> list[Tensor]:
    """The run file's tensors as ``tensors`` gives them, without their data (for a
    header that bounds the file's)."""
    names, none, k = _common(items, whole), memoryview(b""), len(items)
    first = {t.name: t for t in items[0].tensors}
    out = []
    for name in names:
        b, h, n, d = first[name].shape
        out.append(Tensor(name, first[name].dtype, (b, h, n * k, d), none))
    keep = set(names)
    for j, it in enumerate(items):
        out += [
            Tensor(extra_name(t.name, j), t.dtype, t.shape, none)
            for t in it.tensors
            if t.name not in keep
        ]
    return out
