"""Bound lab: what a policy that knows more than any online one reaches.

Block-count model of policy_lab.py's semantics (leaves first, hit rate over
the last half). Policies told more than an online policy can know, and one
that learns online what they are told (classes_of says what ``--know`` tells):

- ``predict``: knows, at each use, *whether* the block is used again (the
  admission oracle of admission_lab.py) and the distribution of *when*: the
  gaps to the next use (in requests) of the whole trace, per class of the
  block at that use (``count``: 1, 2, 3 and more uses). A block that is not
  used again goes first and is never admitted; of the others it evicts the
  one with the longest expected time to its next use given its age,
  E[G - a | G > a] (Belady on the expectation), and bypasses a newcomer
  whose expectation is longer than the victim's.
- ``expect``: ``predict``'s ranking without being told whether a block comes
  back (it ranks every block as one that does).
- ``learn``: ``expect`` on what an online policy has: the gaps per class seen
  so far (re-estimated every 250 requests).
- ``density``: knows the trace's distribution of gaps per class, the
  share that never come back included, but not whether this block does;
  evicts the least expected hits per block and request of cache time given
  its age (LHD's rank on the true distribution; a block that never comes
  back is counted as staying four times the longest gap, where LHD measures
  that stay in its cache).

Ages are binned in 48 log-spaced bins; the leaves of each class are kept
by last use (a sorted list), so a victim is found by looking at the bins in
order of their rank: O(bins x log n) per eviction.

    python tools/bound_lab.py TRACE --policy predict --know prev [--variant sub0]
    python tools/bound_lab.py TRACE --policy expect,learn,density --know prev
"""

from __future__ import annotations

import argparse
import bisect
import math
from concurrent.futures import ProcessPoolExecutor
from itertools import accumulate, pairwise

from policy_lab import Plan, _count, build_plan
from sortedcontainers import SortedList
from trace_variants import make_variant

from prefixcache.traces.reader import read_trace

BINS = 48


def classes_of(plan: Plan, know: str, outs: list[int]) -> tuple[list[list[int]], int]:
    """Per request and block, the class the policy is told at that use, and how many.

    ``count``: the use count (1, 2, 3 and more); ``prev``: the count and, from
    the second use on, the block's previous gap in factors of 4 (what an
    online policy sees); ``prev+out``: that and the request's output length
    in factors of 4 (the feature that moves a first return most);
    ``within:F``: the true gap to the next use known within a factor F > 1
    (more than any online policy knows).
    """
    never = len(plan.chains) + 1
    uses, last = [0] * len(plan.parent), [0] * len(plan.parent)
    out: list[list[int]] = []
    width = float(know.split(":")[1]) if know.startswith("within") else 0.0
    if know.startswith("within") and width <= 1:
        raise ValueError(f"within:F needs F > 1, not {know!r}")
    for i, chain in enumerate(plan.chains):
        row = []
        for node, nxt in zip(chain, plan.next_use[i], strict=True):
            uses[node] += 1
            c = min(uses[node], 3) - 1
            if know.startswith("prev") and uses[node] > 1:
                c = 1 + min(int(math.log(i - last[node] + 1, 4)), 7)
            elif width and nxt != never:
                c = 3 + int(math.log(nxt - i, width))
            if know == "prev+out":
                c = c * 8 + min(int(math.log(outs[i] + 1, 4)), 7)
            last[node] = i
            row.append(c)
        out.append(row)
    return out, 1 + max(c for row in out for c in row)


def gap_tables(plan: Plan, cls: list[list[int]], n: int) -> list[tuple[list[int], int]]:
    """Per class: sorted gaps to the next use, and how many never come back."""
    never = len(plan.chains) + 1
    gaps: list[list[int]] = [[] for _ in range(n)]
    lost = [0] * n
    for i, row in enumerate(cls):
        for c, nxt in zip(row, plan.next_use[i], strict=True):
            if nxt == never:
                lost[c] += 1
            else:
                gaps[c].append(nxt - i)
    return [(sorted(g), k) for g, k in zip(gaps, lost, strict=True)]


def edges(horizon: int) -> list[int]:
    out, x = [0], 1.0
    while len(out) < BINS and out[-1] < horizon:
        x *= horizon ** (1 / (BINS - 2))
        if int(x) > out[-1]:
            out.append(int(x))
    return [*out, 1 << 40]


def rank_predict(gaps: list[int], spans: list[tuple[int, int]]) -> list[float]:
    """Per age bin, minus E[G - a | G > a] at the bin's middle age (higher rank: kept)."""
    tail = [0, *accumulate(reversed(gaps))][::-1]  # tail[k]: sum of gaps[k:]
    out = []
    for lo, hi in spans:
        a = (lo + min(hi, lo * 2 + 1)) // 2
        k = bisect.bisect_right(gaps, a)
        out.append(-(tail[k] / (len(gaps) - k) - a) if k < len(gaps) else -1e18)
    return out


def rank_density(gaps: list[int], lost: int, lo: int, hi: int) -> float:
    """Expected hits per request of cache time from age a on (LHD, true distribution)."""
    a = (lo + min(hi, lo * 2 + 1)) // 2
    k = bisect.bisect_right(gaps, a)
    rest = gaps[k:]
    if not rest:
        return 0.0
    alive = len(rest) + lost  # those still out at age a
    horizon = 4 * rest[-1]  # a block that never returns lives out a long stay
    life = (sum(rest) - a * len(rest) + lost * (horizon - a)) / alive
    return len(rest) / alive / max(life, 1.0)


class Ranked:
    """Leaves by use class and last use; the victim is the leaf of the lowest-ranked bin."""

    def __init__(self, ranks: list[list[float]], cuts: list[int]) -> None:
        self.cuts = cuts
        self.byclass = [SortedList() for _ in ranks]
        self.order = sorted(
            (r, c, b) for c, row in enumerate(ranks) for b, r in enumerate(row) if b < len(cuts) - 1
        )
        self.where: dict[int, tuple[int, int]] = {}

    def rerank(self, ranks: list[list[float]]) -> None:
        self.order = sorted((r, c, b) for c, row in enumerate(ranks) for b, r in enumerate(row))

    def add(self, node: int, cls: int, last: int) -> None:
        self.where[node] = (cls, last)
        self.byclass[cls].add((last, node))

    def remove(self, node: int) -> None:
        cls, last = self.where.pop(node)
        self.byclass[cls].remove((last, node))

    def victim(self, now: int, protect) -> tuple[float, int] | None:
        for rank, c, b in self.order:
            items = self.byclass[c]
            lo_last, hi_last = now - self.cuts[b + 1] + 1, now - self.cuts[b]
            for _, node in items.irange((lo_last, -1), (hi_last, 1 << 62)):
                if node not in protect:
                    return rank, node
        return None


class Bounded:
    """A block-count cache of prefix chains that evicts by ``ranks`` (per class and age bin)."""

    def __init__(self, plan: Plan, ranks: list[list[float]], cuts: list[int], oracle: bool):
        n = len(plan.parent)
        self.plan, self.oracle, self.never = plan, oracle, len(plan.chains) + 1
        self.present, self.kids = bytearray(n), [0] * n
        self.present[0] = 1
        self.doomed: dict[int, None] = {}  # leaves not used again (the oracle's first victims)
        self.ranked = Ranked(ranks, cuts)
        self.last_use, self.next_of, self.cls_of = [0] * n, [self.never] * n, [0] * n
        self.size = 0

    def file(self, node: int, i: int, nxt: int, c: int) -> None:
        self.last_use[node], self.next_of[node], self.cls_of[node] = i, nxt, c
        if self.oracle and nxt == self.never:
            self.doomed[node] = None
        else:
            self.ranked.add(node, c, i)

    def unfile(self, node: int) -> None:
        if node in self.doomed:
            del self.doomed[node]
        elif node in self.ranked.where:
            self.ranked.remove(node)

    def touch(self, node: int, i: int, nxt: int, c: int) -> None:
        if self.kids[node]:  # not a leaf: only its last use moves
            self.last_use[node], self.next_of[node], self.cls_of[node] = i, nxt, c
        else:
            self.unfile(node)
            self.file(node, i, nxt, c)

    def make_room(self, i: int, mine: float, protect) -> bool:
        """Evict one leaf ranked below ``mine``; False to bypass the newcomer."""
        victim = next((x for x in self.doomed if x not in protect), None)
        if victim is None:
            found = self.ranked.victim(i, protect)
            if found is None or found[0] >= mine:
                return False
            victim = found[1]
        self.unfile(victim)
        self.present[victim], self.size = 0, self.size - 1
        p = self.plan.parent[victim]
        self.kids[p] -= 1
        if p and not self.kids[p]:
            self.file(p, self.last_use[p], self.next_of[p], self.cls_of[p])
        return True

    def add(self, node: int, i: int, nxt: int, c: int) -> None:
        self.present[node], self.size = 1, self.size + 1
        p = self.plan.parent[node]
        if p and not self.kids[p]:
            self.unfile(p)
        self.kids[p] += 1
        self.file(node, i, nxt, c)


LEARN_EVERY = 250  # requests between two re-estimates of ``learn``'s ranks


def run(plan: Plan, capacity: int, policy: str, know: str, outs: list[int]) -> float:
    """Hit rate over the last half of ``policy`` told ``know`` (classes_of) at ``capacity``."""
    cls, nclass = classes_of(plan, know, outs)
    tables = gap_tables(plan, cls, nclass)
    spans = list(pairwise(cuts := edges(len(plan.chains))))
    if policy == "learn":  # ``expect`` on the gaps seen so far
        tables = [([], 0)] * nclass
    if policy in ("predict", "expect", "learn"):
        ranks = [rank_predict(g, spans) for g, _ in tables]
    else:
        ranks = [[rank_density(g, n, lo, hi) for lo, hi in spans] for g, n in tables]
    cache = Bounded(plan, ranks, cuts, oracle=policy == "predict")
    seen: list[list[int]] = [[] for _ in range(nclass)]
    at: dict[int, tuple[int, int]] = {}  # per block: its last use and class then
    hits = total = 0
    for i, chain in enumerate(plan.chains):
        if policy == "learn" and i % LEARN_EVERY == 0:
            ranks[:] = [rank_predict(sorted(g), spans) for g in seen]
            cache.ranked.rerank(ranks)
        hit, h_tok, p_tok = _count(plan, i, cache.present)
        if i >= plan.warmup:
            hits, total = hits + h_tok, total + p_tok
        nxt = plan.next_use[i]
        for d, node in enumerate(chain):
            if node in at:
                seen[at[node][1]].append(i - at[node][0])
            at[node] = (i, cls[i][d])
        for d in range(hit):
            cache.touch(chain[d], i, nxt[d], cls[i][d])
        protect = set(chain)
        for d in range(hit, len(chain)):
            if cache.oracle and nxt[d] == cache.never:
                break
            if cache.size >= capacity and not cache.make_room(i, ranks[cls[i][d]][0], protect):
                break
            cache.add(chain[d], i, nxt[d], cls[i][d])
    return hits / total


def one(args: tuple) -> tuple[str, str, int, float]:
    trace, variant, policy, capacity, know = args
    requests = make_variant(read_trace(trace), variant)
    outs = [r.output_length for r in requests]
    return variant, policy, capacity, run(build_plan(requests), capacity, policy, know, outs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--capacity", default="256,1024,4096,16384,65536")
    p.add_argument("--policy", default="predict,density")
    p.add_argument("--variant", default="none")
    p.add_argument("--know", default="count", help="count, prev, prev+out or within:F")
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args()
    tasks = [
        (a.trace, a.variant, pol, int(c), a.know)
        for pol in a.policy.split(",")
        for c in a.capacity.split(",")
    ]
    with ProcessPoolExecutor(a.jobs) as pool:
        for variant, pol, cap, rate in pool.map(one, tasks):
            print(f"{variant} {pol} {a.know} {cap}: {100 * rate:.2f}%", flush=True)


if __name__ == "__main__":
    main()
