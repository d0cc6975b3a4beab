"""Background writer of the SSD tier: one daemon thread and a queue bounded in bytes.

The caller's thread only queues (the arrays are already evaluated and their
bytes taken as zero-copy views); the thread hands batches to a write function
that does the file and index I/O and runs no MLX computation. A queued block
stays visible through :meth:`Writer.pending` until its batch is written and
indexed, so there is no window in which a just-queued block is unreadable.
Failures are counted, logged once and re-raised by :meth:`Writer.close`.
The thread yields to a fetch's quiet window (quiet.py), at most one window's
length per batch, and not at all when it is urgent (a flush waits, or the
queue is over half full): back to back it still writes, so the queue stays
near empty at any rate the disk sustains. When the disk cannot keep up, the
queue stops at its bound and the caller's tier applies ``queue_full``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..blocks import Block
from ..memory import give_back
from ..memory.host import Tensor
from . import quiet
from .run_length import whole_runs

logger = logging.getLogger(__name__)

_BATCH_ITEMS = 256  # items a batch takes at most


@dataclass(slots=True)
class WriteItem:
    """One queued block: the block itself (served while pending) and its byte views."""

    block: Block
    tensors: list[Tensor] = field(repr=False)
    nbytes: int
    queued: float = field(default_factory=time.time)

    def fresh_block(self) -> Block:
        """A copy of the pending block with new arrays (the queue keeps its own);
        on the caller's thread: it runs MLX."""
        b = self.block
        arrays = {name: mx.array(arr) for name, arr in b.arrays.items()}
        mx.eval(arrays)
        return Block(b.key, b.parent, b.root, b.index, b.tokens, arrays, b.nbytes, b.tenant)


class Writer:
    """A daemon thread that drains a byte-bounded queue into ``write_batch``.

    Args:
        write_batch: does the I/O for a list of items (on the writer thread).
        max_bytes: bound of the queue: the sum of ``nbytes`` of queued items,
            including the batch being written; an empty queue takes one item
            whatever its size (a bound below one block would drop them all).
        housekeeping: called after every batch and on :meth:`wake` (e.g. to
            apply deferred LRU touches).
        hold: if given, the thread waits for this event before each batch; lets
            tests keep blocks pending with a real thread.
        batch_bytes: a batch is cut once it holds this many bytes.
        run_tokens: where a batch is cut inside a chain that goes on in the queue
            (or at the linger's cap while items keep coming: a store still queuing),
            it ends at the last whole run (``run_blocks``) from the chain's first
            block in it (the SSD tier's run files: a cut at the bound made a short
            file); 0: where the bound falls.
        run_growth: a run also holds up to this share of the tokens before it
            (``run_blocks``).
        linger: seconds a batch waits for more items while they keep coming (each
            within ``linger`` of the last), at most ``8 * linger`` from its first
            one, unless it is urgent: a store's blocks queued one by one are then
            written together (the SSD tier's run files); 0: never.
    """

    def __init__(
        self,
        write_batch: Callable[[list[WriteItem]], None],
        *,
        max_bytes: int,
        housekeeping: Callable[[], None] | None = None,
        hold: threading.Event | None = None,
        batch_bytes: int = 64 << 20,
        run_tokens: int = 0,
        run_growth: float = 0.0,
        linger: float = 0.0,
        name: str = "prefixcache-ssd-writer",
    ) -> None:
        self.max_bytes = max_bytes
        self.num_failures = 0
        self._write_batch = write_batch
        self._housekeeping = housekeeping
        self._hold = hold
        self._batch_bytes = batch_bytes
        self._run_tokens = run_tokens
        self._run_growth = run_growth
        self._linger = linger
        self._last_in = 0.0  # time.monotonic() of the last item queued
        self._cond = threading.Condition()
        self._queue: deque[WriteItem] = deque()
        self._pending: dict[bytes, WriteItem] = {}
        self._by_parent: dict[bytes, dict[bytes, None]] = {}  # parent -> pending child keys
        self._queue_bytes = 0
        self._num_in = 0  # items ever queued
        self._num_out = 0  # items ever finished (written, skipped or failed)
        self._requested = 0  # housekeeping rounds asked for (wake / flush)
        self._flushing = 0  # the last round a flush waits for: urgent until done
        self._done = 0  # last round finished
        self._stop = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queue_bytes(self) -> int:
        return self._queue_bytes

    def submit(self, item: WriteItem) -> bool:
        """Queue an item; False (nothing queued) if the queue holds items and it
        does not fit beside them in the bound."""
        with self._cond:
            if self._stop:
                raise RuntimeError("the SSD writer is closed")
            if item.block.key in self._pending:
                return True
            if self._queue and self._queue_bytes + item.nbytes > self.max_bytes:
                return False
            self._queue.append(item)
            self._pending[item.block.key] = item
            self._by_parent.setdefault(item.block.parent, {})[item.block.key] = None
            self._queue_bytes += item.nbytes
            self._num_in += 1
            self._last_in = time.monotonic()
            self._cond.notify_all()
        return True

    def pending(self, key: bytes) -> WriteItem | None:
        """The queued item of ``key``, until it is written and indexed."""
        with self._cond:
            return self._pending.get(key)

    def pending_many(self, keys: Sequence[bytes]) -> list[WriteItem | None]:
        """``pending`` of each of ``keys``, under one hold of the lock (a restore's
        chain: a lock and a lookup per block otherwise)."""
        with self._cond:
            if not self._pending:
                return [None] * len(keys)
            return [self._pending.get(key) for key in keys]

    def pending_children(self, parent: bytes) -> list[WriteItem]:
        """Queued items whose block's parent is ``parent``."""
        with self._cond:
            return [self._pending[key] for key in self._by_parent.get(parent, ())]

    def wake(self) -> None:
        """Ask for a housekeeping round without waiting for it."""
        with self._cond:
            self._requested += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every item queued so far is finished and housekeeping has run."""
        with self._cond:
            self._requested += 1
            round_, target = self._requested, self._num_in
            self._flushing = round_
            self._cond.notify_all()
            while (self._done < round_ or self._num_out < target) and self._thread.is_alive():
                self._cond.wait()

    def close(self) -> None:
        """Flush, stop the thread, and re-raise the first failure (once)."""
        if self._thread.is_alive():
            self.flush()
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def run_inline(self, items: list[WriteItem]) -> bool:
        """Write on the calling thread (queue-full policy ``inline``); False on failure."""
        return self._call(self._write_batch, items)

    def record_failure(self, exc: BaseException) -> None:
        """Count a failure, log the first one, keep it for :meth:`close`."""
        with self._cond:
            self.num_failures += 1
            first = self.num_failures == 1
            if self._failure is None:
                self._failure = exc
        if first:
            logger.error("SSD writer failed (later failures are counted only): %r", exc)
        else:
            logger.debug("SSD writer failed again: %r", exc)

    def _call(self, fn: Callable[..., None], *args: object) -> bool:
        try:
            fn(*args)
        except Exception as exc:  # a background thread records whatever broke it
            self.record_failure(exc)
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._requested > self._done or self._stop):
                    self._cond.wait()
                if self._stop and not self._queue:
                    return
                has_work = bool(self._queue)
                self._wait_quiet()
                self._wait_more()
            if has_work and self._hold is not None:
                self._hold.wait()
            with self._cond:
                round_ = self._requested
                batch = self._take()
            if batch:
                self._call(self._write_batch, batch)
            if self._housekeeping is not None:
                self._call(self._housekeeping)
            with self._cond:
                for item in batch:
                    self._queue.popleft()
                    del self._pending[item.block.key]
                    kids = self._by_parent[item.block.parent]
                    del kids[item.block.key]
                    if not kids:
                        del self._by_parent[item.block.parent]
                    self._queue_bytes -= item.nbytes
                self._num_out += len(batch)
                self._done = max(self._done, round_)
                self._cond.notify_all()
            batch = []  # the written blocks' arrays are unreferenced now
            give_back.maybe()

    def _wait_quiet(self) -> None:
        """While a fetch's quiet window is open, wait (under ``_cond``) at most one
        window's length, unless a flush waits, the writer stops, or the queue is
        over half full."""
        until = quiet.deadline()
        while (left := quiet.wait_left(until)) > 0:
            if self._urgent():
                return
            self._cond.wait(left)

    def _wait_more(self) -> None:
        """While items keep coming (see ``linger``), wait (under ``_cond``) for the
        batch to fill, unless the writer stops, a flush waits or the queue is over
        half full."""
        if not self._linger or not self._queue:
            return
        until = time.monotonic() + 8 * self._linger
        while len(self._queue) < _BATCH_ITEMS and self._queue_bytes < self._batch_bytes:
            if self._urgent():
                return
            now = time.monotonic()
            left = min(self._last_in + self._linger, until) - now
            if left <= 0:
                return
            self._cond.wait(left)

    def _take(self) -> list[WriteItem]:
        """The next batch, left in the queue (still pending) until it is written."""
        batch, nbytes = [], 0
        for item in itertools.islice(self._queue, _BATCH_ITEMS):
            if batch and nbytes + item.nbytes > self._batch_bytes:
                break
            batch.append(item)
            nbytes += item.nbytes
        if not self._run_tokens:
            return batch
        if len(batch) < len(self._queue):  # cut at a bound
            return whole_runs(batch, self._queue[len(batch)], self._run_tokens, self._run_growth)
        if self._coming():  # cut at a bound or the linger's cap while a store still queues
            return whole_runs(batch, None, self._run_tokens, self._run_growth)
        return batch

    def _coming(self) -> bool:
        """Whether items keep coming (the last within ``linger``) and nothing is urgent."""
        return time.monotonic() - self._last_in < self._linger and not self._urgent()

    def _urgent(self) -> bool:
        """A flush waits, the writer stops, or the queue is over half full (under ``_cond``)."""
        return self._stop or self._flushing > self._done or 2 * self._queue_bytes > self.max_bytes
