"""The order a writer batch's payload files are reserved in: newest first, as LRU.

A batch may be larger than ``ssd_max_bytes`` (the writer lingers while blocks
keep coming); reservations are made in this order, so what the budget refuses
is the older blocks', never a block whose parent it refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from ..writer import WriteItem


class _File(Protocol):
    items: list[WriteItem]


F = TypeVar("F", bound=_File)


def newest_first(files: list[F], items: Sequence[WriteItem]) -> list[F]:
    """``files`` by tree of blocks (a root and what the batch holds under it), the tree
    whose latest block came last in the batch first; within a tree in their order
    (a parent's file before its children's). A batch over the budget then keeps its
    newest blocks, as LRU would, and never a block whose parent it refused."""
    order = {it.block.key: i for i, it in enumerate(items)}
    parent = {it.block.key: it.block.parent for it in items}
    tops: dict[bytes, bytes] = {}

    def top(key: bytes) -> bytes:
        seen = []
        while key in parent and parent[key] in parent and key not in tops:
            seen.append(key)
            key = parent[key]
        found = tops.get(key, key)
        tops.update(dict.fromkeys(seen, found))
        return found

    latest: dict[bytes, int] = {}
    for f in files:
        for it in f.items:
            t = top(it.block.key)
            latest[t] = max(latest.get(t, -1), order[it.block.key])
    tree = [top(f.items[0].block.key) for f in files]
    ranked = sorted(range(len(files)), key=lambda i: (-latest[tree[i]], i))
    return [files[i] for i in ranked]
