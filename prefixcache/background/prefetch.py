"""Prefetch and promotion: lower-tier blocks loaded into the tiers above on one
background thread.

Prefetch: a queued request's lower-tier blocks promoted into hot while it waits.

``PrefixCache.prefetch(tokens)`` plans the prompt's restore from metadata (as a
fetch would), and hands the blocks that only a lower tier (ssd, remote) holds
to one background thread, which loads them through their tier's reader (MLX
arrays evaluated on that thread) and puts them into hot under the cache's
lock. The later ``fetch`` of the prompt takes what has arrived from hot and
loads the rest itself: it waits for nothing. It also cancels what is still
queued for its prompt: a request served at once gains nothing from a copy being
made beside its own restore.

Bounded: at most ``prefetch_bytes`` of prefetched blocks not yet used are held
(a job stops there), and a block that no longer fits beside what hot holds is
not loaded. Counted: ``prefetched_blocks``, ``prefetch_hits`` (blocks a fetch
then took from hot), ``prefetch_wasted_bytes`` (prefetched, evicted unused).

Promotion: a fetch that restored lower-tier blocks (read straight into its
buffers: one copy) hands them here to be loaded again and kept above
(``TierStack.promote``: hot while it has room, evicting nothing; ssd for a remote
hit), so the request does not pay a second copy and an MLX array per tensor
(on the CPU at block 16, 4-5x the restore itself). Counted as promotions.
A promotion starts once the fetch's quiet window closes (quiet.py): its reads
and copies would otherwise run beside that request's prefill; back to back,
where the window never closes, it waits at most one window's length from its
fetch, so promotions never pile up behind a busy stream. A prefetch starts at
once: it is for a request still waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from ..stats import Stats
from ..tiers import quiet
from ..tiers.base import ChainEntry, Tier
from ..tiers.hot.tier import HotTier
from ..tiers.stack import TierStack

log = logging.getLogger(__name__)

_LOAD_ERRORS = (OSError, ValueError, RuntimeError)  # a tier that cannot load: a skipped block


@dataclass(slots=True)
class Job:
    """The lower-tier blocks of one prompt's plan, by tier, in chain order."""

    prompt: bytes  # the prompt's uint32 bytes and root: what its fetch cancels
    root: bytes
    keys: list[bytes]  # the plan's keys (a reader's indices refer to them)
    blocks: list[tuple[int, Tier, int]]  # (index in keys, tier, payload bytes)
    promote: bool = False  # a fetch's promotion (bounded by hot's room), not a prefetch
    cancelled: bool = field(default=False)
    queued: float = field(default_factory=time.monotonic)


class Prefetcher:
    """One background thread loading jobs' blocks into the tiers above theirs.

    Args:
        tiers: the cache's tiers (touched only under ``lock``).
        lock: the cache's lock.
        stats: where the counters go.
        max_bytes: prefetched blocks not yet used that may be held at once.
    """

    def __init__(
        self,
        tiers: TierStack,
        lock: AbstractContextManager,
        stats: Stats,
        max_bytes: int,
    ):
        self.tiers, self.lock, self.stats, self.max_bytes = tiers, lock, stats, max_bytes
        self.hot: HotTier = tiers.hot
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._open: list[Job] = []  # queued or running (guarded by ``lock``)
        self._unused: dict[bytes, int] = {}  # prefetched, not yet used: key -> bytes
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(threading.Lock())
        self._pending = 0  # jobs submitted and not finished
        self._joins = 0  # joins waiting (under ``_idle``): promotions skip the quiet window
        self.loading_bytes = 0  # the block being loaded, not yet in a tier (RAM beside them)

    def submit(self, job: Job) -> int:
        """Queue ``job`` (called under the lock); returns how many blocks it holds."""
        if not job.blocks or (self.max_bytes <= 0 and not job.promote):
            return 0
        self._open.append(job)
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="prefixcache-prefetch", daemon=True
            )
            self._thread.start()
        self._jobs.put(job)
        return len(job.blocks)

    def fetching(self, prompt: bytes, root: bytes) -> None:
        """A fetch of ``prompt`` starts (under the lock): its queued blocks are not loaded."""
        self._forget_evicted()  # before the fetch promotes anything back
        for job in self._open:
            if job.prompt == prompt and job.root == root:
                job.cancelled = True

    def used(self, keys: Sequence[bytes]) -> None:
        """A fetch restored ``keys`` (under the lock): prefetched ones count as hits."""
        for key in keys:
            if self._unused.pop(key, None) is not None:
                self.stats.prefetch_hits += 1

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far is done (call without the lock);
        False if ``timeout`` passed first."""
        with self._idle:
            self._joins += 1
            try:
                return self._idle.wait_for(lambda: self._pending == 0, timeout)
            finally:
                self._joins -= 1

    def close(self) -> None:
        """Stop the thread after the block it is loading (call without the lock)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            with self.lock:
                for job in self._open:
                    job.cancelled = True
            self._jobs.put(None)
            thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._do(job)
            except Exception:  # never kill the thread: the next job is independent
                log.exception("prefixcache: prefetch failed")
            finally:
                with self.lock:
                    self._open.remove(job)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _do(self, job: Job) -> None:
        until = quiet.deadline(job.queued)
        while job.promote and (left := quiet.wait_left(until)) > 0:
            if job.cancelled or self._joins:
                break
            time.sleep(min(left, 0.01))  # what ends the wait early is seen within 10 ms
        for tier in dict.fromkeys(t for _, t, _ in job.blocks):
            mine = [(i, n) for i, t, n in job.blocks if t is tier]
            reader = tier.reader(job.keys)
            try:
                reader.prepare([i for i, _ in mine], None)
                for index, nbytes in mine:
                    if not self._room(job, tier, nbytes):
                        return
                    self.loading_bytes = nbytes
                    try:
                        loaded = reader.load(index)
                        if loaded is None:
                            return  # the chain stops here: later blocks cannot be used
                        self._put(job, tier, loaded.to_block())  # evaluated on this thread
                    except _LOAD_ERRORS as err:
                        log.debug("prefixcache: prefetch of a block failed: %s", err)
                        return
                    finally:
                        self.loading_bytes = 0
            finally:
                reader.close()

    def _room(self, job: Job, tier: Tier, nbytes: int) -> bool:
        """Whether to load one more block of ``job`` (not cancelled; within bounds)."""
        with self.lock:
            self._forget_evicted()
            if job.cancelled:
                return False
            if job.promote:
                return self.tiers.promotable(tier, nbytes)
            unused = sum(self._unused.values())
            return unused + nbytes <= self.max_bytes and nbytes <= self.hot.max_bytes

    def _put(self, job: Job, tier: Tier, block) -> None:
        with self.lock:
            if job.cancelled:
                return
            if job.promote:
                self.tiers.promote(tier, block)
                return
            if block.key in self.hot:
                return
            if self.hot.put(block):
                self._unused[block.key] = block.nbytes
                self.stats.prefetched_blocks += 1

    def _forget_evicted(self) -> None:
        """Prefetched blocks evicted before any fetch used them: wasted."""
        gone = [k for k in self._unused if k not in self.hot]
        for key in gone:
            self.stats.prefetch_wasted_bytes += self._unused.pop(key)


def job_of(
    prompt: bytes,
    root: bytes,
    entries: Sequence[ChainEntry],
    tiers: Sequence[Tier],
    keep: Callable[[bytes], bool],
) -> Job:
    """The job of a plan: its blocks held by a lower tier only (``keep``: not in hot)."""
    keys = [e.key for e in entries]
    blocks = [
        (i, tier, e.nbytes)
        for i, (e, tier) in enumerate(zip(entries, tiers, strict=True))
        if not tier.resident and keep(e.key)
    ]
    return Job(prompt, root, keys, blocks)
