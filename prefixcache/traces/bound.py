"""An upper bound on any one-tier policy's hit rate, in bytes, recurrent state counted.

For a shape with recurrent state (a hybrid) Belady's rule is no bound: a hit
needs a chain's K/V *and* a checkpoint of its state at the block it resumes
from, and the two have different sizes (farthest next use is not optimal
with sizes). This is a relaxation instead (the byte-time bound of caching
with sizes, "PFOO-U"): whatever a policy does, the bytes it holds at each
request's arrival are at most the budget, so over a window of arrivals they
sum to at most budget x arrivals. A hit of request ``i`` resuming at block
``j`` needs, held without a break since their last possible insertion:

- the K/V of blocks ``0..j``, each since the last earlier request holding it
  in its chain (a block comes in only with a request that has it);
- for a hybrid, a checkpoint at block ``j``: one was made by an earlier
  request whose last full block it is (the simulator's rule), and it is held
  since the last earlier request that had block ``j`` in its chain.

Those holding times, each charged over the window, are disjoint per block
and per checkpoint; so the hits a policy gets cost at most budget x window.
Each request picks one resume depth: the largest hit tokens for that budget
is a multiple-choice knapsack, bounded above by its linear relaxation
(greedy on each request's upper hull). The bound is that relaxation's value,
the least over a few windows. It holds for every online or offline policy
under the simulator's semantics (a short last block is not stored on a
hybrid; state is kept only at a request's last full block); it is not a
policy, and no policy need reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from .optimum import _plan
from .reader import TRACE_BLOCK_TOKENS, TraceRequest
from .shapes import ModelShape

_WINDOWS = (0.0, 0.5, 0.75, 0.875, 1.0)  # window starts, as shares of the first half


def bound_hit_rates(
    requests: Sequence[TraceRequest],
    shape: ModelShape,
    budget: int,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    *,
    states: str = "every",
) -> tuple[float, float]:
    """Upper bounds on the hit rate over all ``requests`` and over their last half.

    ``states="new"`` counts a state only where a prompt's last full block is
    new to the trace (what the simulator keeps when nothing is evicted: with
    an unbounded budget, its ceiling); it is no bound under a budget.

    Raises:
        ValueError: ``budget`` is below 1, or ``states`` is not every or new.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 byte, got {budget!r}")
    if states not in ("every", "new"):
        raise ValueError(f"states must be 'every' or 'new', got {states!r}")
    n, half = len(requests), len(requests) // 2
    rates = []
    for first, starts in ((0, [0]), (half, [int(w * half) for w in _WINDOWS])):
        options = _options(requests, shape, block_tokens, starts, first, states == "new")
        prompt = sum(sum(r.block_tokens(block_tokens)) for r in requests[first:])
        best = min(_relaxed(options, k, budget * (n - s)) for k, s in enumerate(starts))
        rates.append(best / max(1, prompt))
    return rates[0], rates[1]


def _options(
    requests: Sequence[TraceRequest],
    shape: ModelShape,
    block_tokens: int,
    starts: list[int],
    first: int,
    new_only: bool,
) -> list[list[tuple[list[int], int]]]:
    """Per request from ``first`` on, its resume depths: (cost per window, hit tokens).

    A cost is the bytes the hit holds times the arrivals of the window they
    are held over (window ``k``: arrivals from ``starts[k]`` on).
    """
    chains, _, _ = _plan(requests)
    state = shape.checkpoint_bytes
    last = [-1] * (1 + max((n for c in chains for n in c), default=0))
    made = bytearray(len(last))  # a checkpoint was made here (a request's last full block)
    out = []
    for i, (chain, request) in enumerate(zip(chains, requests, strict=True)):
        tokens = request.block_tokens(block_tokens)
        stored = len(chain)
        if state and tokens and tokens[-1] < block_tokens:
            stored -= 1  # a short last block without its state resumes nothing
        if i >= first:
            out.append(_depths(i, chain[:stored], tokens, shape, last, made, starts))
        if state and stored and not (new_only and last[chain[stored - 1]] >= 0):
            made[chain[stored - 1]] = 1
        for node in chain:
            last[node] = i
    return out


def _depths(i, chain, tokens, shape, last, made, starts) -> list[tuple[list[int], int]]:
    """(cost per window, hit tokens) of each depth request ``i`` could resume at."""
    state = shape.checkpoint_bytes
    cum, out, hit = [0] * len(starts), [], 0
    for d, node in enumerate(chain):
        if last[node] < 0:
            break  # never seen before: no policy holds it
        since = [i - max(last[node], s - 1) for s in starts]  # arrivals it is held over
        cum = [c + shape.block_bytes(tokens[d]) * a for c, a in zip(cum, since, strict=True)]
        hit += tokens[d]
        if not state:
            out.append((cum, hit))
        elif made[node]:
            out.append(([c + state * a for c, a in zip(cum, since, strict=True)], hit))
    return out


def _relaxed(options, k: int, room: float) -> float:
    """The linear relaxation's hit tokens with ``room`` byte-arrivals in window ``k``."""
    steps: list[tuple[float, int, int]] = []  # (tokens per byte-arrival, cost, tokens)
    for depths in options:
        steps += _hull_steps([(0, 0), *((costs[k], hit) for costs, hit in depths)])
    steps.sort(key=lambda s: -s[0])
    total = 0.0
    for slope, cost, hit in steps:
        if cost > room:
            return total + slope * room
        room, total = room - cost, total + hit
    return total


def _hull_steps(points: list[tuple[int, int]]) -> list[tuple[float, int, int]]:
    """Steps along the upper concave hull of (cost, tokens) from (0, 0), slopes falling."""
    points.sort(key=lambda p: (p[0], -p[1]))
    hull: list[tuple[int, int]] = [points[0]]
    for c, v in points[1:]:
        if v <= hull[-1][1]:
            continue  # costs more, hits no more
        while len(hull) >= 2:
            (c1, v1), (c2, v2) = hull[-2], hull[-1]
            if (v2 - v1) * (c - c1) <= (v - v1) * (c2 - c1):
                hull.pop()  # the middle point is under the chord
            else:
                break
        hull.append((c, v))
    return [((v2 - v1) / (c2 - c1), c2 - c1, v2 - v1) for (c1, v1), (c2, v2) in pairwise(hull)]
