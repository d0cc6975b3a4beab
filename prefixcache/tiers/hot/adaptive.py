"""Adaptive eviction and admission: use counts, aging and a sampled admission, set by the reach.

The victim is the leaf of least priority, a block's priority being a floor
plus its use count (frequency.py: GreedyDual over counts, every newcomer
admitted). How the floor moves and which newcomers come in follows the
cache's reach (reach.py: the share of first reuses that come within one
capacity of new blocks), re-measured all along:

- ``recent`` (until the reach is known: a fresh or small cache): the hot
  tier evicts by ``cost``'s credits (eviction.py, credit.py: recency with a
  longer life for blocks costlier to recompute; for a hybrid, LRU); the heap
  here keeps LRU's order, every use counting one.
- ``lru`` (reach 0.9 or more): the cache holds nearly every chain until its
  next use; counts would only keep old popular blocks past their use:
  recency alone (LRU).
- ``full`` (reach 0.5 to 0.9): the floor rises to each victim's priority
  (aging), every newcomer comes in. The cache holds most chains until their
  next use already: recency with a bias to reuse.
- ``sample`` (0.1 to 0.5): the cache holds a chain for less time than its
  typical next use. A new chain (a block under a branch point, seen for the
  first time) comes in only for a fixed sample of keys (``sample``, by the
  key's own bits); what comes in lives about 1/``sample`` times longer. A
  block seen before comes in always (its second sighting: TinyLFU's
  doorkeeper, here most of the gain: a chain that came back once comes back
  again more often), and so do the end of a held chain going on, a chain's
  first block and pinned blocks; the rest of a refused chain (its parent not
  held) does not.
- ``keep`` (under 0.1): no chain lasts until its next use whatever comes in;
  the hits left are on blocks used all the time (shared prefixes). No aging:
  the most used blocks stay (plain LFU).

For a hybrid model (``states``: a prompt resumes only where recurrent state
was kept) a leaf's eviction loses more than the leaf: a chain's end holds
the state the whole chain resumes from. So in the counted regimes (``keep``,
``sample``, ``full``) a block going on a held chain
takes its parent's count (up to ``INHERIT_UP_TO``: a conversation's turns),
and a block whose state was shed goes first once it is a leaf (it resumes
nothing: eviction.py tells this policy).

On Mooncake's conversation trace the reach picks, at each budget, a regime
within 0.1 point of the best one held fixed (docs/eviction.md,
tools/admission_lab.py).
O(log n) per use and per eviction, O(1) per admission.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Mapping

from ...blocks import Block
from .frequency import FrequencyPolicy
from .reach import Reach

KEEP_BELOW = 0.1  # reach under which nothing ages (plain LFU)
FULL_FROM = 0.5  # reach from which every newcomer comes in
RECENT_FROM = 0.9  # reach from which recency alone ranks (LRU)
_COUNTED = ("keep", "sample", "full")
INHERIT_UP_TO = 4  # a hybrid chain's new end takes its parent's count, up to this
SAMPLE = 0.1  # share of new chains admitted in the ``sample`` regime


def sampled(key: Hashable, share: float) -> bool:
    """Whether ``key`` is in the admitted sample: fixed per key (a chain refused
    stays refused at its next sighting, as long as it is a first one)."""
    if isinstance(key, bytes):
        value = int.from_bytes(key[:8].ljust(8, b"\0"), "little")
    else:
        value = hash(key) & 0xFFFFFFFFFFFFFFFF
    value = (value * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # spread short keys
    return value < share * (1 << 64)


class AdaptivePolicy:
    """Counts, a heap of leaves by priority and the reach; see the module docstring.

    Args:
        capacity: the cache's size in blocks, as first estimated (then the
            number of blocks held at each eviction).
        held: the keys held now (the tier's own map, read only).
        kids: parent key -> child keys held (read only).
        sample: share of new chains admitted in the ``sample`` regime, in (0, 1].
        reach: the reach estimator (a fresh one by default).
        states: blocks resume only where recurrent state was kept (a hybrid model).
    """

    def __init__(
        self,
        capacity: int,
        held: Mapping[Hashable, object],
        kids: Mapping,
        *,
        sample: float = SAMPLE,
        reach: Reach | None = None,
        states: bool = False,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample!r}")
        self.held, self.kids = held, kids
        self.capacity, self.sample = capacity, sample
        self.frequency = FrequencyPolicy(capacity, held, kids)
        self.reach = reach if reach is not None else Reach()
        self.num_sampled_out = 0
        self.states = states

    @property
    def regime(self) -> str:
        share = self.reach.share
        if share is None:
            return "recent"
        if share >= RECENT_FROM:
            return "lru"
        if share >= FULL_FROM:
            return "full"
        return "keep" if share < KEEP_BELOW else "sample"

    def _seen(self, key: Hashable) -> int:
        """Count a sighting of ``key`` (and its reuse distance); its count."""
        if key in self.frequency.uses:
            self.reach.seen_again(key, self.capacity)
        else:
            self.reach.first_seen(key, self.capacity)
        return self.frequency.count(key)

    def admits(self, block: Block, *, full: bool, pinned: bool) -> bool:
        """Count ``block``'s sighting; whether it may come in (``full``: it would
        push a block out; ``pinned``: it is pinned)."""
        uses = self._seen(block.key)
        if not full or pinned or block.index == 0 or self.regime != "sample":
            return True
        if block.parent not in self.held:
            return False  # the chain above it was refused: so is the rest of it
        if uses > 1 or not self.kids.get(block.parent) or sampled(block.key, self.sample):
            return True  # seen before, a held chain's end goes on, or in the sample
        self.num_sampled_out += 1
        return False

    def added(self, key: Hashable) -> None:
        block = self.held[key]
        uses = self.frequency.uses.get(key, 1)
        if self.states and self.regime in _COUNTED and self._continues(block):
            up = min(self.frequency.uses.get(block.parent, 1), INHERIT_UP_TO)
            if up > uses:  # the chain's end holds what the chain resumes: its count
                uses = self.frequency.uses[key] = up
        self._rank(key, uses)

    def _continues(self, block: Block) -> bool:
        """Whether ``block`` goes on a held chain (its parent is no shared branch point:
        at most one other child, a tail)."""
        return block.parent in self.held and len(self.kids.get(block.parent, ())) <= 2

    def used(self, key: Hashable) -> None:
        self._rank(key, self._seen(key))

    def _rank(self, key: Hashable, uses: int) -> None:
        if self.regime in _COUNTED:
            self.frequency.set(key, uses)
        else:
            self.frequency.set(key, 1)

    def removed(self, key: Hashable, parent: Hashable, *, lean: bool = False) -> None:
        """``key`` left (already out of ``held`` and of its parent's children);
        ``lean``: the parent holds no state, so as a leaf it resumes nothing and goes first."""
        self.frequency.forget(key)
        if parent in self.held and not self.kids.get(parent):
            if lean:
                self.frequency.first(parent)
            else:
                self.frequency.leaf(parent)

    def victim(
        self, exclude: Container[Hashable], fallback: Container[Hashable]
    ) -> Hashable | None:
        """The leaf of least priority not in ``exclude`` (else not in ``fallback``),
        or None; the floor rises to its priority unless the regime is ``keep``."""
        self.capacity = max(1, len(self.held))
        found = self.frequency.least(exclude) or self.frequency.least(fallback)
        if found is None:
            return None
        if self.regime != "keep":
            self.frequency.evicted(found[0])
        return found[1]
