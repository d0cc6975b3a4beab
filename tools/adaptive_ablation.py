"""``adaptive``'s parts switched off or changed, through the library's simulator (the ablation).

Each row is the library's ``adaptive`` policy (tiers/hot/adaptive.py) run by
``prefixcache simulate``'s Simulation on the whole trace, hot tier alone, with
some of its parts set here (nothing in the library changes):

- ``counts``: counts, aging and the sampled admission only: no leaf without
  state first, no inherited count, no ``lru`` regime, and LRU (every use
  counting one) until the reach is known instead of ``cost``'s victim;
- ``lean``: ``counts`` and a leaf whose state was shed goes first (hybrid);
- ``inherit``: ``lean`` and a hybrid chain's new end takes its parent's count,
  up to 4; ``inherit16``: up to 16; ``inherit-attention``: up to 4 on an
  attention shape too;
- ``lru-regime``: ``inherit`` and the ``lru`` regime at a reach of 0.9 and more;
- ``bias``: ``lru-regime`` and ``cost``'s bias (a block ranks higher by 1/16
  per 100% of recompute FLOPs above the least seen, credit.py's rule) in
  every regime; ``bias-counted``: not in the ``lru`` regime (in ``recent``
  and the counted ones); ``bias-recent``: in ``recent`` only;
- ``default``: the library as it is (``lru-regime`` and ``cost``'s victim
  while the reach is unknown, attention only); ``default16``: with the
  inherited count up to 16;
- ``lru``, ``cost``: the library's policies, for reference.

Hit rate over the last half, in %, one column per budget:

    python tools/adaptive_ablation.py TRACE --shape qwen3-next-80b-a3b --jobs 2
    python tools/adaptive_ablation.py TRACE --rows counts,default --budgets 16G,64G
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ProcessPoolExecutor

from prefixcache.blocks import Block
from prefixcache.settings import parse_bytes
from prefixcache.tiers.hot import adaptive, eviction
from prefixcache.tiers.hot.credit import EXTRA_LIFE
from prefixcache.traces.reader import read_trace
from prefixcache.traces.shapes import shape_named
from prefixcache.traces.simulator import SimConfig, Simulation

ROWS = (
    "counts",
    "lean",
    "inherit",
    "inherit16",
    "inherit-attention",
    "lru-regime",
    "bias",
    "bias-counted",
    "bias-recent",
    "default",
    "default16",
    "lru",
    "cost",
)
BUDGETS = "16G,64G,256G,1T,4T"
# row -> (leaf without state first, inherited count cap, on attention too,
#         lru regime, cost's victim in recent, cost bias in: regimes)
_PARTS = {
    "counts": (False, 1, False, False, False, ()),
    "lean": (True, 1, False, False, False, ()),
    "inherit": (True, 4, False, False, False, ()),
    "inherit16": (True, 16, False, False, False, ()),
    "inherit-attention": (True, 4, True, False, False, ()),
    "lru-regime": (True, 4, False, True, False, ()),
    "bias": (True, 4, False, True, False, ("recent", "keep", "sample", "full", "lru")),
    "bias-counted": (True, 4, False, True, False, ("recent", "keep", "sample", "full")),
    "bias-recent": (True, 4, False, True, False, ("recent",)),
    "default": (True, 4, False, True, True, ()),
    "default16": (True, 16, False, True, True, ()),
}


class Ablated(adaptive.AdaptivePolicy):
    """The library's policy with the parts a row sets (attributes of a subclass made
    per run: :func:`ablated`)."""

    lean_first = True
    on_attention = False
    bias_in: tuple[str, ...] = ()
    cost_of: Callable[[Block], float] = staticmethod(lambda block: 0.0)

    def __init__(self, *args, **kwargs) -> None:
        kwargs["states"] = kwargs.get("states", False) or self.on_attention
        super().__init__(*args, **kwargs)
        self._least = 0.0
        self._extra: dict[Hashable, float] = {}

    def added(self, key: Hashable) -> None:
        if self.bias_in:
            flops = self.cost_of(self.held[key])
            if flops > 0 and (self._least == 0 or flops < self._least):
                self._least = flops
            self._extra[key] = EXTRA_LIFE * (flops / self._least - 1.0) if self._least else 0.0
        super().added(key)

    def _rank(self, key: Hashable, uses: int) -> None:
        regime = self.regime
        if regime not in self.bias_in:
            super()._rank(key, uses)
            return
        base = uses if regime in ("keep", "sample", "full") else 1
        self.frequency.set(key, base + self._extra.get(key, 0.0))

    def removed(self, key: Hashable, parent: Hashable, *, lean: bool = False) -> None:
        self._extra.pop(key, None)
        super().removed(key, parent, lean=lean and self.lean_first)


@contextlib.contextmanager
def ablated(row: str, sim: Simulation) -> Iterator[None]:
    """``sim``'s adaptive policy with ``row``'s parts, the library's settings restored
    after (module attributes: the policy is made at the first block)."""
    lean, cap, attention, lru_regime, cost_victim, bias_in = _PARTS[row]
    saved = adaptive.INHERIT_UP_TO, adaptive.RECENT_FROM, eviction.AdaptivePolicy
    adaptive.INHERIT_UP_TO = cap
    if not lru_regime:
        adaptive.RECENT_FROM = 2.0  # a reach is at most 1: never reached
    parts = {"lean_first": lean, "on_attention": attention, "bias_in": bias_in}
    parts["cost_of"] = staticmethod(sim._cost)
    eviction.AdaptivePolicy = type("Ablated", (Ablated,), parts)  # type: ignore[misc]
    if not cost_victim:
        sim.hot.eviction.credits = None
    try:
        yield
    finally:
        adaptive.INHERIT_UP_TO, adaptive.RECENT_FROM, eviction.AdaptivePolicy = saved


def point(task: tuple) -> tuple[str, int, float]:
    """One row at one budget: (row, budget, hit rate over the last half)."""
    row, budget, shape_name, path, limit = task
    policy = row if row in ("lru", "cost") else "adaptive"
    sim = Simulation(SimConfig(shape_named(shape_name), budget, eviction=policy))
    requests = read_trace(path, limit=limit)
    if policy == "adaptive":
        with ablated(row, sim):
            result = sim.run(requests).as_json()
    else:
        result = sim.run(requests).as_json()
    return row, budget, 100 * float(result["hit_rate_last_half"])  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {','.join(ROWS)}")
    p.add_argument("--budgets", default=BUDGETS)
    p.add_argument("--limit", type=int, help="the first N requests only")
    p.add_argument("--jobs", type=int, default=1, help="processes")
    a = p.parse_args()
    rows, budgets = a.rows.split(","), [parse_bytes(b) for b in a.budgets.split(",")]
    for row in rows:
        if row not in ROWS:
            p.error(f"--rows: {row!r} is not one of {', '.join(ROWS)}")
    shape_named(a.shape)  # an unknown shape fails here, before any work
    tasks = [(row, b, a.shape, a.trace, a.limit) for row in rows for b in budgets]
    with ProcessPoolExecutor(a.jobs) as pool:
        got = {(r, b): rate for r, b, rate in pool.map(point, tasks)}
    print(f"{a.shape}, hot tier alone, hit rate over the last half (%): {a.budgets}")
    for row in rows:
        print(f"{row:18} " + " / ".join(f"{got[row, b]:.2f}" for b in budgets))


if __name__ == "__main__":
    main()
