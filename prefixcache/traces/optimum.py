"""The offline optimum of a one-tier block cache: the bound no online policy beats.

Belady's rule on prefix chains: when the cache (``capacity`` blocks) is full,
evict the leaf whose next use is farthest (never used again: first), and do
not admit a newcomer used later than every victim (it and the rest of its
chain are not stored). Only leaves go, so a chain is never cut in the middle;
the blocks of the request being stored are not victims. A hit is the prefix
of a request's blocks held when it arrives (kvcache-simulator's semantics);
tokens per block as the trace gives them. Needs the whole trace: offline only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .reader import TraceRequest


def _plan(requests: Sequence[TraceRequest]) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Trie node ids per request, each node's parent, and each block's next use."""
    edges: dict[tuple[int, int], int] = {}
    parent = [0]
    chains = []
    for request in requests:
        node, chain = 0, []
        for block_id in request.hash_ids:
            nxt = edges.get((node, block_id))
            if nxt is None:
                nxt = edges[(node, block_id)] = len(parent)
                parent.append(node)
            chain.append(nxt)
            node = nxt
        chains.append(chain)
    never = len(chains) + 1
    last = [never] * len(parent)
    next_use: list[list[int]] = [[] for _ in chains]
    for i in range(len(chains) - 1, -1, -1):
        next_use[i] = [last[n] for n in chains[i]]
        for n in chains[i]:
            last[n] = i
    return chains, parent, next_use


def optimum_hit_rates(requests: Sequence[TraceRequest], capacity: int) -> tuple[float, float]:
    """(hit rate over all requests, over their last half) of the optimum at ``capacity`` blocks.

    Raises:
        ValueError: ``capacity`` is below 1.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity!r}")
    chains, parent, next_use = _plan(requests)
    cache = _Farthest(parent, capacity)
    totals = [0, 0, 0, 0]  # cached, prompt; last half: cached, prompt
    half = len(chains) // 2
    for i, chain in enumerate(chains):
        tokens = requests[i].block_tokens()
        hit = 0
        while hit < len(chain) and cache.present[chain[hit]]:
            hit += 1
        for j, value in enumerate((sum(tokens[:hit]), sum(tokens))):
            totals[j] += value
            totals[j + 2] += value if i >= half else 0
        for d in range(hit):
            cache.use(chain[d], next_use[i][d])
        protect = set(chain)
        for d in range(hit, len(chain)):
            if not cache.store(chain[d], next_use[i][d], protect):
                break
    return totals[0] / max(1, totals[1]), totals[2] / max(1, totals[3])


class _Farthest:
    """Present trie nodes, and a heap of leaves by next use (farthest first)."""

    def __init__(self, parent: list[int], capacity: int):
        n = len(parent)
        self.parent, self.capacity, self.size = parent, capacity, 0
        self.present, self.kids = bytearray(n), [0] * n
        self.present[0] = 1  # the root: always there, never a victim
        self.next, self.version = [0] * n, [0] * n
        self.heap: list[tuple[int, int, int]] = []  # (-next use, version, node)

    def use(self, node: int, next_use: int) -> None:
        self.next[node] = next_use
        if not self.kids[node]:
            self._push(node)

    def _push(self, node: int) -> None:
        self.version[node] += 1
        heapq.heappush(self.heap, (-self.next[node], self.version[node], node))

    def store(self, node: int, next_use: int, protect: set[int]) -> bool:
        """Add ``node`` (a child of a present node); False: not admitted."""
        if self.size >= self.capacity and not self._evict(next_use, protect):
            return False
        self.present[node] = 1
        self.size += 1
        self.kids[self.parent[node]] += 1
        self.use(node, next_use)
        return True

    def _evict(self, newcomer: int, protect: set[int]) -> bool:
        skipped, found = [], None
        while self.heap:
            item = heapq.heappop(self.heap)
            node = item[2]
            if not self.present[node] or self.kids[node] or item[1] != self.version[node]:
                continue
            if node in protect:
                skipped.append(item)
                continue
            found = item
            break
        for item in skipped:
            heapq.heappush(self.heap, item)
        if found is None or -found[0] <= newcomer:  # the newcomer is used last: bypass
            if found is not None:
                heapq.heappush(self.heap, found)
            return False
        node = found[2]
        self.present[node] = 0
        self.size -= 1
        up = self.parent[node]
        self.kids[up] -= 1
        if up and not self.kids[up]:
            self._push(up)
        return True
