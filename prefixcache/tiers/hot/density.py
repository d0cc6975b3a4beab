"""Hit-density eviction and admission: keep the blocks that earn the most hits per block held.

A block's worth is its expected hits per unit of time it would still occupy
the cache (LHD, Beckmann et al., NSDI'18), learnt online from the traffic.
Blocks fall into classes by how many times they were used (1, 2, 3, 4 or
more) and how deep in a chain they sit (shallow or deep). Per class and age
(time since the last use, counted in block uses, in log-spaced buckets) the
policy counts reuses and evictions, and every so often turns them into a
density table: for a block of that class that reached that age, expected
reuses over expected remaining time held.

Reuses are counted whether or not the block was still held: a block that
comes back after its eviction is remembered (its last use and class, for a
bounded number of evicted blocks), so the table learns reuses at ages the
cache does not reach yet. Without that a small cache never sees a block
survive long enough to be reused and stays LRU forever.

The victim is the leaf of least density among a random sample of leaves; a
newcomer whose own density at age 0 is below that victim's is not admitted.
On conversation traffic this keeps some conversations long enough for their
next turn instead of every conversation too briefly (LRU), and it falls back
to recency where recency pays. O(1) per use, O(samples) per eviction.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Container, Hashable

SUB = 8  # age buckets per doubling
NUM_AGES = SUB * 40
NUM_USES = 6  # classes by uses: 1, 2, 3-4, 5-8, 9-16, 17 or more
DEEP = 8  # blocks at this chain index or beyond are "deep"
SAMPLES = 32
DECAY = 0.9  # weight of the counts so far at each new table
GHOSTS = 64  # evicted blocks remembered per block of capacity (at most MAX_GHOSTS)
MAX_GHOSTS = 1 << 20


def bucket(age: int) -> int:
    """The log-spaced bucket of ``age`` (exact below ``SUB``)."""
    if age < SUB:
        return age
    shift = age.bit_length() - 4  # SUB = 8: keep three bits below the top one
    return min(SUB * (shift + 1) + ((age >> shift) & (SUB - 1)), NUM_AGES - 1)


def _bucket_age(b: int) -> float:
    """A representative age of bucket ``b`` (its middle)."""
    if b < SUB:
        return float(b)
    shift = b // SUB - 1
    low = (SUB + b % SUB) << shift
    return low + ((1 << shift) - 1) / 2


_AGES = [_bucket_age(b) for b in range(NUM_AGES)]


class DensityPolicy:
    """Hit-density victims and admission over the leaves of a block cache.

    Args:
        capacity: the cache's size in blocks (sets the table period and ghosts kept).
        classes: split blocks by uses (False: one class, ablation).
        depth_classes: split blocks by chain depth too (False: ablation).
        bypass: refuse a newcomer worth less than the victim (False: ablation).
        ghosts: remember evicted blocks' reuses (False: ablation, plain LHD).
        seed: the sampling's random seed.
    """

    def __init__(
        self,
        capacity: int,
        *,
        classes: bool = True,
        depth_classes: bool = True,
        bypass: bool = True,
        ghosts: bool = True,
        seed: int = 0,
    ) -> None:
        self.period = max(512, capacity)  # uses between two tables
        self.max_ghosts = min(GHOSTS * capacity, MAX_GHOSTS) if ghosts else 0
        self.classes, self.depth_classes, self.bypass = classes, depth_classes, bypass
        self.random = random.Random(seed)
        self.clock = 0
        self.num_classes = 2 * NUM_USES
        self.reuses = [[0.0] * NUM_AGES for _ in range(self.num_classes)]
        self.evictions = [[0.0] * NUM_AGES for _ in range(self.num_classes)]
        # before any table: LRU (density falls with age)
        self.density = [[1.0 / (1 + a) for a in _AGES] for _ in range(self.num_classes)]
        self._state: dict[Hashable, list[int]] = {}  # held: [last use clock, class]
        self._ghosts: OrderedDict[Hashable, tuple[int, int, int]] = OrderedDict()
        self._leaves: list[Hashable] = []
        self._leaf_at: dict[Hashable, int] = {}
        self._since_table = 0

    def __len__(self) -> int:
        return len(self._state)

    def _class(self, uses: int, depth: int) -> int:
        if not self.classes:
            return 0
        c = min((uses - 1).bit_length(), NUM_USES - 1)
        return c + NUM_USES if depth >= DEEP and self.depth_classes else c

    def _tick(self) -> None:
        self.clock += 1
        self._since_table += 1
        if self._since_table >= self.period:
            self._since_table = 0
            self._table()

    def add(self, key: Hashable, *, depth: int) -> None:
        """``key`` entered the cache as a leaf, at chain index ``depth``."""
        ghost = self._ghosts.pop(key, None)
        uses = 1
        if ghost is not None:  # back after its eviction: a reuse at that age
            last, c, uses = ghost
            self.reuses[c][bucket(self.clock - last)] += 1
            uses += 1
        self._tick()
        self._state[key] = [self.clock, self._class(uses, depth), uses, depth]
        self.became_leaf(key)

    def hit(self, key: Hashable) -> None:
        """``key``, held, was used again."""
        state = self._state[key]
        self.reuses[state[1]][bucket(self.clock - state[0])] += 1
        self._tick()
        state[2] += 1
        state[0], state[1] = self.clock, self._class(state[2], state[3])

    def remove(self, key: Hashable) -> None:
        """``key`` left the cache (evicted): counted as an eviction at its age."""
        last, c, uses, _depth = self._state.pop(key)
        self.evictions[c][bucket(self.clock - last)] += 1
        self.not_leaf(key)
        if self.max_ghosts:
            self._ghosts[key] = (last, c, uses)
            if len(self._ghosts) > self.max_ghosts:
                self._ghosts.popitem(last=False)

    def passed(self, key: Hashable, *, depth: int) -> None:
        """``key`` was used but not admitted: remembered as if held and evicted at once."""
        if not self.max_ghosts or key in self._state:
            return
        ghost = self._ghosts.pop(key, None)
        uses = 1
        if ghost is not None:
            last, c, uses = ghost
            self.reuses[c][bucket(self.clock - last)] += 1
            uses += 1
        self._tick()
        c = self._class(uses, depth)
        self.evictions[c][0] += 1
        self._ghosts[key] = (self.clock, c, uses)
        if len(self._ghosts) > self.max_ghosts:
            self._ghosts.popitem(last=False)

    def became_leaf(self, key: Hashable) -> None:
        if key not in self._leaf_at:
            self._leaf_at[key] = len(self._leaves)
            self._leaves.append(key)

    def not_leaf(self, key: Hashable) -> None:
        at = self._leaf_at.pop(key, None)
        if at is None:
            return
        last = self._leaves.pop()
        if last != key:
            self._leaves[at] = last
            self._leaf_at[last] = at

    def worth(self, key: Hashable) -> float:
        """The density of held block ``key`` now."""
        last, c = self._state[key][:2]
        return self.density[c][bucket(self.clock - last)]

    def victim(self, protect: Container[Hashable], *, newcomer: Hashable = None, depth: int = 0):
        """The sampled leaf of least density not in ``protect``; None if there is none,
        or if ``newcomer`` (about to enter at chain index ``depth``) is worth less."""
        leaves, best, least = self._leaves, None, float("inf")
        if not leaves:
            return None
        state, density, clock = self._state, self.density, self.clock
        for _ in range(SAMPLES):
            key = leaves[self.random.randrange(len(leaves))]
            if key in protect:
                continue
            last, c = state[key][:2]
            d = density[c][bucket(clock - last)]
            if d < least:
                best, least = key, d
        if best is None or newcomer is None or not self.bypass:
            return best
        ghost = self._ghosts.get(newcomer)
        uses = 1 if ghost is None else ghost[2] + 1
        mine = self.density[self._class(uses, depth)][0]
        return best if mine >= least else None

    def _table(self) -> None:
        for c in range(self.num_classes):
            reuses, evictions, dens = self.reuses[c], self.evictions[c], self.density[c]
            hits_above = events_above = weighted_above = 0.0
            for b in range(NUM_AGES - 1, -1, -1):
                n = reuses[b] + evictions[b]
                hits_above += reuses[b]
                events_above += n
                weighted_above += n * _AGES[b]
                life = weighted_above - _AGES[b] * events_above + events_above
                dens[b] = hits_above / life if life > 0 else 0.0
                reuses[b] *= DECAY
                evictions[b] *= DECAY
