"""TierStack: the hot tier, then the lower tiers (ssd, remote) in order, and how blocks move.

Read path: a chain is matched through the tiers in order (``chain``, ``children``), and
lower-tier hits are promoted upward (``promote``, called off the request's path). Write
path: new blocks go into hot (``place``); under ``write_back`` a dirty block spills to the
lower tiers when hot evicts it (its dirty ancestors first), under ``write_through`` it is
put there at once, and an ``eager`` tier takes every block at once. With no lower tier
(``hot_cache_only``) an evicted block is discarded. A ``persist=False`` block stays hot only
(private). A metered tier's writes pass the stack's governor (admission, the write budget);
which tier lost which block, and why, is remembered to explain misses (losses.py).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Mapping, Sequence

from ..blocks import Block
from ..config import CacheConfig
from ..errors import MissReason
from ..hashing import TOKEN_BYTES
from ..memory import give_back
from ..stats import Stats
from .base import ChainEntry, CostGated, ListsChildren, Metered, Persistent, Tier
from .governor import WriteGovernor, watch
from .hot.tenants import hot_shares
from .hot.tier import CostHook, HotTier, ShedHook
from .losses import EVICTED, NOT_ADMITTED, Losses
from .pins import Pins
from .run_length import NO_HINTS, RunHints

_EVICTED_MEMORY = 65536  # keys remembered to tell "evicted" from "never stored"


class TierStack:
    """The tiers of one PrefixCache, hot first (not thread-safe: the facade locks)."""

    def __init__(
        self,
        config: CacheConfig,
        stats: Stats,
        lower: Sequence[Tier],
        shed: ShedHook | None = None,
        cost: CostHook | None = None,
    ):
        self.config, self.stats = config, stats
        self.pins = Pins()
        self.hot = HotTier(
            config.hot_max_bytes,
            self._on_hot_evict,
            shed,
            self.pins,
            cost,
            policy=config.eviction,
            tenants=hot_shares(config),
        )
        self.lower = list(lower)
        self.all: list[Tier] = [self.hot, *self.lower]
        through = config.write_policy == "write_through"
        self.on_store = [t for t in self.lower if t.eager or through]
        self.on_spill = [t for t in self.lower if not (t.eager or through)]
        self.spill_to = [
            *self.on_spill,
            *(t for t in self.on_store if isinstance(t, Metered)),
        ]  # + deferred
        self._evicted: deque[bytes] = deque(maxlen=_EVICTED_MEMORY)
        self._evicted_set: set[bytes] = set()
        self.private: set[bytes] = set()  # hot blocks stored with persist=False
        self.losses = Losses()  # which tier lost which recent keys, and why (explain)
        self.governor = WriteGovernor(config, stats, self.pins, self.hot, self.losses)
        watch(self.all, self.governor, self.losses)

    def named(self, name: str) -> Tier | None:
        return next((t for t in self.all if t.name == name), None)

    # -- read path -----------------------------------------------------------

    def chain(self, keys: Sequence[bytes]) -> tuple[list[ChainEntry], list[Tier]]:
        """Entries of ``keys`` held by some tier, root-first and consecutive, with
        the tier each is loaded from (the first that has it)."""
        entries: list[ChainEntry] = []
        owners: list[Tier] = []
        while len(entries) < len(keys):
            start = len(entries)
            for tier in self.all:
                got = tier.held(keys, start)
                if tier is not self.hot:  # a block hot holds too is loaded from hot
                    got = got[: next((i for i, e in enumerate(got) if e.key in self.hot), None)]
                if got:
                    break
            else:
                break
            entries += got
            owners += [tier] * len(got)
        return entries, owners

    def children(self, parent: bytes, near: bytes | None = None) -> list[tuple[ChainEntry, Tier]]:
        """Every entry some tier lists under ``parent`` (``near``: ListsChildren.children),
        with the tier it is loaded from (the first that lists it)."""
        out: dict[bytes, tuple[ChainEntry, Tier]] = {}
        for tier in self.all:
            for entry in tier.children(parent, near) if isinstance(tier, ListsChildren) else ():
                out.setdefault(entry.key, (entry, tier))
        return list(out.values())

    def above(self, tier: Tier) -> list[Tier]:
        """The lower tiers above ``tier`` (e.g. ssd above remote): where its hits
        are kept too; hot is not among them."""
        return self.lower[: self.lower.index(tier)] if tier in self.lower else []

    def contains(self, key: bytes) -> bool:
        return any(tier.contains(key) for tier in self.all)

    def missing_reason(self, key: bytes) -> MissReason:
        for tier in self.lower:  # e.g. the remote tier was unreachable
            why = tier.miss_reason(key) if isinstance(tier, CostGated) else None
            if why is not None:
                return why
        return MissReason.EVICTED if key in self._evicted_set else MissReason.NO_PREFIX

    def touch_chain(self, chain: Sequence[bytes]) -> None:
        """Mark a restored chain used (its lower-tier blocks are promoted apart: ``promote``)."""
        self.hot.touch(chain)
        for tier in self.lower:
            tier.touch([k for k in chain if k not in self.hot])

    def promotable(self, owner: Tier, nbytes: int) -> bool:
        """Whether a block of ``owner`` is worth loading to promote (hot has room, or a
        lower tier above ``owner`` keeps it too)."""
        return nbytes <= self.hot.room or bool(self.above(owner))

    def promote(self, owner: Tier, block: Block) -> None:
        """Keep a lower-tier hit in the tiers above ``owner``: hot while it has room
        (nothing is evicted for it), and e.g. ssd for a remote hit."""
        promoted = False
        if block.key not in self.hot and block.nbytes <= self.hot.room:
            promoted = self.hot.put(block)
        for tier in self.above(owner):
            promoted = tier.put(block) or promoted
        self.stats.num_promotions += promoted

    # -- write path ----------------------------------------------------------

    def place(
        self,
        blocks: Sequence[Block],
        *,
        upgrade: bool = False,
        persist: bool = True,
        continues: bool = False,
    ) -> None:
        """Place new blocks (root-first) according to the write policy; ``persist=False``
        keeps them hot only (never written to a lower tier); ``continues``: they extend
        a chain's end (:meth:`continues`), which counts as a second use."""
        warm = []
        for block in blocks:
            self.stats.kept(block.nbytes, upgrade=upgrade)
            self._evicted_set.discard(block.key)
            if not upgrade:
                self.governor.seen(block.key, 2 if continues else 1)
            waits = False
            for tier in self.on_store if persist else ():
                if self.finds(tier, block):
                    waits = self.governor.put(tier, block, last_chance=False) is None or waits
            if not persist:
                self.private.add(block.key)
            dirty = persist and (bool(self.on_spill) or waits)
            cold = block.parent != block.root and block.parent not in self.hot
            if cold and not self.lower:  # its parent is gone: no fetch can reach it
                self._on_hot_evict(block, False)
                continue
            if not self.hot.put(block, dirty=dirty, at_cold_end=cold):
                self.losses.lost("hot", [block.key], NOT_ADMITTED)
                if dirty:
                    self.spill(block)  # larger than the whole hot budget
            if not cold:
                warm.append(block.key)
        self.hot.touch(warm)  # ancestors end up more recent than descendants
        give_back.maybe()  # what the placing evicted (memory/give_back.py)

    def continues(self, blocks: Sequence[Block]) -> bool:
        """Whether new ``blocks`` (root-first) continue a chain from its end: the first
        one's parent is held and has no other full block under it (a conversation's
        next turn; a prompt branching off a shared prefix does not). Asked only when
        sightings are counted (``ssd_admit_after`` > 1 or a write budget)."""
        if self.governor.sightings is None or not blocks:
            return False
        parent = blocks[0].parent
        if parent == blocks[0].root or not self.contains(parent):
            return False
        new, size = {b.key for b in blocks}, TOKEN_BYTES * self.config.block_size
        kids = self.children(parent, blocks[0].tokens)
        return not any(e.key not in new and len(e.tokens) == size for e, _ in kids)

    def place_tail(self, block: Block, *, persist: bool = True, continues: bool = False) -> None:
        """Place a tail block (fewer tokens than a block, outside the chain) as a block.

        Tails are found through their parent (``ListsChildren.children``), so they go to
        the lower tiers that list children, as blocks do; with none, a tail
        whose parent is gone could never be found again and is not kept.
        """
        cold = block.parent != block.root and block.parent not in self.hot
        if not (cold and not self.lower):
            self.place([block], persist=persist, continues=continues)

    def replace(self, blocks: Sequence[Block]) -> None:
        """Swap stored blocks for fuller versions a later capture cut."""
        keys = [b.key for b in blocks]
        private = [k in self.private for k in keys]
        self.remove_lower(keys)
        self.hot.remove(keys)
        for block, hidden in zip(blocks, private, strict=True):
            self.place([block], upgrade=True, persist=not hidden)

    def spill(self, block: Block, *, last_chance: bool = True) -> None:
        """Write a dirty hot block to the tiers it is due on (``last_chance``: it is
        leaving hot, so a write the governor defers is dropped instead)."""
        if block.key in self.private:
            return
        spilled = False
        for tier in self.spill_to:
            due = tier in self.on_spill or not tier.contains(block.key)
            if due and self.finds(tier, block):
                spilled = bool(self.governor.put(tier, block, last_chance=last_chance)) or spilled
        self.stats.num_spills += spilled

    def flush(self) -> None:
        """Persist dirty hot blocks (pinned first; deferred ones stay dirty) and wait."""
        dirty = self.hot.take_dirty()
        for block in sorted(dirty, key=lambda b: (not self.pins.holds(b.key), b.index)):
            self.spill(block, last_chance=False)
        for tier in self.lower:
            tier.flush()

    def close(self) -> None:
        """Flush, then close every lower tier (each one, even if one fails: the first
        tier's failure is raised)."""
        with contextlib.ExitStack() as closing:
            for tier in reversed(self.lower):
                closing.callback(tier.close)
            self.flush()

    def drop_hot(self) -> int:
        """Let go of every hot block and kept sequence (a closed cache serves
        nothing: its RAM goes back); the lower tiers are closed and flushed by
        then, so nothing is spilled. Returns the bytes let go."""
        held = self.hot.nbytes
        self.hot.listener = None  # not removals a consumer should act on
        self.hot.remove([block.key for block in self.hot])
        self.hot.drop_recent(0)
        give_back.note_freed(held)
        return held

    def remove_lower(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` from every lower tier (queued copies land first, then go); every
        tier is asked, also one that does not know it holds them (the remote tier
        remembers only so many of its writes: the server may hold more)."""
        for tier in self.lower:
            if any(tier.contains(k) for k in keys):  # a queued copy must land first
                tier.flush()
            tier.remove(keys)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        for tier in self.lower:
            if isinstance(tier, CostGated):
                tier.note_prefill(num_tokens, seconds)

    def note_namespace(self, root: bytes, namespace_json: str, runs: RunHints = NO_HINTS) -> None:
        for tier in self.lower:
            if isinstance(tier, Persistent):
                tier.note_namespace(root, namespace_json, runs)

    def save_counters(self, root: bytes, delta: Mapping[str, object]) -> None:
        for tier in self.lower:
            if isinstance(tier, Persistent):
                tier.save_counters(root, delta)

    def snapshot(self) -> dict[str, object]:
        return {tier.name: tier.stats() for tier in self.all}

    def finds(self, tier: Tier, block: Block) -> bool:
        """Whether a lookup can find ``block`` on ``tier``: a tail only by its parent."""
        return isinstance(tier, ListsChildren) or block.num_tokens >= self.config.block_size

    def _on_hot_evict(self, block: Block, dirty: bool) -> None:
        give_back.note_freed(block.nbytes)  # freed here, or once its write is done
        self.losses.lost("hot", [block.key], EVICTED)  # before its spill: a write lands later
        if block.key in self.private:
            self.private.discard(block.key)
            self.stats.num_discarded += 1
        elif dirty:  # after its ancestors still dirty in hot (one deferred is marked again)
            for each in [*self.hot.take_dirty(above=block), block]:
                self.spill(each, last_chance=each is block)
        elif not self.lower:
            self.stats.num_discarded += 1
            if len(self._evicted) == self._evicted.maxlen:
                self._evicted_set.discard(self._evicted[0])
            self._evicted.append(block.key)
            self._evicted_set.add(block.key)
