"""Pins in the SSD index: records that keep blocks out of the LRU, within one transaction.

The ``pins`` database maps a block key to its pin's end (Unix time, inf:
never) and the block's file bytes (counted against ``ssd_max_bytes`` when a
pin is asked for). A pinned leaf is not in ``lru``, so eviction never sees it
(every insert and drop of an entry keeps that true); an expired pin is
removed, and its block put back into the LRU, by :func:`expire` (run before
each eviction) or when it is met. Pins live in the index, so they survive a
restart and hold for every process of the directory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import lmdb

from .entries import PIN, Entries


def pin(
    txn: lmdb.Transaction, entries: Entries, items: Sequence[tuple[bytes, int]], until: float
) -> None:
    """Pin (key, file bytes) items until ``until``; their leaves leave the LRU."""
    for key, file_bytes in items:
        txn.put(key, PIN.pack(until, file_bytes), db=entries.db["pins"])
        meta = entries.meta(txn, key)
        if meta is not None:
            entries.lru_delete(txn, meta)


def unpin(txn: lmdb.Transaction, entries: Entries, keys: Sequence[bytes]) -> int:
    """End these pins (leaves go back into the LRU); how many there were."""
    num = 0
    for key in keys:
        if txn.delete(key, db=entries.db["pins"]):
            num += 1
            _back_to_lru(txn, entries, key)
    return num


def expire(txn: lmdb.Transaction, entries: Entries) -> int:
    """Remove pins that have ended (their leaves go back into the LRU); how many."""
    now = time.time()
    ended = [bytes(k) for k, v in txn.cursor(db=entries.db["pins"]) if PIN.unpack(v)[0] <= now]
    for key in ended:
        txn.delete(key, db=entries.db["pins"])
        _back_to_lru(txn, entries, key)
    return len(ended)


def records(txn: lmdb.Transaction, entries: Entries) -> dict[bytes, tuple[float, int]]:
    """Every pin record in force now: key -> (end, file bytes); read-only."""
    now = time.time()
    out = {}
    for key, value in txn.cursor(db=entries.db["pins"]):
        until, file_bytes = PIN.unpack(value)
        if until > now:
            out[bytes(key)] = (until, file_bytes)
    return out


def _back_to_lru(txn: lmdb.Transaction, entries: Entries, key: bytes) -> None:
    meta = entries.meta(txn, key)
    if meta is not None and not entries.leaf_pinned(txn, meta):
        entries.lru_put(txn, meta)
