"""Hot tier: a byte-bounded LRU of blocks holding live mx.arrays (contiguous, or views of a run).

Eviction never strands a child: only blocks with no child in the hot tier are
evicted (leaves first). Touching a chain deepest-first keeps ancestors more
recent than their descendants, so the LRU end is almost always a leaf.
Before any block goes, interval snapshots go: a block inside a chain (one
child) is replaced by its ``shed`` version (without recurrent state), oldest
first, so snapshots are evicted before the chain they sit on. Chain ends and
branch points (two children or more) keep theirs: that is where prompts resume.
Which leaf goes (``lru``, ``fifo``, ``cost``, ``density``, ``frequency``, ``adaptive``),
and whether a newcomer comes in, is the policy object's choice (eviction.py); with tenant
shares, the victim is the tenant's whose bytes are most over its floor (tenants.py). Kept
whole, sequences (recent.py) count in ``nbytes`` and go before any snapshot or block.
Not thread-safe by itself: the facade holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any

from ...blocks import Block
from ..base import BlockListener, ListsChildren, ReportsEvents, Tier, TierReader
from ..pins import Pins
from .credit import CostHook
from .eviction import Eviction
from .reader import HostViews, HotReader
from .recent import Kept, RecentSequences, kept_whole
from .runs import HotRuns
from .tenants import TenantShares

EvictHook = Callable[[Block, bool], None]  # (block, dirty)
ShedHook = Callable[[Block], "Block | None"]  # the block without its snapshot, or None


class HotTier(ListsChildren, ReportsEvents, Tier):
    """The hot tier: blocks as live arrays, a byte-bounded LRU (leaves go first)."""

    name = "hot"
    resident = True

    def __init__(
        self,
        max_bytes: int,
        on_evict: EvictHook | None = None,
        shed: ShedHook | None = None,
        pins: Pins | None = None,
        cost: CostHook | None = None,
        policy: str = "",
        tenants: TenantShares | None = None,
    ):
        self.max_bytes = max_bytes
        self.pins = pins if pins is not None else Pins()
        self.listener: BlockListener | None = None
        self.on_evict = on_evict
        self.shed = shed
        self.num_shed = 0
        self._sheddable: dict[bytes, None] = {}  # keys of one child held, oldest first
        self.nbytes = 0
        self.num_evictions = 0
        self._lru: OrderedDict[bytes, Block] = OrderedDict()
        self._children: dict[bytes, dict[bytes, None]] = {}  # parent -> child keys
        self._dirty: set[bytes] = set()
        self.views = HostViews()  # what restores copy from (hot_reader.py)
        self.runs = HotRuns(self._lru, self.views)  # runs charged by buffer (runs.py)
        self.recent = RecentSequences()  # sequences kept whole (recent.py), in ``nbytes``
        self.tenants = tenants  # floors and caps per tenant (tenants.py), or None
        self.eviction = Eviction(
            self._lru,
            self._children,
            self.pins,
            lambda: self.nbytes,
            cost=cost,
            policy=policy,
            states=shed is not None,
        )

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def __iter__(self) -> Iterator[Block]:
        return iter(list(self._lru.values()))

    def get(self, key: bytes) -> Block | None:
        return self._lru.get(key)

    def contains(self, key: bytes) -> bool:
        return key in self._lru

    def entry(self, key: bytes) -> Block | None:
        return self._lru.get(key)

    def payload_names(self, key: bytes) -> Container[str] | None:
        block = self._lru.get(key)
        return None if block is None else block.arrays

    def held(self, keys: Sequence[bytes], start: int) -> list[Block]:
        get = self._lru.get
        out = []
        for key in keys[start:] if start else keys:
            block = get(key)
            if block is None:
                break
            out.append(block)
        return out

    def children(self, parent: bytes, near: bytes | None = None) -> list[Block]:
        """Hot blocks whose parent is ``parent``: full blocks and tails (partial reuse)."""
        kids = self._children.get(parent)
        return [self._lru[k] for k in kids] if kids else []

    def reader(self, keys: Sequence[bytes]) -> TierReader:
        return HotReader(self._lru, self.views, keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        return sum(self.pop(key) is not None for key in keys)

    def watch(self, listener: BlockListener) -> None:
        self.listener = listener

    def pinned_nbytes(self) -> int:
        """Bytes of the pinned blocks held here (pins in force now)."""
        return sum(b.nbytes for k, b in self._lru.items() if self.pins.holds(k))

    def stats(self) -> dict[str, int]:
        return {
            "num_blocks": len(self._lru),
            "nbytes": self.nbytes,
            "pinned_bytes": self.pinned_nbytes(),
            "max_bytes": self.max_bytes,
            "num_evictions": self.num_evictions,
            "num_shed_snapshots": self.num_shed,
            "num_refused": self.eviction.num_refused,
            "num_recent": len(self.recent),
            "recent_bytes": self.recent.nbytes,
            "num_recent_hits": self.recent.num_hits,
            "run_dead_bytes": self.runs.dead_bytes(),
            "num_runs_compacted": self.runs.num_compacted,
        }

    @property
    def room(self) -> int:
        """Bytes blocks may still take without evicting a block (kept sequences go first)."""
        return self.max_bytes - self.nbytes + self.recent.nbytes

    def keep_recent(self, item: Kept) -> None:
        """Keep a sequence whole (recent.py) unless a kept one starts with it. The
        caller checks it fits the room blocks leave (``room``): it evicts no block,
        only older kept sequences where they no longer fit beside it."""
        if not self.recent.covered(item.root, item.data):
            self.nbytes += item.nbytes - self.recent.add(item)
            self.drop_recent(self.max_bytes)

    def keep_whole(
        self, root: bytes, data: bytes, keys: Sequence[bytes], cache: Sequence[Any]
    ) -> None:
        """Keep ``cache``'s arrays whole (recent.py) where its layers allow and they
        fit the room blocks leave."""
        if kept := kept_whole(root, data, keys, cache, self.room):
            self.keep_recent(kept)

    def drop_recent(self, max_bytes: int) -> None:
        """Drop kept sequences, least recently used first, until at most ``max_bytes``
        are held or none is left."""
        self.nbytes -= self.recent.drop_until(self.nbytes - max_bytes)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark a chain (given root-first) as just used, ancestors most recent."""
        for key in reversed(list(keys)):
            if key in self._lru:
                self._lru.move_to_end(key)
                self.eviction.used(key)
                if self.tenants is not None:  # its tenant's own recency
                    self.tenants.used(key)

    def prepare_views(self, blocks: Iterable[Block]) -> None:
        """Make now, on the storing thread, the host views a restore of ``blocks``
        copies from (those still held here): off the path of the fetch that first
        restores them (in a server, the next request's time to first token)."""
        for block in blocks:
            if self._lru.get(block.key) is block:
                self.views.of(block)

    def put(self, block: Block, *, dirty: bool = False, at_cold_end: bool = False) -> bool:
        """Insert a block, evicting LRU leaves to stay under ``max_bytes``.

        Returns False, inserting nothing, when the block alone is larger than
        the whole budget. A block evicted again by its own insertion (the only
        leaf of a chain larger than the budget) went through ``on_evict``.
        ``at_cold_end`` inserts at the LRU's evict-first end: a block whose parent is not hot is the
        first to go, so a chain larger than the budget keeps its root-most part.
        """
        if block.key in self._lru:
            self.touch([block.key])
            return True
        shares = self.tenants  # None: no tenant shares (tenants.py), nothing charged
        tenant = shares.claim(block) if shares is not None else None
        room = self.max_bytes - self.nbytes
        if (
            block.nbytes > self.max_bytes
            or (tenant is not None and not tenant.fits(block.nbytes))
            or not self.eviction.admits(block, room=room, max_bytes=self.max_bytes)
        ):
            if tenant is not None:
                tenant.num_refused += 1
            return False
        self._lru[block.key] = block
        self.eviction.added(block, first_to_go=at_cold_end)
        if at_cold_end:
            self._lru.move_to_end(block.key, last=False)
        kids = self._children.setdefault(block.parent, {})
        kids[block.key] = None
        self._inside(block.parent, len(kids))
        self._inside(block.key, len(self._children.get(block.key, ())))
        self.nbytes += self.runs.charge(block)
        if dirty:
            self._dirty.add(block.key)
        if self.listener is not None:
            self.listener.stored(self.name, [block])
        if shares is not None and tenant is not None:  # over its cap: its own blocks go
            shares.added(block, tenant, first_to_go=at_cold_end)
            while own := shares.over_cap(tenant, block.key, self._children, self.pins):
                self._evict(own)
        self.evict_to(self.max_bytes, keep=block.key)
        return True

    def evict_to(self, max_bytes: int, *, keep: bytes | None = None) -> int:
        """Evict LRU leaves until at most ``max_bytes`` are held; returns how many.
        ``keep``: a block just put, evicted only when no other leaf can go (its
        chain's later blocks would have no parent to go under)."""
        num = 0
        self.drop_recent(max_bytes)
        while self.nbytes > max_bytes:
            if self._shed_one():
                continue
            if self.tenants is not None:
                leaf = self.tenants.victim(keep, self._children, self.pins)
            else:
                leaf = self.eviction.victim(keep)
            if leaf is None:  # every leaf is pinned (or, with tenants, under its floor)
                break
            self._evict(leaf)
            num += 1
        return num

    def evict_chain(self, keys: Iterable[bytes], max_bytes: int) -> int:
        """Evict ``keys`` (a chain, deepest first) while over ``max_bytes``, each while
        a leaf and not pinned; keys hot does not hold (a prompt's tail) are passed."""
        num = 0
        self.drop_recent(max_bytes)
        for key in keys:
            if self.nbytes <= max_bytes or self._children.get(key) or self.pins.holds(key):
                break
            if key in self._lru:
                self._evict(key)
                num += 1
        return num

    def _inside(self, key: bytes, num_children: int) -> None:
        """Keep ``_sheddable`` to held keys of one child: a chain's end is what a next
        turn resumes from, a branch point what every branch does."""
        if self.shed is not None and num_children == 1 and key in self._lru:
            self._sheddable[key] = None
        elif self.shed is not None:
            self._sheddable.pop(key, None)

    def _shed_one(self) -> bool:
        """Drop the snapshot of the oldest block inside a chain that has one (O(1))."""
        while self._sheddable:
            key = next(iter(self._sheddable))
            del self._sheddable[key]
            block = self._lru[key]
            lean = self.shed(block) if self.shed is not None else None
            if lean is not None:
                self._lru[key] = lean  # same key: its LRU place is kept
                self.nbytes -= block.nbytes - lean.nbytes
                if self.tenants is not None:
                    self.tenants.resized(key, lean.nbytes - block.nbytes)
                self.num_shed += 1
                self.eviction.shed(key)
                return True
        return False

    def _evict(self, key: bytes) -> None:
        dirty = key in self._dirty
        block = self.pop(key, evicted=True)
        self.num_evictions += 1
        if block is not None and self.on_evict is not None:
            self.on_evict(block, dirty)

    def pop(self, key: bytes, *, evicted: bool = False) -> Block | None:
        block = self._lru.pop(key, None)
        if block is None:
            return None
        if self.tenants is not None:
            self.tenants.released(block, evicted=evicted)
        self.views.forget(key)
        self.nbytes -= self.recent.forget(key)
        self.nbytes -= self.runs.release(block)
        self._dirty.discard(key)
        self._sheddable.pop(key, None)
        kids = self._children[block.parent]
        del kids[key]
        self._inside(block.parent, len(kids))
        if not kids:
            del self._children[block.parent]
        self.eviction.removed(block)
        if self.listener is not None:
            self.listener.removed(self.name, [key])
        return block

    def mark_dirty(self, key: bytes) -> None:
        """``key`` is to be spilled when evicted (a write deferred until then)."""
        if key in self._lru:
            self._dirty.add(key)

    def mark_clean(self, key: bytes) -> None:
        """``key`` is stored below already (nothing to spill when it goes)."""
        self._dirty.discard(key)

    def take_dirty(self, above: Block | None = None) -> list[Block]:
        """Dirty blocks (not yet on SSD) root-first, marked clean: all, or the ancestors
        of ``above`` up to the first clean one (written before it: a block on disk
        whose parent is not cannot be reached from its root after a crash)."""
        if above is None:
            keys = list(self._dirty)
        else:
            keys, key = [], above.parent
            while key in self._dirty:  # a root is no block: never dirty
                keys.append(key)
                key = self._lru[key].parent
        self._dirty.difference_update(keys)
        return sorted((self._lru[k] for k in keys if k in self._lru), key=lambda b: b.index)

    def drop_superseded(self, block: Block) -> None:
        """Drop tails that ``block`` extends and holds every payload of: cutting
        ``block`` back gives the same (a window the ring overwrote in part does not)."""
        for other in self.children(block.parent):
            if (
                other.num_tokens < block.num_tokens
                and block.tokens.startswith(other.tokens)
                and other.arrays.keys() <= block.arrays.keys()
            ):
                self.remove([other.key])
