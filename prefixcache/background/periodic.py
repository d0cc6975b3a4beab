"""A daemon thread that calls one function every few seconds until stopped.

What keeps a cache's counters on disk between flushes: a process that is
killed (SIGKILL, OOM) loses at most one interval of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Periodic:
    """Calls ``fn`` every ``seconds`` on a daemon thread until :meth:`stop`.

    Args:
        seconds: the interval (> 0).
        fn: what to call; an ``OSError`` it raises is logged and the next call
            still happens (anything else is a bug and stops the thread, logged).
        name: the thread's name.
    """

    def __init__(self, seconds: float, fn: Callable[[], None], name: str) -> None:
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds!r}")
        self.seconds, self._fn = seconds, fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and wait for the thread (a call in progress finishes first)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            try:
                self._fn()
            except OSError as e:
                logger.warning("%s: %s", self._thread.name, e)
            except Exception:  # a bug: say so once, stop calling
                logger.exception("%s stopped", self._thread.name)
                return
