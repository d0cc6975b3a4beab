"""Room on disk for the SSD index: reservations, LRU eviction, dead writers, reconcile.

A write first reserves its bytes in ``writing`` (key -> pid, thread id, file
bytes), evicting LRU leaves so the indexed plus reserved bytes stay under the
cap and the disk keeps its free headroom. A crash leaves at most ``writing``
records of a dead pid, cleared (with their temp files) by the next open or
write. ``reconcile`` is the full scan behind ``prefixcache gc``. Every
function runs inside the caller's write transaction.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import lmdb

from . import pinning
from .entries import Entries, decode_or_none, lru_key
from .files import payload_path, temp_owner, temp_path, unlink
from .records import pid_alive

WRITING = struct.Struct("<IQQ")  # pid, native thread id, file bytes
Wanted = tuple[bytes, int, int]  # key, file bytes, disk footprint


@dataclass(slots=True)
class Reservation:
    """Outcome of :func:`reserve`."""

    accepted: list[bytes] = field(default_factory=list)
    num_existing: int = 0  # already indexed or being written (maybe by another process)
    num_no_room: int = 0  # would not fit under the cap or the free-disk headroom
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
        if txn.get(key, db=entries.db["blocks"]) is None:
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
) -> Reservation:
    """Reserve room for ``wanted`` payloads, evicting LRU leaves (see the module docstring)."""
    res = Reservation()
    pinning.expire(txn, entries)
    clear_writes(txn, entries, dead(writing_records(txn, entries)))
    reserved = sum(WRITING.unpack(v)[2] for _, v in writing_records(txn, entries))
    for key, nbytes, footprint in wanted:
        busy = txn.get(key, db=entries.db["writing"]) is not None
        if busy or txn.get(key, db=entries.db["blocks"]) is not None:
            res.num_existing += 1
            continue
        budget = max_bytes - reserved - nbytes
        total = entries.counter(txn, b"total_bytes")
        if budget < 0 or free + total < min_free + footprint:
            res.num_no_room += 1  # would not fit even with everything evicted
            continue
        need = min_free + footprint - free  # disk bytes to free
        num, freed = evict(
            txn, entries, lambda tot, fr, b=budget, n=need: tot <= b and fr >= n, res.evicted
        )
        res.num_evicted += num
        free += freed
        if entries.counter(txn, b"total_bytes") > budget or free < min_free + footprint:
            res.num_no_room += 1
            continue
        txn.put(key, WRITING.pack(*owner, nbytes), db=entries.db["writing"])
        reserved += nbytes
        free -= footprint
        res.accepted.append(key)
    return res


def evict(
    txn: lmdb.Transaction,
    entries: Entries,
    enough: Callable[[int, int], bool],
    evicted: list[bytes] | None = None,
) -> tuple[int, int]:
    """Evict the least recently used leaf until ``enough(total, freed)``; (num, freed).

    Pinned leaves are not in the LRU, so they are never picked; keys evicted
    are appended to ``evicted``.
    """
    total, freed, num = entries.counter(txn, b"total_bytes"), 0, 0
    cur = txn.cursor(db=entries.db["lru"])
    while not enough(total, freed) and cur.first():
        key_in_lru = bytes(cur.key())
        key = key_in_lru[8:]
        meta = entries.meta(txn, key)
        if meta is None or lru_key(meta) != key_in_lru or entries.has_children(txn, key):
            cur.delete()  # stale record
            continue
        size = entries.drop(txn, meta)
        total, freed, num = total - size, freed + size, num + 1
        if evicted is not None:
            evicted.append(key)
    return num, freed


def reconcile(
    txn: lmdb.Transaction, entries: Entries, files: dict[bytes, str], temps: list[str]
) -> tuple[int, int]:
    """Remove orphan files and dangling or bad entries, then rebuild the links.

    Returns (orphan files removed, dangling entries removed).
    """
    live = {k for k, v in writing_records(txn, entries) if pid_alive(WRITING.unpack(v)[0])}
    dangling = 0
    for key, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=entries.db["blocks"])]:
        path = payload_path(entries.payloads, key)
        if decode_or_none(key, raw) is None or (key not in files and not os.path.lexists(path)):
            txn.delete(key, db=entries.db["blocks"])
            unlink(path)
            dangling += 1
    orphans = 0
    for key, path in files.items():
        if key not in live and txn.get(key, db=entries.db["blocks"]) is None:
            unlink(path)
            orphans += 1
    for path in temps:
        if not pid_alive(temp_owner(path)):
            unlink(path)
            orphans += 1
    entries.rebuild(txn)
    return orphans, dangling
