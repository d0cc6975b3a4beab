"""SSD write governance: admission by sightings and a daily write budget, decided in one place.

Before a block is put on a ``metered`` tier (the SSD tier), the stack asks
:meth:`WriteGovernor.decide`:

- **Admission** (``ssd_admit_after=N``): a block is written only once it has
  been used N times. A use is a store that keeps it new or a fetch that
  restores it, counted in :class:`Sightings` (a count-min sketch keyed by the
  block's chain key, so a block evicted before its second sighting is still
  admitted when it comes back: TinyLFU's idea). A store that continues a chain
  from its end (a conversation's next turn: ``TierStack.continues``) counts as two
  uses of its new blocks: the conversation was used again, and under
  ``write_back`` its newest blocks often leave hot before the next turn could
  restore them. Pinned blocks are admitted at once.
- **Admission by reach** (``ssd_admit_after=0``): the SSD's reach is measured
  from the sightings (hot/reach.py, its capacity in blocks: ``ssd_max_bytes``
  over the mean block written). Every block is written while the reach is
  unknown or 0.5 and more (the SSD holds most blocks until their reuse);
  below, a block seen before and a 10% sample of new ones (by key), and
  under 0.1 only blocks seen before: a small SSD keeps what comes back
  instead of every passing block, a large one loses no block used twice.
- **Budget** (``ssd_write_budget``, bytes per day, the tier's leaky bucket):
  over budget a write waits in hot (the block stays dirty and is tried again
  at its eviction or the next ``flush``) or, at its last chance (eviction), is
  dropped. Pinned blocks and shared prefixes (used twice or more, or a branch
  point in hot) go first: the last tenth of the budget is kept for them.

Counts ``ssd_writes_deferred`` and ``ssd_writes_skipped`` in the cache's stats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..blocks import Block
from ..config import CacheConfig
from ..stats import Stats
from .base import BlockListener, ChainEntry, Metered, ReportsEvents, Tier
from .hot.adaptive import FULL_FROM, KEEP_BELOW, SAMPLE, sampled
from .hot.reach import Reach
from .hot.tier import HotTier
from .losses import NOT_ADMITTED, NOT_WRITTEN, Losses
from .pins import Pins

_RESERVE = 0.1  # share of the budget only pinned blocks and shared prefixes may use


class Sightings:
    """Approximate use counts of block keys: a count-min sketch with aging.

    ``depth`` rows of ``2**width_bits`` uint8 counters; a key's columns are
    taken from its own bytes (keys are xxh3 digests: already uniform). Every
    ``10 * width`` additions all counters are halved, so old popularity fades.
    """

    def __init__(self, width_bits: int = 20, depth: int = 4) -> None:
        self._table = np.zeros((depth, 1 << width_bits), dtype=np.uint8)
        self._rows = np.arange(depth)
        self._mask = (1 << width_bits) - 1
        self._added = 0
        self._period = 10 << width_bits

    def _cols(self, key: bytes) -> np.ndarray:
        words = np.frombuffer(key[: 4 * len(self._rows)].ljust(16, b"\0"), dtype="<u4")
        return (words[: len(self._rows)] & self._mask).astype(np.intp)

    def add(self, key: bytes, uses: int = 1) -> int:
        """Count ``uses`` uses of ``key`` (conservative update); returns its new count."""
        cols = self._cols(key)
        cells = self._table[self._rows, cols]
        low = int(cells.min())
        count = min(low + uses, 255)
        self._table[self._rows, cols] = np.maximum(cells, count)
        self._added += 1
        if self._added >= self._period:
            self._table >>= 1
            self._added = 0
        return count

    def count(self, key: bytes) -> int:
        return int(self._table[self._rows, self._cols(key)].min())


class WriteGovernor:
    """Decides whether a block goes to a metered tier now, later, or never."""

    def __init__(
        self,
        config: CacheConfig,
        stats: Stats,
        pins: Pins,
        hot: HotTier,
        losses: Losses | None = None,
    ) -> None:
        self.admit_after = config.ssd_admit_after
        self.reserve = int(config.ssd_write_budget * _RESERVE)
        self.stats, self.pins, self.hot = stats, pins, hot
        # a write refused at its last chance, or dropped, is a loss (explain)
        self.losses = losses if losses is not None else Losses()
        by_reach = config.ssd_admit_after == 0
        counting = config.ssd_admit_after != 1 or config.ssd_write_budget > 0
        self.sightings = Sightings() if counting else None
        self.reach = Reach() if by_reach else None
        self.ssd_max_bytes = config.ssd_max_bytes
        self._written = [0, 0]  # blocks and bytes decided on: the mean block's size
        self.listener: BlockListener | None = None
        self.reported: set[str] = set()  # tiers whose accepted puts are reported here

    def put(self, tier: Tier, block: Block, *, last_chance: bool) -> bool | None:
        """Put ``block`` on a lower tier if allowed: True if accepted, False if not
        (dropped), None if it waits in hot (then marked dirty there)."""
        if isinstance(tier, Metered):
            verdict = self.decide(tier, block, last_chance=last_chance)
            if verdict is None:
                self.hot.mark_dirty(block.key)
            if verdict is False:
                self.losses.lost(tier.name, [block.key], NOT_ADMITTED)
            if not verdict:
                return verdict
        accepted = tier.put(block)
        if not accepted:
            self.losses.lost(tier.name, [block.key], NOT_WRITTEN)
        if accepted and self.listener is not None and tier.name in self.reported:
            self.listener.stored(tier.name, [block])
        return accepted

    def seen(self, key: bytes, uses: int = 1) -> None:
        """``key`` was used (stored new, or restored): ``uses`` times."""
        if self.sightings is None:
            return
        if self.reach is not None:
            seen = self.reach.seen_again if self.sightings.count(key) else self.reach.first_seen
            seen(key, self._capacity())
        self.sightings.add(key, uses)

    def _capacity(self) -> int:
        """The SSD's capacity in blocks of the mean size decided on so far."""
        num, nbytes = self._written
        return max(1, self.ssd_max_bytes * num // nbytes) if nbytes else 1

    def admitted(self, key: bytes) -> bool:
        if self.admit_after == 1 or self.pins.holds(key):
            return True
        count = self.sightings.count(key) if self.sightings is not None else 0
        if self.reach is None:
            return count >= self.admit_after
        share = self.reach.share
        if share is None or share >= FULL_FROM or count >= 2:
            return True
        return share >= KEEP_BELOW and sampled(key, SAMPLE)

    def decide(self, tier: Metered, block: Block, *, last_chance: bool) -> bool | None:
        """True: write it now; None: let it wait in hot; False: never (counted skipped).

        ``last_chance``: the block is leaving hot (evicted), so it cannot wait.
        """
        self._written[0] += 1
        self._written[1] += block.nbytes
        if not self.admitted(block.key):
            return self._refuse(last_chance, deferred=False)
        left = tier.write_budget_left()
        if left is None:
            return True
        need = block.nbytes if self._first(block) else block.nbytes + self.reserve
        return True if left >= need else self._refuse(last_chance, deferred=True)

    def _first(self, block: Block) -> bool:
        """Pinned blocks and shared prefixes: written before the others."""
        if self.pins.holds(block.key) or len(self.hot.children(block.key)) >= 2:
            return True
        return self.sightings is not None and self.sightings.count(block.key) >= 2

    def _refuse(self, last_chance: bool, *, deferred: bool) -> bool | None:
        if last_chance:
            self.stats.ssd_writes_skipped += 1
            return False
        self.stats.ssd_writes_deferred += deferred
        return None


def watch(tiers: Sequence[Tier], governor: WriteGovernor, listener: BlockListener) -> None:
    """Report every block stored in and removed from ``tiers`` to ``listener`` too (beside
    the listeners watching already): each tier that does not report its own (not
    ``ReportsEvents``) is reported by the stack."""
    if governor.listener is not None:
        listener = Listeners(governor.listener, listener)
    governor.listener = listener
    for tier in tiers:
        if isinstance(tier, ReportsEvents):
            tier.watch(listener)
        else:
            governor.reported.add(tier.name)


class Listeners:
    """Two listeners heard as one, in order (the stack's record of losses, then e.g.
    the KV events publisher)."""

    def __init__(self, first: BlockListener, second: BlockListener) -> None:
        self.first, self.second = first, second

    def stored(self, tier: str, blocks: Sequence[ChainEntry]) -> None:
        self.first.stored(tier, blocks)
        self.second.stored(tier, blocks)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        self.first.removed(tier, keys)
        self.second.removed(tier, keys)
