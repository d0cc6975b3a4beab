"""tools/depth_lab.py: leaves ranked by depth, place in the chain and sharing.

A hand-made trace where the deepest leaf and the least recent one differ:
``deep`` keeps the old shallow chain that comes back and LRU does not (the
control), ``deep-of:1`` is LRU and ``deep-of:2`` sees both leaves; with room
for every block each rule holds the trace's ceiling.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from depth_lab import parse_rule, replay, run
from policy_lab import build_plan, run_heap
from test_bound_lab import _conversations

from prefixcache.traces.reader import TraceRequest


def _plan(chains: list[list[int]]):
    return build_plan([TraceRequest(i, 512 * len(c), 1, tuple(c)) for i, c in enumerate(chains)])


# an old one-block chain, a newer three-block one, a newcomer, the old chain again
OLD_COMES_BACK = [[1], [2, 3, 4], [5], [1]]


@pytest.mark.parametrize(
    ("rule", "rate"),
    [("lru", 0.0), ("deep", 0.5), ("deep-of:1", 0.0), ("deep-of:2", 0.5), ("shallow", 0.0)],
)
def test_the_deepest_leaf_goes_first_where_the_rule_says(rule: str, rate: float) -> None:
    assert run(_plan(OLD_COMES_BACK), 4, rule) == rate


def test_features_are_what_a_leaf_has_seen() -> None:
    plan = _plan([[1, 2, 3], [1, 2, 7], [1, 8], [9]])
    _, cache = replay(plan, 10, "kids")
    first, second = plan.chains[0][0], plan.chains[0][1]
    assert cache.kids_seen[first] == 2 and cache.kids_seen[second] == 2  # shared prefixes
    assert cache.kids_seen[plan.chains[0][2]] == 0
    assert cache.depth[plan.chains[1][2]] == 2
    assert cache.rest[first] == 1 and cache.rest[second] == 1  # last served [1, 8], [1, 2, 7]


@pytest.mark.parametrize("rule", ["deep", "stub-of:8", "kids", "gd-kids", "kids-age:4", "age:4"])
def test_with_room_for_every_block_each_rule_is_the_ceiling(rule: str) -> None:
    plan = build_plan(_conversations(3, 400))
    big = len(plan.parent)
    assert run(plan, big, rule) == run_heap(plan, big, "lru")
    assert run(plan, 30, rule) < run_heap(plan, big, "lru")  # control: a small cache


def test_a_bad_rule_is_named() -> None:
    for bad in ("deepest", "deep-of", "deep-of:0", "lru:3"):
        with pytest.raises(ValueError, match="unknown rule"):
            parse_rule(bad)
