"""Which blocks a warm start loads from the SSD tier: pinned chains first, then the
chains of the most recently used leaves, each root-first, while they fit a budget.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...blocks import BlockMeta


def recent_chains(
    metas_in: Iterable[BlockMeta], pinned: Iterable[bytes], max_bytes: int
) -> list[BlockMeta]:
    """Pinned chains, then the chains of the most recently used leaves, root-first,
    while they fit in ``max_bytes``; a chain broken above (unreachable from its
    root) is skipped."""
    metas = {m.key: m for m in metas_in}
    parents = {m.parent for m in metas.values()}
    leaves = sorted((m for m in metas.values() if m.key not in parents), key=_newest)
    starts = [*(metas[k] for k in pinned if k in metas), *leaves]
    out: list[BlockMeta] = []
    seen: set[bytes] = set()
    total = 0
    for start in starts:
        chain, meta = [], start
        while meta is not None and meta.key not in seen:
            chain.append(meta)
            meta = metas.get(meta.parent)
        if chain and chain[-1].parent != chain[-1].root and chain[-1].parent not in seen:
            continue  # its chain is broken above: unreachable from the root
        for meta in reversed(chain):
            if total + meta.nbytes > max_bytes:
                return out
            out.append(meta)
            seen.add(meta.key)
            total += meta.nbytes
    return out


def _newest(meta: BlockMeta) -> float:
    return -meta.last_used
