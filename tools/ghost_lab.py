"""Ghost lab: ARC (a recency and a frequency list sized by ghost hits) on prefix chains.

Block-count model of policy_lab.py's semantics (leaves first, hit rate over
the last half). A block seen once is in ``T1``, a block seen again in ``T2``;
an evicted block's key goes to the ghost list of its list (``B1``, ``B2``,
each up to the capacity, oldest out first). A block coming back through
``B1`` means recency was short of room: the target size ``p`` of ``T1``
grows; through ``B2``, it shrinks. The victim is the least recently used
leaf of ``T1`` while ``T1`` is over ``p``, else of ``T2`` (the other list
when that one has no leaf to give). ``--admit-ghosts`` adds TinyLFU's
doorkeeper with a ghost instead of an unbounded memory: a new block not in
a ghost list comes in only when the cache has room or it starts a chain;
the rest of a refused chain goes to ``B1`` (its second sighting comes in).

    python tools/ghost_lab.py TRACE [--variant sub0] [--admit-ghosts]
"""

from __future__ import annotations

import argparse
import heapq
from collections import OrderedDict

from policy_lab import Plan, _count, build_plan
from trace_variants import make_variant

from prefixcache.traces.reader import read_trace


class Arc:
    """ARC's lists over the leaves of a block tree (heaps of leaves by last use)."""

    def __init__(self, plan: Plan, capacity: int) -> None:
        n = len(plan.parent)
        self.plan, self.c, self.p = plan, capacity, 0.0
        self.present, self.kids, self.which = bytearray(n), [0] * n, bytearray(n)
        self.present[0] = 1
        self.ver, self.serial = [0] * n, 0
        self.heaps: list[list[tuple[int, int]]] = [[], [], []]  # by list: (serial, node)
        self.sizes = [0, 0, 0]
        self.ghosts: list[OrderedDict[int, None]] = [OrderedDict(), OrderedDict(), OrderedDict()]

    def touch(self, node: int, lst: int) -> None:
        if self.present[node]:
            self.sizes[self.which[node]] -= 1
        self.sizes[lst] += 1
        self.which[node] = lst
        self.serial += 1
        self.ver[node] = self.serial
        if not self.kids[node]:
            heapq.heappush(self.heaps[lst], (self.serial, node))

    def _lru_leaf(self, lst: int, protect) -> int | None:
        heap, skipped, found = self.heaps[lst], [], None
        while heap:
            serial, node = heapq.heappop(heap)
            stale = not self.present[node] or self.kids[node] or self.which[node] != lst
            if stale or serial != self.ver[node]:
                continue
            if node in protect:
                skipped.append((serial, node))
                continue
            found = node
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def evict(self, protect) -> bool:
        first = 1 if self.sizes[1] > max(self.p, 0) else 2
        victim, lst = self._lru_leaf(first, protect), first
        if victim is None:
            lst = 3 - first
            victim = self._lru_leaf(lst, protect)
        if victim is None:
            return False
        self.present[victim] = 0
        self.sizes[lst] -= 1
        ghosts = self.ghosts[lst]
        ghosts[victim] = None
        if len(ghosts) > self.c:
            ghosts.popitem(last=False)
        parent = self.plan.parent[victim]
        self.kids[parent] -= 1
        if parent and not self.kids[parent]:
            heapq.heappush(self.heaps[self.which[parent]], (self.ver[parent], parent))
        return True

    def refuse(self, nodes: list[int]) -> None:
        """Remember refused newcomers in ``B1``: their second sighting comes in."""
        ghosts = self.ghosts[1]
        for node in nodes:
            ghosts[node] = None
            if len(ghosts) > self.c:
                ghosts.popitem(last=False)

    def arrive(self, node: int) -> int:
        """The list a newcomer goes to, adapting ``p`` on a ghost hit (0: no ghost)."""
        b1, b2 = self.ghosts[1], self.ghosts[2]
        if node in b1:
            self.p = min(self.c, self.p + max(len(b2) / len(b1), 1.0))
            del b1[node]
            return 2
        if node in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[node]
            return 2
        return 0


def run(plan: Plan, capacity: int, admit_ghosts: bool) -> float:
    arc = Arc(plan, capacity)
    hits = total = size = 0
    for i, chain in enumerate(plan.chains):
        hit, h_tok, p_tok = _count(plan, i, arc.present)
        if i >= plan.warmup:
            hits, total = hits + h_tok, total + p_tok
        for d in range(hit - 1, -1, -1):  # deepest first: ancestors the most recent
            arc.touch(chain[d], 2)
        protect = set(chain)
        for d in range(hit, len(chain)):
            node = chain[d]
            lst = arc.arrive(node)
            if admit_ghosts and lst == 0 and d > 0 and size >= capacity:
                arc.refuse(chain[d:])  # never seen (or forgotten): remembered, not kept
                break
            if size >= capacity:
                if not arc.evict(protect):
                    break
                size -= 1
            arc.touch(node, lst or 1)  # before it is present: no list to leave
            arc.present[node], size = 1, size + 1
            arc.kids[plan.parent[node]] += 1
    return hits / total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--capacity", default="256,1024,4096,16384,65536")
    p.add_argument("--variant", default="none")
    p.add_argument("--admit-ghosts", action="store_true")
    a = p.parse_args()
    plan = build_plan(make_variant(read_trace(a.trace), a.variant))
    for c in a.capacity.split(","):
        rate = run(plan, int(c), a.admit_ghosts)
        print(f"{a.variant} arc admit_ghosts={a.admit_ghosts} {c}: {100 * rate:.2f}%", flush=True)


if __name__ == "__main__":
    main()
