"""tools/ghost_lab.py: ARC on prefix chains (the ghost lists' experiment).

With room for every block ARC holds what LRU holds (the trace's ceiling);
under pressure a block coming back through the recency ghost grows the
recency list's target, and the cache never holds more than its capacity.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from ghost_lab import Arc, run
from policy_lab import build_plan, run_heap
from test_bound_lab import _conversations


def test_with_room_for_everything_arc_is_the_ceiling() -> None:
    plan = build_plan(_conversations(1, 600))
    big = len(plan.parent)
    assert run(plan, big, admit_ghosts=False) == run_heap(plan, big, "lru")
    assert run(plan, 40, admit_ghosts=False) < run_heap(plan, big, "lru")  # control


def test_a_recency_ghost_hit_grows_the_recency_target() -> None:
    plan = build_plan(_conversations(2, 300))
    arc = Arc(plan, 8)
    arc.ghosts[1][5] = None
    arc.ghosts[2][6] = None
    assert arc.arrive(5) == 2 and arc.p == 1.0
    assert arc.arrive(6) == 2 and arc.p == 0.0
    assert arc.arrive(7) == 0 and arc.p == 0.0  # no ghost: a first sighting
