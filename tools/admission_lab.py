"""Admission lab: admitting a sample of new chains, and the parts of the adaptive policy.

A block-count model of the same semantics as policy_lab.py (no library code;
its LRU and optimum equal kvcache-simulator's). Hit rate over the last half.

- ``distances``: reuse distances counted in new blocks (blocks seen for the
  first time in between), for first reuses and later ones: F(C), the share a
  cache of C blocks that admits everything can catch.
- ``gate``: leaves-first LRU where a new chain (its first new block under a
  branch point) comes in only if its key is in a fixed sample of share p (a
  chain refused stays refused); ``--seen``: a block seen before comes in
  always (second sighting); ``--oracle``: a chain comes in iff it is used
  again (admission that knows the future; eviction still LRU).
- ``adaptive``: the library's adaptive policy (tiers/hot/adaptive.py) on
  block counts: GreedyDual over counts, its regime chosen by the measured
  reach; ``--force keep|sample|full`` holds one regime (the ablation).
- ``bound``: what an online policy could know: conversations (requests
  sharing their first two blocks) going on after k turns, the gap to the
  next turn and how well the previous gap predicts it; and the optimum's and
  LRU's hit tokens by the gap since the conversation's previous turn.

    python tools/admission_lab.py TRACE distances
    python tools/admission_lab.py TRACE gate --p 1,0.5,0.25,0.12,0.06 [--seen] [--oracle]
    python tools/admission_lab.py TRACE adaptive [--force sample] [--variant shift]
    python tools/admission_lab.py TRACE bound --capacity 1024
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

import policy_lab
from policy_lab import Plan, _count, build_plan
from trace_variants import make_variant

from prefixcache.tiers.hot.adaptive import FULL_FROM, KEEP_BELOW, SAMPLE
from prefixcache.tiers.hot.reach import Reach
from prefixcache.traces.reader import read_trace

CAPACITIES = "256,1024,4096,16384,65536"


def in_sample(node: int, p: float) -> bool:
    x = (node * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 32)) & 0xFFFFFF < p * (1 << 24)


def distances(plan: Plan) -> None:
    n = len(plan.parent)
    uses, last_at, new = [0] * n, [0] * n, 0
    first: list[int] = []
    later: list[int] = []
    for chain in plan.chains:
        for node in chain:
            if uses[node]:
                (first if uses[node] == 1 else later).append(new - last_at[node])
            uses[node] += 1
        for node in chain:
            new += uses[node] == 1 and last_at[node] == 0
            last_at[node] = new
    print(f"{new} blocks, {len(first)} first reuses, {len(later)} later ones")
    for name, xs in (("first", sorted(first)), ("later", sorted(later))):
        qs = [xs[int(q * len(xs))] for q in (0.1, 0.25, 0.5, 0.75, 0.9)]
        print(f"{name}: quantiles 10/25/50/75/90% {qs}")
        shares = [f"{1 << k}:{bisect.bisect(xs, 1 << k) / len(xs):.2f}" for k in range(8, 18)]
        print(f"{name}: F(C) " + " ".join(shares))


def bound(requests, plan: Plan, capacity: int) -> None:
    gap, seen, last = [], Counter(), {}
    gaps: dict[tuple[int, ...], list[int]] = {}  # per conversation: requests between turns
    for i, r in enumerate(requests):
        conv = tuple(r.hash_ids[:2])
        seen[conv] += 1
        gap.append(i - last.get(conv, i))
        if conv in last:
            gaps.setdefault(conv, []).append(i - last[conv])
        last[conv] = i
    turns = Counter(seen.values())
    for k in range(1, 6):
        at_k = sum(c for t, c in turns.items() if t >= k)
        print(f"after {k} turns: {at_k} conversations, {1 - turns[k] / at_k:.2f} go on")
    firsts = sorted(g[0] for g in gaps.values())
    print(
        "first gap, 10/25/50/75/90%:",
        [firsts[int(q * len(firsts))] for q in (0.1, 0.25, 0.5, 0.75, 0.9)],
    )
    pairs = [(math.log(x + 1), math.log(y + 1)) for g in gaps.values() for x, y in pairwise(g)]
    xs, ys = zip(*pairs, strict=True)
    print(f"{len(pairs)} gap pairs, log correlation {statistics.correlation(xs, ys):.2f}")
    edges = (0, 1, 50, 200, 500, 1000, 1 << 30)
    for policy in ("optimal", "lru"):
        by_gap = Counter()

        def spy(plan_: Plan, i: int, present, by_gap=by_gap) -> tuple[int, int, int]:
            found = _count(plan_, i, present)
            if i >= plan_.warmup:
                by_gap[bisect.bisect(edges, gap[i]) - 1] += found[1]
            return found

        policy_lab._count = spy
        rate = policy_lab.run_heap(plan, capacity, policy)
        policy_lab._count = _count
        shares = " ".join(f"<{edges[b + 1]}: {n / 1e6:.1f}M" for b, n in sorted(by_gap.items()))
        print(f"{policy} {capacity}: {100 * rate:.2f}%, hit tokens by gap (requests): {shares}")


@dataclass
class Rule:
    counts: bool = False  # rank by floor + uses (GreedyDual over counts), else floor + 1 (LRU)
    aging: bool = True  # the floor rises to each victim's priority
    p: float = 1.0  # sample of new chains admitted
    seen: bool = False  # a block seen before comes in always
    oracle: bool = False  # a chain comes in iff used again
    adaptive: bool = False  # regimes chosen by the reach (overrides the four above)


def _regime(rule: Rule, reach: Reach) -> Rule:
    if not rule.adaptive:
        return rule
    share = reach.share
    if share is None:
        return Rule()  # LRU until the reach is known
    if share < KEEP_BELOW:
        return Rule(counts=True, aging=False)
    if share < FULL_FROM:
        return Rule(counts=True, p=SAMPLE, seen=True)
    return Rule(counts=True)


def _admit(plan: Plan, i: int, hit: int, now: Rule, uses, kids) -> bool:
    chain = plan.chains[i]
    if hit == len(chain):
        return False
    if now.oracle:
        return plan.next_use[i][hit] <= len(plan.chains)
    first, parent = chain[hit], plan.parent[chain[hit]]
    if hit == 0 or (parent != 0 and kids[parent] == 0) or (now.seen and uses[first] > 0):
        return True  # a chain's first block, a held chain going on, or seen before
    return in_sample(first, now.p)


def run(plan: Plan, capacity: int, rule: Rule) -> float:
    n = len(plan.parent)
    present, kids, key, ver, uses = bytearray(n), [0] * n, [0.0] * n, [0] * n, [0] * n
    present[0] = 1
    heap: list[tuple[float, int, int]] = []
    size = hits = total = serial = 0
    floor, reach = 0.0, Reach()

    def push(node: int, used: bool = True) -> None:
        nonlocal serial
        if used:  # ties go least recently used first: with every value 1, this is LRU
            serial += 1
            ver[node] = serial
        heapq.heappush(heap, (key[node], ver[node], node))

    for i, chain in enumerate(plan.chains):
        hit, h_tok, p_tok = _count(plan, i, present)
        if i >= plan.warmup:
            hits, total = hits + h_tok, total + p_tok
        for node in chain:
            seen = reach.seen_again if uses[node] else reach.first_seen
            seen(node, capacity)
        now = _regime(rule, reach)
        admit = _admit(plan, i, hit, now, uses, kids)
        for node in chain:
            uses[node] += 1
        for d in range(hit - 1, -1, -1):  # deepest first: ancestors the most recent
            key[chain[d]] = floor + (uses[chain[d]] if now.counts else 1)
            push(chain[d])
        protect = set(chain) if admit else ()
        for d in range(hit, len(chain) if admit else hit):
            node = chain[d]
            if size >= capacity:
                victim = _victim(heap, present, kids, ver, protect)
                if victim is None:
                    break
                if now.aging:
                    floor = max(floor, victim[0])
                cand = victim[2]
                present[cand], size = 0, size - 1
                kids[plan.parent[cand]] -= 1
                if plan.parent[cand] and not kids[plan.parent[cand]]:
                    push(plan.parent[cand], used=False)
            present[node], size = 1, size + 1
            kids[plan.parent[node]] += 1
            key[node] = floor + (uses[node] if now.counts else 1)
            push(node)
    return hits / total


def _victim(heap, present, kids, ver, protect):
    """The least (priority, version, node) leaf not in ``protect``, popped; or None."""
    skipped, victim = [], None
    while heap:
        item = heapq.heappop(heap)
        cand = item[2]
        if not present[cand] or kids[cand] or item[1] != ver[cand]:
            continue
        if cand in protect:
            skipped.append(item)
            continue
        victim = item
        break
    for item in skipped:
        heapq.heappush(heap, item)
    return victim


FORCED = {
    "keep": Rule(counts=True, aging=False),
    "sample": Rule(counts=True, p=SAMPLE, seen=True),
    "full": Rule(counts=True),
    "lru": Rule(),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("what", choices=("distances", "gate", "adaptive", "bound"))
    p.add_argument("--capacity", default=CAPACITIES)
    p.add_argument("--variant", default="none")
    p.add_argument("--p", default="1,0.5,0.25,0.12,0.06,0.03")
    p.add_argument("--seen", action="store_true")
    p.add_argument("--oracle", action="store_true")
    p.add_argument("--force", choices=sorted(FORCED))
    a = p.parse_args()
    requests = make_variant(read_trace(a.trace), a.variant)
    plan = build_plan(requests)
    if a.what == "distances":
        distances(plan)
        return
    if a.what == "bound":
        bound(requests, plan, int(a.capacity.split(",")[0]))
        return
    for capacity in (int(c) for c in a.capacity.split(",")):
        if a.what == "gate":
            rules = [(q, Rule(p=float(q), seen=a.seen, oracle=a.oracle)) for q in a.p.split(",")]
        else:
            rules = [(a.force or "adaptive", FORCED.get(a.force) or Rule(adaptive=True))]
        row = " ".join(f"{name}: {100 * run(plan, capacity, r):.2f}%" for name, r in rules)
        print(f"{a.variant} {a.what} {capacity}: {row}", flush=True)


if __name__ == "__main__":
    main()
