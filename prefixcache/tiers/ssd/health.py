"""Whether the SSD tier takes writes: a run-time failure turns it off, a probe turns it on.

A failure of the disk or the index while serving (permissions, disk full, an
LMDB or I/O error) must not reach the caller: the tier stops taking writes
(blocks already stored stay readable while they can be read), logs one line,
counts it, and after ``retry_seconds`` the writer thread probes the directory
and turns writes back on if the cause is gone.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter

logger = logging.getLogger(__name__)


COUNTERS = (  # every counter of the tier: stats() shows each, 0 until it moves
    "num_writes",
    "written_bytes",
    "num_dropped_writes",
    "num_inline_writes",
    "num_existing",
    "num_no_room",
    "num_evictions",
    "num_failures",
    "num_disk_full",
    "num_recoveries",
    "num_corrupt",
    "num_read_errors",
    "num_loads",
    "load_bytes",
    "num_pending_loads",
)


class Counts:
    """The tier's counters, safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, num: int = 1) -> int:
        """Add ``num`` to ``name``; returns the new value."""
        with self._lock:
            self._counts[name] += num
            return self._counts[name]

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def every(self) -> dict[str, int]:
        """Each of ``COUNTERS`` (0 if it never moved), in that order."""
        with self._lock:
            return {name: self._counts[name] for name in COUNTERS}


class Health:
    """On/off state of one tier's writes, with the last failure and the retry clock.

    Args:
        path: the tier's directory (for the log lines).
        retry_seconds: how long after a failure the next probe may run.
        counts: where ``num_failures``, ``num_disk_full`` and ``num_recoveries`` go.
    """

    def __init__(self, path: str, retry_seconds: float, counts: Counts) -> None:
        self.path, self.retry_seconds, self.counts = path, retry_seconds, counts
        self._lock = threading.Lock()
        self._enabled = True
        self._failed_at = 0.0
        self.reason: str | None = None  # the last failure, kept after a recovery

    @property
    def enabled(self) -> bool:
        return self._enabled

    def fail(self, error: BaseException) -> None:
        """Turn writes off after ``error``; one log line per failure that turns them off."""
        self.counts.add("num_failures")
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            self.counts.add("num_disk_full")
        with self._lock:
            was_enabled, self._enabled = self._enabled, False
            self._failed_at = time.monotonic()
            self.reason = f"{type(error).__name__}: {error}"
        if was_enabled:
            logger.error(
                "SSD tier %s disabled (%s); serving from the hot tier and the blocks already "
                "stored, retrying in %gs",
                self.path,
                self.reason,
                self.retry_seconds,
            )

    def retry_due(self) -> bool:
        """Writes are off and the last failure is at least ``retry_seconds`` old."""
        with self._lock:
            return not self._enabled and time.monotonic() - self._failed_at >= self.retry_seconds

    def still_failing(self, error: BaseException) -> None:
        """A probe failed: try again in ``retry_seconds`` (logged at debug only)."""
        with self._lock:
            self._failed_at = time.monotonic()
            self.reason = f"{type(error).__name__}: {error}"
        logger.debug("SSD tier %s still unusable: %s", self.path, self.reason)

    def recover(self) -> None:
        """A probe succeeded: writes are on again."""
        with self._lock:
            was_enabled, self._enabled = self._enabled, True
        if not was_enabled:
            self.counts.add("num_recoveries")
            logger.warning("SSD tier %s re-enabled (last failure: %s)", self.path, self.reason)
