"""mlx-lm's generation loop, started again when it raises.

mlx-lm's server runs every request on one generation thread; an exception its
loop does not catch ends the thread, and from then on every request fails and
``/health`` answers 503 while the process stays up. ``Supervisor.run`` runs the
loop instead: when it raises, the requests the loop had taken (``Replies``)
get a ``GenerationFailed`` naming the cause (their HTTP threads answer 500
rather than wait), the failure is counted and logged, and the loop starts
again; requests still queued are served by the new loop. The prompt cache and
its tiers are the loop's caller's, untouched by a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from queue import Queue
from typing import Any

log = logging.getLogger(__name__)

MAX_BACKOFF = 2.0  # seconds between restarts of a loop that keeps failing at once
QUICK = 1.0  # a failure this soon after a restart counts as failing at once


class GenerationFailed(RuntimeError):
    """A request failed inside the generation thread: the server's fault (500)."""

    status = 500


class Replies:
    """The reply queues of the requests the generation loop has taken and not finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[Reply] = set()

    def track(self, queue: Queue) -> Reply:
        """``queue`` as the loop holds it: a ``Reply`` that forwards what it is given."""
        reply = Reply(queue, self)
        with self._lock:
            self._open.add(reply)
        return reply

    def finished(self, reply: Reply) -> None:
        with self._lock:
            self._open.discard(reply)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def fail_all(self, err: BaseException) -> int:
        """Put ``err`` on every open reply (each request's HTTP thread raises it); how many."""
        with self._lock:
            replies, self._open = self._open, set()
        for reply in replies:
            reply.queue.put(err)
        return len(replies)


class Reply:
    """One request's reply queue on the generation thread's side: puts go to the
    request's HTTP thread; the last one (None: done, or an exception) closes it."""

    __slots__ = ("_replies", "queue")

    def __init__(self, queue: Queue, replies: Replies):
        self.queue = queue
        self._replies = replies

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self.queue.put(item, block, timeout)
        if item is None or isinstance(item, BaseException):
            self._replies.finished(self)


class Supervisor:
    """Runs a generation loop and starts it again each time it raises.

    ``num_restarts`` counts the restarts; ``restarting`` is True from a failure until
    the new loop asks for its first request (``running``).
    """

    def __init__(self) -> None:
        self.replies = Replies()
        self.num_restarts = 0
        self.restarting = False
        self.last_error = ""

    def run(self, loop: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """Call ``loop`` until it returns, or raises once ``stopped()`` is true."""
        failures, started = 0, time.monotonic()
        while True:
            try:
                loop()
                return
            except Exception as err:
                if stopped():
                    log.exception("prefixcache serve: generation loop failed while stopping")
                    return
                self._failed(err)
            failures = failures + 1 if time.monotonic() - started < QUICK else 1
            if failures > 1:  # failing at once again: do not spin
                time.sleep(min(MAX_BACKOFF, 0.05 * 2**failures))
            started = time.monotonic()

    def _failed(self, err: Exception) -> None:
        self.restarting = True
        self.num_restarts += 1
        self.last_error = f"{type(err).__name__}: {err}"
        cause = GenerationFailed(
            f"generation failed ({self.last_error}); the server restarted its generation "
            "thread: retry the request"
        )
        num = self.replies.fail_all(cause)
        log.error(
            "prefixcache serve: generation thread failed (%s), %d request(s) in flight "
            "failed; restarting it (restart %d)",
            self.last_error,
            num,
            self.num_restarts,
            exc_info=err,
        )

    def running(self) -> None:
        """The loop is taking requests again."""
        self.restarting = False
