"""Background work yields to a request starting: the process's quiet window.

A fetch is followed by its request's prefill. A background batch run beside it
(payload files, fsyncs and index commits; a promotion's reads and copies)
takes cores and the GIL from that prefill: on a 2-core CPU a prefill beside
one such thread took 1.2-1.45x as long (tools/bench_contention.py; the serving
trace: tools/bench_quiet.py). So each fetch opens a short window in which the
writers (writer.py) and promotion (prefetch.py) start nothing new unless it is
urgent (a flush, a queue over half full). The server adapter opens it at a
request's last insert too: the next request's fetch follows at once, and a
batch the writer started on that insert's blocks would run beside its
prefill. The window is the process's, not a cache's: the cores and the GIL are.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_until = 0.0  # time.monotonic() at which the window closes


def open_window(seconds: float) -> None:
    """A request starts: keep background work quiet for ``seconds`` from now."""
    global _until
    if seconds > 0:
        end = time.monotonic() + seconds
        with _lock:
            _until = max(_until, end)


def remaining() -> float:
    """Seconds the window stays open (<= 0: closed)."""
    return _until - time.monotonic()


def close_window() -> None:
    """Close the window now (tests)."""
    global _until
    with _lock:
        _until = 0.0
