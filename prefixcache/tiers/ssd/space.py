"""Room on disk for the SSD index: reservations, LRU eviction, dead writers, reconcile.

A write first reserves its bytes in ``writing`` (key -> pid, thread id, file
bytes), evicting LRU leaves so the indexed plus reserved bytes stay under the
cap and the disk keeps its free headroom. With tenant shares (shares.py) the
leaf evicted is the least recently used one of the tenant most over its floor
(the tier's LRU leaf once none is over its floor: the cap holds before any
floor), and a write that would take its tenant over its cap first evicts that
tenant's own leaves; one that cannot fit under the cap is refused, counted.
A crash leaves at most ``writing`` records of a dead pid, cleared (with
their temp files) by the next open or write. ``reconcile`` is the full scan
behind ``prefixcache gc``. Every function runs inside the caller's write
transaction.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import lmdb

from ...blocks import BlockMeta
from . import pinning, runfiles, shares
from .entries import Entries, decode_or_none, lru_key
from .files import payload_path, temp_owner, temp_path, unlink
from .records import pid_alive

WRITING = struct.Struct("<IQQ")  # pid, native thread id, file bytes
Wanted = tuple[bytes, int, int, str, int]  # key, file bytes, disk footprint, tenant, blocks
Pick = Callable[[lmdb.Transaction, Entries], BlockMeta | None]  # the next leaf to evict


@dataclass(slots=True)
class Reservation:
    """Outcome of :func:`reserve`."""

    accepted: list[bytes] = field(default_factory=list)
    # blocks (a run file counts each of its blocks):
    num_existing: int = 0  # already indexed or being written (maybe by another process)
    num_no_room: int = 0  # would not fit under the cap or the free-disk headroom
    num_over_cap: int = 0  # would not fit under its tenant's cap (tenant shares)
    num_evicted: int = 0
    evicted: list[bytes] = field(default_factory=list)  # keys of the blocks evicted


def writing_records(txn: lmdb.Transaction, entries: Entries) -> list[tuple[bytes, bytes]]:
    return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=entries.db["writing"])]


def dead(records: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in records if not pid_alive(WRITING.unpack(v)[0])]


def clear_writes(
    txn: lmdb.Transaction, entries: Entries, records: list[tuple[bytes, bytes]]
) -> None:
    """Remove these (dead) writes: their temp files, unindexed payloads and records."""
    for key, value in records:
        if txn.get(key, db=entries.db["writing"]) != value:
            continue
        pid, tid, _ = WRITING.unpack(value)
        final = payload_path(entries.payloads, key)
        unlink(temp_path(final, pid, tid))
        indexed = txn.get(key, db=entries.db["blocks"]) is not None
        if not indexed and runfiles.file_record(txn, entries.db, key) is None:
            unlink(final)
        txn.delete(key, db=entries.db["writing"])


def reserve(
    txn: lmdb.Transaction,
    entries: Entries,
    wanted: Sequence[Wanted],
    owner: tuple[int, int],
    max_bytes: int,
    min_free: int,
    free: int,
    limits: shares.Limits | None = None,
) -> Reservation:
    """Reserve room for ``wanted`` payloads, evicting leaves (see the module docstring)."""
    res = Reservation()
    pinning.expire(txn, entries)
    clear_writes(txn, entries, dead(writing_records(txn, entries)))
    reserved = sum(WRITING.unpack(v)[2] for _, v in writing_records(txn, entries))
    mine: dict[str, int] = {}  # bytes reserved here per tenant
    pick = tenant_leaf(limits, mine) if limits else lru_leaf
    for key, nbytes, footprint, tenant, blocks in wanted:
        busy = txn.get(key, db=entries.db["writing"]) is not None
        if busy or txn.get(key, db=entries.db["blocks"]) is not None:
            res.num_existing += blocks
            continue
        wants = nbytes + mine.get(tenant, 0)  # with what this call reserved for it
        if limits and not _under_cap(txn, entries, limits, tenant, wants, res):
            res.num_over_cap += blocks
            shares.add(txn, entries.db["meta"], tenant, {"num_refused": blocks})
            continue
        budget = max_bytes - reserved - nbytes
        total = entries.counter(txn, b"total_bytes")
        fits = budget >= 0 and free + total >= min_free + footprint
        need = min_free + footprint - free  # disk bytes to free
        if fits:
            enough = _enough(budget, need)
            num, freed = evict(txn, entries, enough, res.evicted, pick)
            res.num_evicted += num
            free += freed
        if not fits or entries.counter(txn, b"total_bytes") > budget or free < min_free + footprint:
            res.num_no_room += blocks  # would not fit with every evictable leaf gone
            shares.add(txn, entries.db["meta"], tenant, {"num_refused": blocks})
            continue
        txn.put(key, WRITING.pack(*owner, nbytes), db=entries.db["writing"])
        reserved += nbytes
        mine[tenant] = mine.get(tenant, 0) + nbytes
        free -= footprint
        res.accepted.append(key)
    return res


def _enough(budget: int, need: int) -> Callable[[int, int], bool]:
    """Whether eviction made room: indexed bytes within ``budget``, ``need`` freed."""
    return lambda total, freed: total <= budget and freed >= need


def _under_cap(
    txn: lmdb.Transaction,
    entries: Entries,
    limits: shares.Limits,
    tenant: str,
    nbytes: int,
    res: Reservation,
) -> bool:
    """Whether ``nbytes`` more fit under ``tenant``'s cap, once its own least recently
    used leaves are evicted for them (counted as cap evictions)."""
    cap = limits.caps.get(tenant)
    if cap is None:
        return True
    if nbytes > cap:
        return False
    held = shares.figures(txn, entries.db["meta"], tenant)["nbytes"]
    while held + nbytes > cap and (meta := own_leaf(txn, entries, tenant)) is not None:
        held -= entries.drop(txn, meta, evicted=True, cap=True)
        res.evicted.append(meta.key)
        res.num_evicted += 1
    return held + nbytes <= cap


def evict(
    txn: lmdb.Transaction,
    entries: Entries,
    enough: Callable[[int, int], bool],
    evicted: list[bytes] | None = None,
    pick: Pick | None = None,
) -> tuple[int, int]:
    """Evict the leaf ``pick`` names (default: the least recently used) until
    ``enough(total, freed)``; (num, freed).

    Pinned leaves are not in the LRU, so they are never picked; keys evicted
    are appended to ``evicted``.
    """
    total, freed, num = entries.counter(txn, b"total_bytes"), 0, 0
    while not enough(total, freed):
        meta = (pick or lru_leaf)(txn, entries)
        if meta is None:
            break
        size = entries.drop(txn, meta, evicted=True)
        total, freed, num = total - size, freed + size, num + 1
        if evicted is not None:
            evicted.append(meta.key)
    return num, freed


def lru_leaf(txn: lmdb.Transaction, entries: Entries) -> BlockMeta | None:
    """The least recently used unpinned leaf of the tier (stale records dropped)."""
    cur = txn.cursor(db=entries.db["lru"])
    while cur.first():
        key_in_lru = bytes(cur.key())
        key = key_in_lru[8:]
        meta = entries.meta(txn, key)
        if meta is None or lru_key(meta) != key_in_lru or entries.has_children(txn, key):
            cur.delete()  # stale record
            continue
        return meta
    return None


def own_leaf(txn: lmdb.Transaction, entries: Entries, tenant: str) -> BlockMeta | None:
    """The least recently used unpinned leaf of ``tenant`` (stale records dropped)."""
    start = shares.prefix(tenant)
    cur = txn.cursor(db=entries.db["tenant_lru"])
    while cur.set_range(start) and bytes(cur.key()).startswith(start):
        entry = bytes(cur.key())
        lru = entry[len(start) :]
        meta = entries.meta(txn, lru[8:])
        if meta is None or meta.tenant != tenant or lru_key(meta) != lru:
            cur.delete()  # stale record
        elif entries.has_children(txn, meta.key):
            cur.delete()
        else:
            return meta
    return None


def tenant_leaf(limits: shares.Limits, pending: Mapping[str, int] | None = None) -> Pick:
    """Picks the least recently used leaf of the tenant most over its floor under
    ``limits`` (with the bytes ``pending`` for it: reserved, not indexed yet); None
    if that tenant has none left, but bytes pending (its own writes are what is
    over: they get no room, no other tenant gives for them); the tier's LRU leaf
    when no tenant is over its floor."""
    pending = {} if pending is None else pending

    def pick(txn: lmdb.Transaction, entries: Entries) -> BlockMeta | None:
        for tenant in limits.over_floor(txn, entries.db["meta"], pending):
            meta = own_leaf(txn, entries, tenant)
            if meta is not None or pending.get(tenant):
                return meta
        return lru_leaf(txn, entries)

    return pick


def reconcile(
    txn: lmdb.Transaction, entries: Entries, files: dict[bytes, str], temps: list[str]
) -> tuple[int, int]:
    """Remove orphan files and dangling or bad entries, then rebuild the links.

    Returns (orphan files removed, dangling entries removed).
    """
    live = {k for k, v in writing_records(txn, entries) if pid_alive(WRITING.unpack(v)[0])}
    dangling = 0
    for key, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=entries.db["blocks"])]:
        run = runfiles.ref(txn, entries.db, key)
        file = key if run is None else run.file_key
        path = payload_path(entries.payloads, file)
        if decode_or_none(key, raw) is None or (file not in files and not os.path.lexists(path)):
            txn.delete(key, db=entries.db["blocks"])
            if run is None:  # a run file goes with its last block (the rebuild)
                unlink(path)
            dangling += 1
    orphans = 0
    for key, path in files.items():
        indexed = txn.get(key, db=entries.db["blocks"]) is not None
        if key not in live and not indexed and runfiles.file_record(txn, entries.db, key) is None:
            unlink(path)
            orphans += 1
    for path in temps:
        if not pid_alive(temp_owner(path)):
            unlink(path)
            orphans += 1
    entries.rebuild(txn)
    return orphans, dangling
