"""Which hot block goes when RAM is full, and whether a newcomer comes in: one policy object.

Victims are always leaves (no child in the hot tier) and never pinned:

- ``lru``: the least recently used leaf.
- ``fifo``: the leaf stored first (a use does not renew it; fifo.py, O(log n)).
- ``cost``: among the least recently used leaves, the one of least credit
  (credit.py: recency plus what the block saves per byte).
- ``density``: the sampled leaf of least hit density (density.py); a newcomer
  worth less than that victim is refused, once the tier is full.
- ``frequency``: the leaf of least use count plus an aging floor (frequency.py,
  GreedyDual over counts); a newcomer not used more than the victim is refused.
- ``adaptive``: ``frequency``'s victim, with its aging and a sampled admission
  of new chains set by the cache's measured reach (adaptive.py, reach.py);
  ``cost``'s until the reach is known (not for a hybrid model).

The hot tier owns one :class:`Eviction`, hands it its own LRU order and
children map, and tells it what happens to its blocks (added, used,
removed); the policy keeps its own bookkeeping. ``prefixcache simulate`` runs
the same object through the same tier on payload-less blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ...blocks import Block
from ..pins import Pins
from .adaptive import AdaptivePolicy
from .credit import CostHook, Credits
from .density import DensityPolicy
from .fifo import FifoOrder
from .frequency import FrequencyPolicy

_CANDIDATES = 32  # least recently used leaves weighed by cost-aware eviction


class Eviction:
    """The hot tier's eviction and admission policy.

    Args:
        order: the tier's blocks, least recently used first (read, reordered
            only to move pinned leaves met on a scan to the recent end).
        children: the tier's parent key -> child keys map (read only).
        pins: the pins in force.
        held: the bytes the tier holds now.
        cost: recompute FLOPs of a block: ``cost`` eviction (None: not).
        policy: ``density``, ``frequency`` or ``adaptive`` (made at the first
            block: sized in blocks), ``fifo``, else ``lru`` or ``cost`` as ``cost``
            is given.
        states: blocks resume only where recurrent state was kept (the tier sheds
            state inside chains: a hybrid model).
    """

    def __init__(
        self,
        order: OrderedDict[bytes, Block],
        children: dict[bytes, dict[bytes, None]],
        pins: Pins,
        held: Callable[[], int],
        *,
        cost: CostHook | None = None,
        policy: str = "",
        states: bool = False,
    ) -> None:
        self.order, self.children, self.pins = order, children, pins
        self.states = states
        # adaptive ranks by cost's credits until its reach is known (not for a hybrid:
        # there a block's own cost is not what its eviction loses)
        weighs = cost is not None and not (policy == "adaptive" and states)
        self.credits = Credits(cost, held) if weighs else None
        self.policy = policy
        self.density: DensityPolicy | None = None
        self.frequency: FrequencyPolicy | None = None
        self.adaptive: AdaptivePolicy | None = None
        self.fifo = FifoOrder(children, pins) if policy == "fifo" else None
        self.num_refused = 0
        self.lean: set[bytes] = set()  # blocks whose state was shed: a leaf resumes nothing

    def shed(self, key: bytes) -> None:
        """``key`` lost its recurrent state (inside a chain): once a leaf, it goes first."""
        self.lean.add(key)

    def admits(self, block: Block, *, room: int, max_bytes: int) -> bool:
        """Whether ``block`` may come in (``room``: bytes free before it). Only the
        density and frequency policies refuse, a newcomer worth less than its victim,
        and the adaptive one, a new chain outside its sample."""
        if self.policy not in ("density", "frequency", "adaptive"):
            return True
        capacity = max(1, max_bytes // max(1, block.nbytes))
        if self.policy == "adaptive":
            if self.adaptive is None:
                self.adaptive = AdaptivePolicy(
                    capacity, self.order, self.children, states=self.states
                )
            full, pinned = block.nbytes > room, self.pins.holds(block.key)
            if self.adaptive.admits(block, full=full, pinned=pinned):
                return True
            self.num_refused += 1
            return False
        if self.density is None and self.policy == "density":
            self.density = DensityPolicy(capacity)
        if self.frequency is None and self.policy == "frequency":
            self.frequency = FrequencyPolicy(capacity, self.order, self.children)
        if block.nbytes <= room or self._worth_it(block):
            return True
        self.num_refused += 1
        return False

    def _worth_it(self, block: Block) -> bool:
        """Whether ``block`` is worth more than the victim it would push out."""
        if self.frequency is not None:
            least = self.frequency.least(_Excluded(self.pins))
            if least is None or self.frequency.newcomer(block.key) > least[0]:
                return True
            self.frequency.count(block.key)  # seen, though not kept
            return False
        assert self.density is not None
        if self.density.victim(_Excluded(self.pins), newcomer=block.key, depth=block.index):
            return True
        self.density.passed(block.key, depth=block.index)
        return False

    def added(self, block: Block, *, first_to_go: bool) -> None:
        if self.fifo is not None:
            self.fifo.added(block.key, first_to_go=first_to_go)
        if self.credits is not None:
            self.credits.added(block, first_to_go=first_to_go)
        if self.density is not None:
            self.density.not_leaf(block.parent)
            self.density.add(block.key, depth=block.index)
        if self.frequency is not None:
            self.frequency.set(block.key, self.frequency.count(block.key))
        if self.adaptive is not None:
            self.adaptive.added(block.key)

    def used(self, key: bytes) -> None:
        if self.credits is not None:
            self.credits.used(key)
        if self.density is not None:
            self.density.hit(key)
        if self.frequency is not None:
            self.frequency.set(key, self.frequency.count(key))
        if self.adaptive is not None:
            self.adaptive.used(key)

    def removed(self, block: Block) -> None:
        """``block`` left the tier (its key already out of the children map)."""
        if self.fifo is not None:
            self.fifo.removed(block.key, block.parent)
        if self.credits is not None:
            self.credits.removed(block.key)
        if self.density is not None:
            self.density.remove(block.key)
            if block.parent in self.order and not self.children.get(block.parent):
                self.density.became_leaf(block.parent)
        if self.frequency is not None:
            self.frequency.forget(block.key)
            if block.parent in self.order and not self.children.get(block.parent):
                self.frequency.leaf(block.parent)
        if self.lean:
            self.lean.discard(block.key)
        if self.adaptive is not None:
            self.adaptive.removed(block.key, block.parent, lean=block.parent in self.lean)

    def victim(self, keep: bytes | None = None) -> bytes | None:
        """The leaf to evict (never a pinned one, ``keep`` only if nothing else), or None.

        Pinned leaves met on an LRU scan move to the recent end, so the next scan
        does not walk them again.
        """
        if self.density is not None:
            return self.density.victim(_Excluded(self.pins, keep))
        if self.adaptive is not None and not (self.credits and self.adaptive.regime == "recent"):
            return self.adaptive.victim(_Excluded(self.pins, keep), _Excluded(self.pins))  # type: ignore[return-value]
        if self.frequency is not None:
            found = self.frequency.least(_Excluded(self.pins, keep)) or self.frequency.least(
                _Excluded(self.pins)
            )
            if found is None:
                return None
            self.frequency.evicted(found[0])
            return found[1]  # type: ignore[return-value]
        if self.fifo is not None:
            return self.fifo.victim()
        met, found = [], []
        want = 1 if self.credits is None else _CANDIDATES
        for key in self.order:
            if self.children.get(key):
                continue
            if self.pins.holds(key):
                met.append(key)
                continue
            found.append(key)
            if len(found) == want:
                break
        for key in met:
            self.order.move_to_end(key)
        if not found or self.credits is None:
            return found[0] if found else None
        others = [k for k in found if k != keep]
        return self.credits.victim(others or found)


class _Excluded:
    """Keys a density victim may not be: pinned ones, and ``keep`` (a block just put)."""

    __slots__ = ("keep", "pins")

    def __init__(self, pins: Pins, keep: bytes | None = None) -> None:
        self.pins, self.keep = pins, keep

    def __contains__(self, key: object) -> bool:
        return key == self.keep or (isinstance(key, bytes) and self.pins.holds(key))
