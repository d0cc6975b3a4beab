"""Fair shares of the hot tier per tenant: a floor each keeps, a cap each may hold.

A tenant is a name: the ``tenant`` a store gives, else its session's owner,
else its ``cache_salt``, else the empty name (blocks stored with none).

- **Charging.** A block is charged, whole, to the tenant that put it into
  the tier first; a later store by another tenant walking the same block (a
  shared prefix with no salt between them) does not move or split the
  charge. Charged once, the tenants' bytes add up to the tier's, so floors
  and caps are fractions of one budget; a tenant that reuses another's
  block rides on it for free, as with shared pages in an OS's memory cgroups.
  A block that leaves and comes back (promoted from a lower tier) is charged
  to its owner again while its key is remembered.
- **Eviction.** When the tier is over its budget, the victim comes from the
  tenant the most bytes over its floor (a max-heap of tenants, O(log T)),
  its least recently used unpinned leaf; a tenant at or under its floor
  loses nothing while another is over it. Below the floors (``trim_hot`` to
  less than they add up to) the largest tenant gives: the budget comes first.
- **Caps.** A block that would take its tenant over its cap evicts that
  tenant's own leaves first (the new block last, if nothing else can go);
  a block larger than its tenant's cap alone is refused.

Every block stored, evicted (and of those, for its tenant's cap), removed by
a verb (``end_session``, a superseded tail) and refused is counted per
tenant: stored = held + evicted + removed. Not thread-safe: the facade's lock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from ...blocks import Block
from ...shares_config import tier_shares
from ..pins import Pins

Kids = Mapping[bytes, Mapping[bytes, None]]  # the tier's parent key -> child keys
DEFAULT = ""  # the tenant of blocks stored with none
COUNTERS = ("num_stored", "num_evicted", "num_cap_evictions", "num_removed", "num_refused")
_REMEMBERED = 65536  # keys of blocks gone from hot whose owner is kept


@dataclass(slots=True)
class Tenant:
    """One tenant's share of the tier: its floor and cap, what it holds, its counters,
    and its blocks least recently used first."""

    name: str
    floor: int = 0
    cap: int | None = None
    nbytes: int = 0
    num_stored: int = 0
    num_evicted: int = 0
    num_cap_evictions: int = 0
    num_removed: int = 0
    num_refused: int = 0
    serial: int = 0  # of its current entry on the heap of tenants
    order: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def fits(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits under the cap alone (else it is refused)."""
        return self.cap is None or nbytes <= self.cap

    def stats(self) -> dict[str, int]:
        return {
            "num_blocks": len(self.order),
            "nbytes": self.nbytes,
            "floor_bytes": self.floor,
            "cap_bytes": -1 if self.cap is None else self.cap,
            "num_stored": self.num_stored,
            "num_evicted": self.num_evicted,
            "num_cap_evictions": self.num_cap_evictions,
            "num_removed": self.num_removed,
            "num_refused": self.num_refused,
        }


def tenant_shares(floors: Mapping[str, int], caps: Mapping[str, int]) -> TenantShares | None:
    """The shares of a tier with these floors and caps; None when neither is set
    (nothing is charged: the tier runs as it does without tenants)."""
    return TenantShares(floors, caps) if floors or caps else None


def hot_shares(config: object) -> TenantShares | None:
    """The hot tier's shares from a config's ``hot_tenant_floors`` and ``_caps``."""
    return tenant_shares(*tier_shares(config, "hot"))


class TenantShares:
    """Per-tenant charges, floors and caps of one hot tier.

    Args:
        floors: tenant -> bytes it keeps whatever others do (checked by CacheConfig).
        caps: tenant -> bytes it may hold at most.
    """

    def __init__(self, floors: Mapping[str, int], caps: Mapping[str, int]) -> None:
        self.floors, self.caps = dict(floors), dict(caps)
        self._tenants: dict[str, Tenant] = {}
        self._owner: dict[bytes, str] = {}  # held key -> the tenant charged for it
        self._gone: OrderedDict[bytes, str] = OrderedDict()  # left hot: owner remembered
        self._heap: list[tuple[int, int, str]] = []  # (-(bytes over floor), serial, tenant)
        self._serial = 0
        self.current: str | None = None  # the tenant the store under way charges
        for name in {*floors, *caps}:
            self.tenant(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tenants

    def tenant(self, name: str) -> Tenant:
        """The record of ``name`` (made with its configured floor and cap if new)."""
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = Tenant(name, self.floors.get(name, 0), self.caps.get(name))
            self._changed(t)
        return t

    @contextmanager
    def charging(self, name: str) -> Iterator[None]:
        """Charge the blocks put while inside to tenant ``name``."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    # -- what the hot tier tells -----------------------------------------------

    def claim(self, block: Block) -> Tenant:
        """The tenant a new ``block`` is charged to: the store's under way, else its
        owner's when it was here before, else the one it carries (``Block.tenant``)."""
        name = self.current
        if name is None:
            name = self._gone.get(block.key, block.tenant or DEFAULT)
        return self.tenant(name)

    def added(self, block: Block, t: Tenant, *, first_to_go: bool) -> None:
        self._owner[block.key] = t.name
        self._gone.pop(block.key, None)
        t.order[block.key] = None
        if first_to_go:
            t.order.move_to_end(block.key, last=False)
        t.nbytes += block.nbytes
        t.num_stored += 1
        self._changed(t)

    def used(self, key: bytes) -> None:
        name = self._owner.get(key)
        if name is not None:
            self._tenants[name].order.move_to_end(key)

    def resized(self, key: bytes, delta: int) -> None:
        """Held block ``key`` now takes ``delta`` bytes more (a shed snapshot: fewer)."""
        t = self._tenants[self._owner[key]]
        t.nbytes += delta
        self._changed(t)

    def released(self, block: Block, *, evicted: bool) -> None:
        """``block`` left the tier: evicted, or removed by a verb."""
        name = self._owner.pop(block.key)
        t = self._tenants[name]
        del t.order[block.key]
        t.nbytes -= block.nbytes
        if evicted:
            t.num_evicted += 1
        else:
            t.num_removed += 1
        self._gone[block.key] = name
        if len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)
        self._changed(t)

    # -- victims -----------------------------------------------------------------

    def over_cap(self, t: Tenant, keep: bytes, kids: Kids, pins: Pins) -> bytes | None:
        """While ``t`` holds more than its cap: its block to evict (``keep``, the block
        just put, only if no other can go), counted as a cap eviction; else None.
        ``kids``: the tier's parent -> children map; ``pins``: the pins in force."""
        if t.cap is None or t.nbytes <= t.cap:
            return None
        key = self._lru_leaf(t, keep, kids, pins)
        if key is None and not kids.get(keep) and not pins.holds(keep):
            key = keep
        if key is not None:
            t.num_cap_evictions += 1
        return key

    def victim(self, keep: bytes | None, kids: Kids, pins: Pins) -> bytes | None:
        """The block to evict: the least recently used evictable leaf of the tenant most
        over its floor that has one (``keep``, the block just put, if it is its
        tenant's only one). When none has (a trim below the floors, or the leaves
        of those over theirs all pinned), the largest tenant's: the tier's budget
        holds before any floor. None if nothing can go."""
        skipped, found, heap = [], None, self._heap
        while heap and found is None:
            neg, serial, name = heap[0]
            t = self._tenants[name]
            if serial != t.serial:
                heapq.heappop(heap)  # stale: its bytes changed since
                continue
            if neg >= 0:
                break  # no tenant is over its floor
            found = self._lru_leaf(t, keep, kids, pins)
            if found is None:
                skipped.append(heapq.heappop(heap))
        for item in skipped:
            heapq.heappush(heap, item)
        can_keep = keep is not None and not kids.get(keep) and not pins.holds(keep)
        if found is None and can_keep and self._over(keep):  # type: ignore[arg-type]
            return keep
        if found is None:  # O(T log T), only below the floors
            for t in sorted(self._tenants.values(), key=lambda t: (-t.nbytes, t.name)):
                found = self._lru_leaf(t, keep, kids, pins)
                if found is not None:
                    break
        return keep if found is None and can_keep else found

    def _over(self, key: bytes) -> bool:
        t = self._tenants[self._owner[key]]
        return t.nbytes > t.floor

    def _lru_leaf(self, t: Tenant, keep: bytes | None, kids: Kids, pins: Pins) -> bytes | None:
        """``t``'s least recently used unpinned leaf other than ``keep``. Pinned leaves
        met on the way move to its recent end (the next scan skips them), as in
        the tier's own LRU scan; ancestors come after their leaves (``touch``)."""
        met, found = [], None
        for key in t.order:
            if key == keep or kids.get(key):
                continue
            if not pins.holds(key):
                found = key
                break
            met.append(key)
        for key in met:
            t.order.move_to_end(key)
        return found

    def _changed(self, t: Tenant) -> None:
        self._serial += 1
        t.serial = self._serial
        heapq.heappush(self._heap, (t.floor - t.nbytes, t.serial, t.name))
        if len(self._heap) > 4 * len(self._tenants) + 64:  # drop the stale entries
            self._heap = [(x.floor - x.nbytes, x.serial, x.name) for x in self._tenants.values()]
            heapq.heapify(self._heap)

    def counters(self) -> dict[str, int]:
        """Each tenant's counters as ``"<tenant>.<counter>"`` (the saved counters' form,
        nested one level; ``prefixcache stats`` splits at the last dot)."""
        return {
            f"{name}.{key}": value
            for name, t in self._tenants.items()
            for key, value in t.stats().items()
            if key in COUNTERS
        }

    def stats(self) -> dict[str, dict[str, int]]:
        """Each tenant's figures (``stats()["tenants"][name]["hot"]``)."""
        return {name: t.stats() for name, t in sorted(self._tenants.items())}

    def check(self, name: str) -> Tenant:
        """``name``'s record; ValueError naming it if no config or store named it."""
        t = self._tenants.get(name)
        if t is None:
            known = ", ".join(repr(n) for n in sorted(self._tenants)) or "none"
            raise ValueError(f"unknown tenant {name!r}: known tenants are {known}")
        return t
