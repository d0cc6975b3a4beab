"""Eviction policy lab: block-count caches of prefix chains on a Mooncake-format trace.

A fast standalone model (no library code) to compare eviction and admission
policies before one goes into the library: LRU (leaves first), the offline
optimum (farthest next use, leaves first, bypass when the newcomer is used
later than any victim), frequency (``lfu:VALUE``: GreedyDual over use counts
with admission; ``:noadmit``, ``:noaging`` ablations) and the hit-density
policy (``density``, ``density-no*`` ablations).
Hit rate = cached / prompt tokens over the last half of the requests, a hit
being the prefix of a request's blocks held when it arrives (kvcache-simulator's
semantics). Prints one line per (policy, capacity) and a table.

    python tools/policy_lab.py TRACE --capacity 256,1024,4096,16384,65536 \
        --policy lru,optimal,density [--variant shift|half1|half2|sub0|sub1]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from trace_variants import make_variant

from prefixcache.tiers.hot.density import DensityPolicy
from prefixcache.traces.reader import read_trace


@dataclass
class Plan:
    chains: list[list[int]]  # per request: trie node ids root first
    tokens: list[list[int]]  # per request: tokens of each block
    parent: list[int]
    next_use: list[list[int]]  # per request, per block: next request using the node
    warmup: int


def build_plan(requests) -> Plan:
    edges: dict[tuple[int, int], int] = {}
    parent = [0]
    chains, tokens = [], []
    for r in requests:
        node, chain = 0, []
        for h in r.hash_ids:
            nxt = edges.get((node, h))
            if nxt is None:
                nxt = edges[(node, h)] = len(parent)
                parent.append(node)
            chain.append(nxt)
            node = nxt
        chains.append(chain)
        tokens.append(r.block_tokens())
    never = len(chains) + 1
    last = [never] * len(parent)
    next_use = [[]] * len(chains)
    for i in range(len(chains) - 1, -1, -1):
        next_use[i] = [last[n] for n in chains[i]]
        for n in chains[i]:
            last[n] = i
    return Plan(chains, tokens, parent, next_use, len(chains) // 2)


def _count(plan: Plan, i: int, present) -> tuple[int, int, int]:
    """(hit blocks, hit tokens, prompt tokens) of request i against ``present``."""
    chain, toks = plan.chains[i], plan.tokens[i]
    hit = 0
    while hit < len(chain) and present[chain[hit]]:
        hit += 1
    return hit, sum(toks[:hit]), sum(toks)


VALUES = {
    "lin": float,
    "sqrt": lambda u: u**0.5,
    "log": lambda u: math.log2(1 + u),
    "cap4": lambda u: float(min(u, 4)),
    "half": lambda u: u / 2,
    "dbl": lambda u: 2.0 * u,
    "sq": lambda u: float(u * u),
    "cube": lambda u: float(u**3),
}


def run_heap(plan: Plan, capacity: int, policy: str) -> float:
    """LRU (priority: last use) or the optimum (priority: minus next use), leaves first."""
    n = len(plan.parent)
    present, kids, key, ver = bytearray(n), [0] * n, [0] * n, [0] * n
    present[0] = 1
    heap: list[tuple[int, int, int]] = []
    size, clock, hits, total = 0, 0, 0, 0
    optimal = policy == "optimal"
    lfu = policy.startswith("lfu")
    strict = lfu and not policy.endswith(":loose")
    admit = not policy.endswith(":noadmit")  # ablation: every newcomer comes in
    aging = not policy.endswith(":noaging")  # ablation: the floor never rises (plain LFU)
    value = VALUES[policy.split(":")[1] if ":" in policy else "lin"]
    uses: dict[int, int] = {}
    floor = 0.0

    def push(node: int) -> None:
        ver[node] += 1
        heapq.heappush(heap, (key[node], ver[node], node))

    for i, chain in enumerate(plan.chains):
        hit, h_tok, p_tok = _count(plan, i, present)
        if i >= plan.warmup:
            hits, total = hits + h_tok, total + p_tok
        nxt = plan.next_use[i]
        for node in chain:
            uses[node] = uses.get(node, 0) + 1
        for d in range(hit):
            clock += 1
            lfu_key = floor + value(uses[chain[d]])
            key[chain[d]] = -nxt[d] if optimal else (lfu_key if lfu else clock)
            if not kids[chain[d]]:
                push(chain[d])
        protect = set(chain)
        for d in range(hit, len(chain)):
            node = chain[d]
            mine = -nxt[d] if optimal else (floor + value(uses[node]) if lfu else clock + 1)
            if size >= capacity:
                skipped, victim = [], None
                while heap:
                    k, v, cand = heapq.heappop(heap)
                    if not present[cand] or kids[cand] or v != ver[cand]:
                        continue
                    if cand in protect:
                        skipped.append((k, v, cand))
                        continue
                    victim = (k, v, cand)
                    break
                for item in skipped:
                    heapq.heappush(heap, item)
                if (
                    victim is None
                    or (optimal and victim[0] >= mine)
                    or (lfu and admit and (victim[0] >= mine if strict else victim[0] > mine))
                ):
                    if victim is not None:
                        heapq.heappush(heap, victim)
                    break
                cand = victim[2]
                if lfu and aging:
                    floor = max(floor, victim[0])
                present[cand] = 0
                size -= 1
                kids[plan.parent[cand]] -= 1
                p = plan.parent[cand]
                if p and not kids[p]:
                    push(p)
            clock += 1
            present[node] = 1
            size += 1
            kids[plan.parent[node]] += 1
            key[node] = mine
            push(node)
    return hits / total


def run_density(plan: Plan, capacity: int, options: dict) -> float:
    """The hit-density policy (prefixcache.traces.density) on block counts."""
    n = len(plan.parent)
    policy = DensityPolicy(capacity, **options)
    present, kids = bytearray(n), [0] * n
    present[0] = 1
    hits, total = 0, 0
    for i, chain in enumerate(plan.chains):
        hit, h_tok, p_tok = _count(plan, i, present)
        if i >= plan.warmup:
            hits, total = hits + h_tok, total + p_tok
        for d in range(hit):
            policy.hit(chain[d])
        protect = set(chain)
        for d in range(hit, len(chain)):
            node = chain[d]
            if len(policy) >= capacity:
                victim = policy.victim(protect, newcomer=node, depth=d)
                if victim is None:
                    for rest in range(d, len(chain)):
                        policy.passed(chain[rest], depth=rest)
                    break
                present[victim] = 0
                p = plan.parent[victim]
                kids[p] -= 1
                policy.remove(victim)
                if p and not kids[p] and present[p]:
                    policy.became_leaf(p)
            present[node] = 1
            p = plan.parent[node]
            if p and not kids[p] and present[p]:
                policy.not_leaf(p)
            kids[p] += 1
            policy.add(node, depth=d)
    return hits / total


ABLATIONS = {
    "density": {},
    "density-noclass": {"classes": False},
    "density-nobypass": {"bypass": False},
    "density-nodepth": {"depth_classes": False},
    "density-noghost": {"ghosts": False},
}


def one(args: tuple) -> tuple[str, int, float, float]:
    trace, variant, policy, capacity = args
    plan = build_plan(make_variant(read_trace(trace), variant))
    t = time.perf_counter()
    if policy in ("lru", "optimal") or policy.startswith("lfu"):
        rate = run_heap(plan, capacity, policy)
    else:
        random.seed(0)
        rate = run_density(plan, capacity, ABLATIONS[policy])
    return policy, capacity, rate, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--capacity", default="256,1024,4096,16384,65536")
    p.add_argument("--policy", default="lru,optimal,density")
    p.add_argument("--variant", default="none")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    caps = [int(c) for c in a.capacity.split(",")]
    tasks = [(a.trace, a.variant, pol, c) for pol in a.policy.split(",") for c in caps]
    res = {}
    with ProcessPoolExecutor(a.jobs) as pool:
        for pol, cap, rate, secs in pool.map(one, tasks):
            res[pol, cap] = rate
            print(f"{a.variant} {pol} {cap}: {100 * rate:.2f}% ({secs:.1f} s)", flush=True)
    pols = a.policy.split(",")
    print("capacity | " + " | ".join(pols) + (" | gap closed" if "optimal" in pols else ""))
    for c in caps:
        row = [f"{100 * res[q, c]:.1f}" for q in pols]
        if {"lru", "optimal"} <= set(pols) and len(pols) > 2:
            gap = res["optimal", c] - res["lru", c]
            best = next(q for q in pols if q not in ("lru", "optimal"))
            row.append(f"{(res[best, c] - res['lru', c]) / gap:.2f}" if gap > 0 else "-")
        print(f"{c} | " + " | ".join(row))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
