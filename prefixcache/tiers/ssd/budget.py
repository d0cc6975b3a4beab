"""The SSD tier's write budget: a leaky bucket of bytes per day, kept beside the index.

Two kinds of record in the index's ``records`` database, written in the same
transaction that indexes a batch of payloads (so every process writing the
directory charges one bucket)::

    budget/bucket            level (bytes), Unix time of the level
    written/<YYYY-MM-DD>     payload file bytes written that UTC day

The bucket drains at ``ssd_write_budget`` bytes per day (spread evenly over
the day) and fills with every byte written; the budget left is the budget
minus the level. Over budget the stack defers or drops writes (stack.py).
"""

from __future__ import annotations

import struct
import time

import lmdb

_BUCKET = b"budget/bucket"
_WRITTEN = b"written/"
_LEVEL = struct.Struct("<dd")  # level, at
_U64 = struct.Struct("<Q")
DAY_SECONDS = 86400.0


def _day(now: float) -> bytes:
    return _WRITTEN + time.strftime("%Y-%m-%d", time.gmtime(now)).encode()


def level(txn: lmdb.Transaction, db: object, budget: int, now: float) -> float:
    """Bytes in the bucket at ``now`` (what the budget still counts as written)."""
    raw = txn.get(_BUCKET, db=db)
    if raw is None:
        return 0.0
    value, at = _LEVEL.unpack(raw)
    return max(0.0, value - budget * max(0.0, now - at) / DAY_SECONDS)


def written_today(txn: lmdb.Transaction, db: object, now: float) -> int:
    raw = txn.get(_day(now), db=db)
    return _U64.unpack(raw)[0] if raw is not None else 0


def charge(txn: lmdb.Transaction, db: object, nbytes: int, budget: int, now: float) -> None:
    """Add ``nbytes`` written at ``now`` to today's total and to the bucket."""
    if nbytes <= 0:
        return
    txn.put(_day(now), _U64.pack(written_today(txn, db, now) + nbytes), db=db)
    txn.put(_BUCKET, _LEVEL.pack(level(txn, db, budget, now) + nbytes, now), db=db)
