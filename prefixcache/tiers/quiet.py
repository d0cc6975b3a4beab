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

The yield is bounded. Back to back, every fetch reopens the window before it
closes, so a thread that waited for it to close would wait for ever while its
queue grew. A background thread waits at most one window's length
(:func:`deadline`) per batch or job, then runs anyway: on bursty traffic the
window still keeps prefills quiet, and under a steady stream each batch is
deferred by at most one window, so the background work gets a guaranteed
share of the time and its queue stays as short as the disk allows.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_until = 0.0  # time.monotonic() at which the window closes
_length = 0.0  # seconds of the last window opened: the longest a thread yields


def open_window(seconds: float) -> None:
    """A request starts: keep background work quiet for ``seconds`` from now."""
    global _until, _length
    if seconds > 0:
        end = time.monotonic() + seconds
        with _lock:
            _until = max(_until, end)
            _length = seconds


def remaining() -> float:
    """Seconds the window stays open (<= 0: closed)."""
    return _until - time.monotonic()


def deadline(since: float | None = None) -> float:
    """When a background thread stops waiting for quiet: one window's length
    after ``since`` (a ``time.monotonic()`` reading; default now)."""
    return (time.monotonic() if since is None else since) + _length


def wait_left(until: float) -> float:
    """Seconds to go on waiting for quiet with ``deadline()`` ``until`` (<= 0: run now)."""
    now = time.monotonic()
    return min(_until, until) - now


def close_window() -> None:
    """Close the window now (tests)."""
    global _until
    with _lock:
        _until = 0.0
