"""Depth lab: ranking leaves by their place in the chain, alone and with recency.

Block-count model of policy_lab.py's semantics (leaves first, every newcomer
admitted, a hit touches its chain deepest first, hit rate over the last
half). What a rule sees of a leaf, all of it online:

- ``depth``: its index in its chain (0: a prompt's first block);
- ``rest``: how many blocks of the chain it last served came after it (all
  of them held once that request stored its chain): 0 for a prompt's end, more
  for a block left a leaf after the blocks below it were evicted;
- ``kids``: how many distinct children it has had so far (how many
  sequences it prefixes: sharing);
- its last use (recency).

Rules (the victim is the least key; ties least recently used first):

- ``lru``; ``deep`` / ``shallow``: the deepest / shallowest leaf first;
  ``stub``: the largest ``rest`` first; ``kids``: the fewest children first;
- ``deep-of:K``, ``shallow-of:K``, ``stub-of:K``, ``kids-of:K``: that
  criterion among the K least recent leaves;
- ``gd-kids``: GreedyDual (a floor that rises to each victim's key) with
  value ``kids + 1``; ``gd-deep``: value ``depth + 1``;
- ``kids-age:K``: of K leaves drawn at random, the least ``(kids + 1) / age``
  (age: uses of the cache since its last use); ``age:K``, its control: the
  oldest of K drawn (sampled LRU, as Redis evicts).

The references come from the same run: LRU and the optimum (policy_lab.py)
and the block-count model of ``adaptive`` (admission_lab.py).

    python tools/depth_lab.py TRACE --rule deep,deep-of:32,gd-kids [--variant shift|sub0]
"""

from __future__ import annotations

import argparse
import heapq
import random
from concurrent.futures import ProcessPoolExecutor

import admission_lab
import policy_lab
from policy_lab import Plan, _count, build_plan
from trace_variants import make_variant

from prefixcache.traces.reader import read_trace

PURE = {"lru", "deep", "shallow", "stub", "kids", "gd-kids", "gd-deep"}
OF_K = {"deep-of", "shallow-of", "stub-of", "kids-of", "kids-age", "age"}


def parse_rule(rule: str) -> tuple[str, int]:
    """(name, K) of a rule; K is 0 for the rules that take none."""
    name, _, k = rule.partition(":")
    if name in PURE and not k:
        return name, 0
    if name in OF_K and k.isdigit() and int(k) > 0:
        return name, int(k)
    raise ValueError(f"unknown rule {rule!r}")


class DepthCache:
    """Leaves of a block tree in a heap by the rule's key, with lazy deletion."""

    def __init__(self, plan: Plan, capacity: int, rule: str) -> None:
        n = len(plan.parent)
        self.plan, self.capacity = plan, capacity
        self.name, self.k = parse_rule(rule)
        self.present, self.held_kids = bytearray(n), [0] * n
        self.present[0] = 1
        self.depth, self.rest, self.kids_seen = [0] * n, [0] * n, [0] * n
        self.last, self.ver = [0] * n, [0] * n
        self.heap: list[tuple[float, int, int]] = []
        self.floor, self.clock, self.size = 0.0, 0, 0
        self.leaves: list[int] = []  # for random draws (kids-age)
        self.slot: dict[int, int] = {}

    def key(self, node: int) -> float:
        name = self.name
        if name == "deep":
            return -self.depth[node]
        if name == "shallow":
            return self.depth[node]
        if name == "stub":
            return -self.rest[node]
        if name == "kids":
            return self.kids_seen[node]
        if name == "gd-kids":
            return self.floor + self.kids_seen[node] + 1
        if name == "gd-deep":
            return self.floor + self.depth[node] + 1
        return 0.0  # lru and the rules over the K least recent: recency alone

    def push(self, node: int) -> None:
        if self.name in ("kids-age", "age"):
            if node not in self.slot:
                self.slot[node] = len(self.leaves)
                self.leaves.append(node)
            return
        self.ver[node] += 1
        heapq.heappush(self.heap, (self.key(node), self.last[node], node, self.ver[node]))

    def _drop_leaf(self, node: int) -> None:
        """Forget ``node`` as a leaf in the random-draw list (kids-age)."""
        at = self.slot.pop(node, None)
        if at is not None:
            tail = self.leaves.pop()
            if tail != node:
                self.leaves[at], self.slot[tail] = tail, at

    def use(self, node: int, d: int, rest: int) -> None:
        self.clock += 1
        self.last[node], self.depth[node], self.rest[node] = self.clock, d, rest
        if not self.held_kids[node]:
            self.push(node)

    def _valid(self, item) -> bool:
        node = item[2]
        return self.present[node] and not self.held_kids[node] and item[3] == self.ver[node]

    def _pop_valid(self, protect, want: int) -> list:
        out, skipped = [], []
        while self.heap and len(out) < want:
            item = heapq.heappop(self.heap)
            if not self._valid(item):
                continue
            (skipped if item[2] in protect else out).append(item)
        for item in skipped:
            heapq.heappush(self.heap, item)
        return out

    def _pick(self, items: list) -> int:
        name, depth, rest, kids = self.name, self.depth, self.rest, self.kids_seen
        crit = {
            "deep-of": lambda it: (-depth[it[2]], it[1]),
            "shallow-of": lambda it: (depth[it[2]], it[1]),
            "stub-of": lambda it: (-rest[it[2]], it[1]),
            "kids-of": lambda it: (kids[it[2]], it[1]),
        }[name]
        return min(range(len(items)), key=lambda j: crit(items[j]))

    def victim(self, protect) -> int | None:
        if self.name in ("kids-age", "age"):
            return self._drawn(protect)
        items = self._pop_valid(protect, self.k or 1)
        if not items:
            return None
        j = self._pick(items) if self.k else 0
        for other in items[:j] + items[j + 1 :]:
            heapq.heappush(self.heap, other)
        if self.name.startswith("gd-"):
            self.floor = max(self.floor, items[j][0])
        return items[j][2]

    def _drawn(self, protect) -> int | None:
        best, score = None, 0.0
        for _ in range(self.k):
            while self.leaves:
                node = self.leaves[random.randrange(len(self.leaves))]
                if self.present[node] and not self.held_kids[node]:
                    break
                self._drop_leaf(node)
            else:
                return best
            if node in protect:
                continue
            worth = self.kids_seen[node] + 1 if self.name == "kids-age" else 1
            s = worth / (self.clock - self.last[node] + 1)
            if best is None or s < score:
                best, score = node, s
        return best

    def evict(self, node: int) -> None:
        self.present[node], self.size = 0, self.size - 1
        self._drop_leaf(node)
        p = self.plan.parent[node]
        self.held_kids[p] -= 1
        if p and not self.held_kids[p]:
            self.push(p)

    def add(self, node: int, d: int, rest: int) -> None:
        self.present[node], self.size = 1, self.size + 1
        p = self.plan.parent[node]
        self.held_kids[p] += 1
        self._drop_leaf(p)
        self.use(node, d, rest)


def run(plan: Plan, capacity: int, rule: str) -> float:
    """Hit rate over the last half of ``rule`` at ``capacity`` blocks."""
    return replay(plan, capacity, rule)[0]


def replay(plan: Plan, capacity: int, rule: str) -> tuple[float, DepthCache]:
    """The hit rate over the last half, and the cache as the trace left it."""
    random.seed(0)
    cache = DepthCache(plan, capacity, rule)
    seen = bytearray(len(plan.parent))
    hits = total = 0
    for i, chain in enumerate(plan.chains):
        hit, h_tok, p_tok = _count(plan, i, cache.present)
        if i >= plan.warmup:
            hits, total = hits + h_tok, total + p_tok
        for node in chain:
            if not seen[node]:
                seen[node] = 1
                cache.kids_seen[plan.parent[node]] += 1
        end = len(chain) - 1
        for d in range(hit - 1, -1, -1):  # deepest first: ancestors the most recent
            cache.use(chain[d], d, end - d)
        protect = set(chain)
        for d in range(hit, len(chain)):
            if cache.size >= capacity:
                victim = cache.victim(protect)
                if victim is None:
                    break
                cache.evict(victim)
            cache.add(chain[d], d, end - d)
    return hits / total, cache


def one(args: tuple) -> tuple[str, str, int, float]:
    trace, variant, rule, capacity = args
    plan = build_plan(make_variant(read_trace(trace), variant))
    if rule in ("lru-ref", "optimal"):
        rate = policy_lab.run_heap(plan, capacity, rule.removesuffix("-ref"))
    elif rule == "adaptive":
        rate = admission_lab.run(plan, capacity, admission_lab.Rule(adaptive=True))
    else:
        rate = run(plan, capacity, rule)
    return variant, rule, capacity, rate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--capacity", default="256,1024,4096,16384,65536")
    p.add_argument("--rule", default="lru,deep,deep-of:32,gd-kids")
    p.add_argument("--refs", default="optimal,adaptive", help="lru-ref, optimal, adaptive")
    p.add_argument("--variant", default="none")
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args()
    rules = [r for r in a.rule.split(",") if r]
    for r in rules:
        parse_rule(r)
    rules += [r for r in a.refs.split(",") if r]
    caps = [int(c) for c in a.capacity.split(",")]
    tasks = [(a.trace, a.variant, r, c) for r in rules for c in caps]
    res: dict[tuple[str, int], float] = {}
    with ProcessPoolExecutor(a.jobs) as pool:
        for variant, rule, cap, rate in pool.map(one, tasks):
            res[rule, cap] = rate
            print(f"{variant} {rule} {cap}: {100 * rate:.2f}%", flush=True)
    if {"lru", "optimal"} <= {r for r, _ in res}:
        print("share of the gap closed | " + " | ".join(str(c) for c in caps))
        for r in rules:
            cells = []
            for c in caps:
                gap = res["optimal", c] - res["lru", c]
                cells.append(f"{(res[r, c] - res['lru', c]) / gap:.2f}" if gap > 1e-9 else "-")
            print(f"{r} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
