"""Thread pools shared by the process, made again in a forked child.

A pool's threads do not survive ``fork``: the child's copy of the executor
would queue jobs that no thread runs, and its caller would wait forever. So
each pool is made on first use, and a forked child forgets the parent's.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


class SharedPool:
    """One ``ThreadPoolExecutor`` of ``threads`` for the process, made on first use."""

    def __init__(self, threads: int, name: str):
        self.threads, self.name = threads, name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            return self._pool

    def _forget(self) -> None:
        self._lock = threading.Lock()  # the parent may have held it while forking
        self._pool = None
