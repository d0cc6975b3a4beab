"""Freed cache memory leaves the process: MLX's buffer cache and the C heap given back.

When the cache drops arrays (evictions, ``trim_hot``, ``end_session``,
``close``, a written batch of the SSD writer's queue), their buffers go to
MLX's buffer cache (kept for reuse up to ``mx.set_cache_limit``) and what MLX
frees goes to the C allocator, which keeps freed heap chunks too (glibc: a
freed chunk raises its mmap threshold, so later big buffers come from the heap
and stay). Without help, RSS does not fall when the cache frees memory.

The policy: the places that free count the bytes (:func:`note_freed`); once
at least :data:`THRESHOLD` bytes were freed since the last give-back,
:func:`maybe` clears MLX's buffer cache (``mx.clear_cache``) and asks glibc to
return free heap pages (``malloc_trim(0)``); :func:`now` does it whatever was
counted (``close``, ``trim_hot(0)``). Its cost: the next allocations fault
fresh pages in instead of reusing freed ones (tools/bench_give_back.py
measures both); the threshold keeps it to large frees, never per block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import mlx.core as mx

logger = logging.getLogger(__name__)

THRESHOLD = 64 << 20  # bytes freed before a give-back is worth its faults

_lock = threading.Lock()
_freed = 0
_enabled = True


def _load_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_trim()


def set_enabled(enabled: bool) -> None:
    """Turn the give-back on or off for the process (off: the reference run of
    tools/bench_give_back.py)."""
    global _enabled
    _enabled = enabled


def note_freed(nbytes: int) -> None:
    """The cache let go of ``nbytes`` of arrays (they are freed once unreferenced)."""
    global _freed
    if nbytes > 0:
        with _lock:
            _freed += nbytes


def maybe() -> bool:
    """Give back if at least THRESHOLD bytes were freed since the last time."""
    with _lock:
        due = _freed >= THRESHOLD
    return now() if due else False


def now() -> bool:
    """Clear MLX's buffer cache and trim the C heap; False when turned off."""
    global _freed
    with _lock:
        _freed = 0
    if not _enabled:
        return False
    mx.clear_cache()
    if _malloc_trim is not None:
        _malloc_trim(0)
    return True


def cache_limit() -> int:
    """MLX's buffer cache limit now (bytes)."""
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit
