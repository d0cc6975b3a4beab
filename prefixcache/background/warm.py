"""Warm start: after a restart, load pinned blocks and the most recently used chains into hot.

Runs on its own daemon thread, started when a cache opens with ``warm_bytes``
set. The plan comes from each persistent lower tier's ``recent`` (for the SSD
tier: pinned chains first, then the chains of the most recently used leaves,
each root-first). Each block is read and its arrays evaluated on this thread
(MLX streams are per thread, and a thread must evaluate what it builds); the
cache's lock is taken only to insert one block, so requests arriving
meanwhile are served (from the lower tiers until their blocks are hot) and
wait at most for one insert. Requests go first: before each block, while a
request holds the lock, the thread waits for it and a moment more, so a burst
of requests is served before the warm-up reads on. Only free room is used: a
warm block never evicts a block a request stored, and it goes in at the cold
end of the LRU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import mlx.core as mx

from ..tiers.base import Persistent, Tier
from ..tiers.stack import TierStack

logger = logging.getLogger(__name__)

_QUIET_S = 0.05  # no request for this long: the warm-up reads its next block


class CacheLock(Protocol):
    """The cache's lock (a ``threading.RLock``)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, *exc: object) -> None: ...


class WarmStart:
    """Loads up to ``max_bytes`` of blocks from the lower tiers into hot, in the background.

    Args:
        tiers: the cache's tiers.
        lock: the cache's lock (held around each insert only).
        max_bytes: bytes to load at most (``warm_bytes``).
        clock: time source (seconds).
    """

    def __init__(
        self,
        tiers: TierStack,
        lock: CacheLock,
        max_bytes: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.tiers, self.lock, self.max_bytes, self.clock = tiers, lock, max_bytes, clock
        self.num_blocks = self.nbytes = 0
        self.seconds: float | None = None  # once done
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefixcache-warm", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop loading and wait for the thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def stats(self) -> dict[str, int | float]:
        return {
            "num_blocks": self.num_blocks,
            "nbytes": self.nbytes,
            "done": int(self.done.is_set()),
            "seconds": self.seconds or 0.0,
        }

    def _run(self) -> None:
        began = self.clock()
        try:
            for tier in self.tiers.lower:
                if not self._load_from(tier):
                    break
        except Exception:  # a background thread reports what broke it and stops
            logger.exception("warm start stopped")
        finally:
            self.seconds = self.clock() - began
            self.done.set()
        blocks, nbytes, seconds = self.num_blocks, self.nbytes, self.seconds
        logger.info("warm start: %d blocks (%d bytes) into hot in %.2fs", blocks, nbytes, seconds)

    def _load_from(self, tier: Tier) -> bool:
        """Load ``tier``'s recent blocks while there is room; False once full or stopped."""
        hot = self.tiers.hot
        entries = tier.recent(self.max_bytes - self.nbytes) if isinstance(tier, Persistent) else ()
        for entry in entries:
            self._wait_quiet()
            if self._stop.is_set() or self.nbytes + entry.nbytes > self.max_bytes:
                return False
            with self.lock:
                if entry.key in hot:
                    continue
                if entry.nbytes > hot.room:
                    return False
            loaded = tier.reader([entry.key]).load(0)
            if loaded is None:
                continue
            block = loaded.to_block()
            mx.eval(block.arrays)  # built on this thread: evaluated here
            with self.lock:
                has_parent = block.parent == block.root or block.parent in hot
                room = block.nbytes <= hot.room
                if entry.key not in hot and has_parent and room:
                    hot.put(block, at_cold_end=True)
                    self.num_blocks += 1
                    self.nbytes += block.nbytes
        return True

    def _wait_quiet(self) -> None:
        """Wait while a request holds the cache's lock, and ``_QUIET_S`` after it, until
        the lock is found free (or a stop)."""
        while not self._stop.is_set():
            if self.lock.acquire(blocking=False):
                self.lock.release()
                return
            with self.lock:  # a request is being served: wait for it
                pass
            self._stop.wait(_QUIET_S)  # the next request of a burst goes first
