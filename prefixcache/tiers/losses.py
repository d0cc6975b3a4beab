"""Losses: which tier lost which recent block keys, and why (to explain a miss).

A bounded record, most recent last: for each lost key, the tier it left last
and the cause: ``evicted`` (the hot tier's policy made room under its byte
cap, or a trim), ``not admitted`` (the tier refused to take it), ``not
written`` (a lower tier's write was refused or dropped as the block left
hot), ``removed`` (a removal the tier reported itself: the SSD tier's
evictions under ``ssd_max_bytes``, ``gc``, a quarantined block), ``session
ended`` (``end_session`` dropped it from every tier). A key stored again in
any tier leaves the record. It hears the tiers as a
:class:`~prefixcache.tiers.base.BlockListener` (``stored``, ``removed``), and
the stack and the controls name the causes they know (``lost``).

Memory: at most ``max_keys`` entries of a 16-byte key and a ``Loss`` record
shared by the keys lost together (about 135 bytes an entry in CPython, the
key included: 2.1 MiB full at the default; tools/bench_explain.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .base import ChainEntry

MAX_KEYS = 16384  # keys remembered; the oldest is forgotten first

EVICTED = "evicted"
NOT_ADMITTED = "not admitted"
NOT_WRITTEN = "not written"
REMOVED = "removed"
SESSION_ENDED = "session ended"


@dataclass(frozen=True, slots=True)
class Loss:
    """A block left ``tier`` (hot, ssd or remote) for ``cause`` at ``at`` (Unix time)."""

    tier: str
    cause: str
    at: float


class Losses:
    """The bounded record of lost block keys (thread-safe: the SSD writer reports
    its evictions from its own thread)."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._lost: OrderedDict[bytes, Loss] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lost)

    def of(self, key: bytes) -> Loss | None:
        """Where and why ``key`` was lost last, if it is remembered."""
        return self._lost.get(key)

    def lost(self, tier: str, keys: Sequence[bytes], cause: str) -> None:
        """``keys`` left ``tier`` for ``cause``."""
        if not keys:
            return
        loss = Loss(tier, cause, time.time())
        record = self._lost
        with self._lock:
            for key in keys:
                record[key] = loss
                record.move_to_end(key)
            while len(record) > self.max_keys:
                record.popitem(last=False)

    # -- BlockListener ----------------------------------------------------------

    def stored(self, tier: str, blocks: Sequence[ChainEntry]) -> None:
        with self._lock:
            for block in blocks:
                self._lost.pop(block.key, None)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        self.lost(tier, keys, REMOVED)
