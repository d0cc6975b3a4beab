"""What the SSD tier notes about its reads: served loads (counted, touched for the
LRU), payloads that cannot be read now, and corrupt blocks (quarantined).

Called by the tier's own ``load`` and by its readers (stream.py, readers.py),
on the caller's thread. Mixed into :class:`~prefixcache.tiers.ssd.tier.SsdTier`,
whose ``index``, ``path``, ``_counts``, ``_lock``, ``_touches`` and
``report_removed`` it uses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from .health import Counts
from .index import SsdIndex
from .writes import TierError

logger = logging.getLogger(__name__)


class SsdReadNotes:
    """The read-side bookkeeping of an SSD tier (mixed into ``SsdTier``)."""

    index: SsdIndex
    path: str
    _counts: Counts
    _lock: threading.Lock
    _touches: set[bytes]

    def report_removed(self, keys: Sequence[bytes]) -> None: ...

    def read_error(self, key: bytes, error: OSError) -> None:
        """A payload that cannot be read now (EMFILE, EIO...): a miss, not a verdict."""
        first = self._counts.add("num_read_errors") == 1
        log = logger.warning if first else logger.debug
        log("SSD tier %s: cannot read block %s: %s", self.path, key.hex(), error)

    def note_load(self, key: bytes, nbytes: int) -> None:
        """Count a served payload read and touch it for the LRU."""
        self.note_loads([key], nbytes)

    def note_loads(self, keys: Sequence[bytes], nbytes: int) -> None:
        """Count served payload reads (``nbytes`` in all; a stream's, at its end)
        and touch them for the LRU."""
        if not keys:
            return
        self._counts.add("num_loads", len(keys))
        self._counts.add("load_bytes", nbytes)
        with self._lock:
            self._touches.update(keys)

    def quarantine(self, key: bytes, raw: bytes, reason: str) -> None:
        """Drop a corrupt entry and its file; count it and log the first one."""
        try:
            dropped = self.index.quarantine(key, raw)  # > 1: other unreadable entries too
        except TierError as e:  # e.g. disk full: the block is still never served
            logger.debug("SSD tier: could not quarantine %s: %s", key.hex(), e)
            dropped = 1
        if not dropped:
            return  # evicted or replaced meanwhile: a plain miss
        self.report_removed([key])
        first = self._counts.add("num_corrupt", dropped) == dropped
        log = logger.warning if first else logger.debug
        log("SSD tier %s: corrupt block %s quarantined (%s)", self.path, key.hex(), reason)
